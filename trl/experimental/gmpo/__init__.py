"""Geometric-Mean Policy Optimization (GMPO): GRPO whose sequence objective uses the geometric mean of the clipped
token ratios.

Experimental: the API may change or be removed in any release.
"""

from .gmpo_config import GMPOConfig
from .gmpo_trainer import GMPOTrainer, gmpo_sequence_ratio


__all__ = ["GMPOConfig", "GMPOTrainer", "gmpo_sequence_ratio"]
