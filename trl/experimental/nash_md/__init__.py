"""Nash-MD (Nash learning from human feedback by mirror descent): the policy plays against a geometric mixture of
itself and the reference model.

Experimental: the API may change or be removed in any release.
"""

from .nash_md_config import NashMDConfig
from .nash_md_trainer import NashMDTrainer


__all__ = ["NashMDConfig", "NashMDTrainer"]
