"""Self-distillation losses (the same module as SDFT's; written once in `trl.experimental._self_distillation.loss_utils`)."""

from .._self_distillation.loss_utils import *  # noqa: F403
from .._self_distillation.loss_utils import __all__  # noqa: F401
