"""Triple Preference Optimization (TPO): preference optimisation on (chosen, rejected, gold reference) triples in one
stage, without a reference model.

Experimental: the API may change or be removed in any release.
"""

from .tpo_config import TPOConfig
from .tpo_trainer import TPOTrainer


__all__ = ["TPOConfig", "TPOTrainer"]
