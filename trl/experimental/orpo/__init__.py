"""Odds Ratio Preference Optimization (ORPO): reference-free, monolithic preference optimisation.

Experimental: the API may change or be removed in any release.
"""

from .orpo_config import ORPOConfig
from .orpo_trainer import ORPOTrainer


__all__ = ["ORPOConfig", "ORPOTrainer"]
