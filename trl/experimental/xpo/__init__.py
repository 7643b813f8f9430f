"""XPO (Exploratory Preference Optimization): Online DPO between policy and reference samples, plus an exploration
bonus.

Experimental: the API may change or be removed in any release.
"""

from .xpo_config import XPOConfig
from .xpo_trainer import XPOTrainer


__all__ = ["XPOConfig", "XPOTrainer"]
