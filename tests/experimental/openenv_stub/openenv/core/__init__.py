"""Test stand-in of `openenv.core`."""
