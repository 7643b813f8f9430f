"""GOLD (General Online Logit Distillation): on/off-policy distillation, also between models whose tokenizers differ
(Universal Logit Distillation, Boizard et al. 2024, with tokenizer-aware alignment).

Experimental: the API may change or be removed in any release.
"""

from .gold_config import GOLDConfig
from .gold_trainer import GOLDTrainer


__all__ = ["GOLDConfig", "GOLDTrainer"]
