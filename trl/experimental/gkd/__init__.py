"""Generalized Knowledge Distillation (GKD, Agarwal et al. 2024): a student trained to match a teacher's next-token
distributions, on dataset, student-generated (on-policy) or teacher-generated completions.

Experimental: the API may change or be removed in any release.
"""

from .gkd_config import GKDConfig
from .gkd_trainer import GKDTrainer


__all__ = ["GKDConfig", "GKDTrainer"]
