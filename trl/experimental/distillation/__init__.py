"""Deprecated location of the on-policy distillation trainer: use `trl.DistillationConfig` and
`trl.DistillationTrainer`.

The classes here are thin subclasses of the stable ones that emit a `FutureWarning` when used; they will be removed in
TRL 2.0.
"""

from ...trainer.distillation_config import DistillationConfig as _DistillationConfig
from ...trainer.distillation_trainer import DistillationTrainer as _DistillationTrainer
from .._stable_aliases import deprecated_aliases


DistillationConfig, DistillationTrainer = deprecated_aliases(
    _DistillationConfig, _DistillationTrainer, package="distillation", method="Distillation"
)

__all__ = ["DistillationConfig", "DistillationTrainer"]
