"""SDFT: self-distillation fine-tuning (the model with privileged context teaches the model without it).

Experimental: the API may change or be removed in any release.
"""

from . import loss_utils, teacher_sync
from .sdft_config import SDFTConfig
from .sdft_trainer import SDFTTrainer


__all__ = ["SDFTConfig", "SDFTTrainer", "loss_utils", "teacher_sync"]
