"""Deprecated location of the KTO trainer: use `trl.KTOConfig` and `trl.KTOTrainer`.

The classes here are thin subclasses of the stable ones that emit a `FutureWarning` when used; they will be removed in
TRL 2.0.
"""

from ...trainer.kto_config import KTOConfig as _KTOConfig
from ...trainer.kto_trainer import KTOTrainer as _KTOTrainer
from .._stable_aliases import deprecated_aliases


KTOConfig, KTOTrainer = deprecated_aliases(_KTOConfig, _KTOTrainer, package="kto", method="KTO")

__all__ = ["KTOConfig", "KTOTrainer"]
