"""EMA teacher updates (the same module as SDPO's; written once in `trl.experimental._self_distillation.teacher_sync`)."""

from .._self_distillation.teacher_sync import *  # noqa: F403
from .._self_distillation.teacher_sync import __all__  # noqa: F401
