"""Process-supervised reward models (PRM): a token classifier trained to judge every reasoning step.

Experimental: the API may change or be removed in any release.
"""

from .prm_config import PRMConfig
from .prm_trainer import PRMTrainer, compute_accuracy


__all__ = ["PRMConfig", "PRMTrainer", "compute_accuracy"]
