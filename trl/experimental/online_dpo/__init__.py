"""Online DPO: DPO on completion pairs sampled from the policy during training and ranked by reward models, reward
functions or a pairwise judge.

Experimental: the API may change or be removed in any release.
"""

from .online_dpo_config import OnlineDPOConfig
from .online_dpo_trainer import OnlineDPOTrainer


__all__ = ["OnlineDPOConfig", "OnlineDPOTrainer"]
