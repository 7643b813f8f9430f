"""Test stand-in for `openenv-core` 0.3.0 (see ../README.md): only `openenv.core.harness` and `openenv.core.llm_client`."""

__version__ = "0.3.0+trl-test-stub"
