"""SDPO: self-distillation policy optimization (successful rollouts and environment feedback teach the model).

Experimental: the API may change or be removed in any release.
"""

from . import loss_utils, teacher_sync
from .sdpo_config import SDPOConfig
from .sdpo_trainer import SDPOTrainer


__all__ = ["SDPOConfig", "SDPOTrainer", "loss_utils", "teacher_sync"]
