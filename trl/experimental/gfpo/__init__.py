"""Group Filtered Policy Optimization (GFPO): GRPO trained on a filtered subset of each group.

Experimental: the API may change or be removed in any release.
"""

from .gfpo_config import GFPOConfig
from .gfpo_trainer import GFPOTrainer, top_rows_per_group


__all__ = ["GFPOConfig", "GFPOTrainer", "top_rows_per_group"]
