"""GSPO-token: GRPO with token-level importance weights whose value is the sequence ratio (GSPO paper, section 4.3).

Experimental: the API may change or be removed in any release.
"""

from .grpo_trainer import GRPOTrainer


__all__ = ["GRPOTrainer"]
