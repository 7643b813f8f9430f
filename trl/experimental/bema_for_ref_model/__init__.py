"""BEMA for the reference model: a `BEMACallback` that can also copy its averaged weights into the reference model,
and a `DPOTrainer` whose callbacks receive the reference model."""

from .callback import BEMACallback
from .dpo_trainer import DPOTrainer


__all__ = ["BEMACallback", "DPOTrainer"]
