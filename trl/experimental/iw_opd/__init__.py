"""IW-OPD: importance-weighted on-policy distillation (configuration and loss; the trainer is not built yet).

Experimental: the API may change or be removed in any release.
"""

from . import iw_opd_trainer
from .iw_opd_config import IWOPDConfig


__all__ = ["IWOPDConfig", "iw_opd_trainer"]
