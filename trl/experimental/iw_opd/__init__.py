"""IW-OPD: importance-weighted on-policy distillation.

Experimental: the API may change or be removed in any release.
"""

from . import iw_opd_trainer
from .iw_opd_config import IWOPDConfig
from .iw_opd_trainer import IWOPDTrainer


__all__ = ["IWOPDConfig", "IWOPDTrainer", "iw_opd_trainer"]
