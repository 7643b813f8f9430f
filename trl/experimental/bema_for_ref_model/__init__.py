"""BEMA for the reference model: a `BEMACallback` that can also copy its averaged weights into the reference model."""

from .callback import BEMACallback


__all__ = ["BEMACallback"]
