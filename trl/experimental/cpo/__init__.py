"""Contrastive Preference Optimization (CPO) and its reference-free variants SimPO and AlphaPO.

Experimental: the API may change or be removed in any release.
"""

from .cpo_config import CPOConfig
from .cpo_trainer import CPOTrainer


__all__ = ["CPOConfig", "CPOTrainer"]
