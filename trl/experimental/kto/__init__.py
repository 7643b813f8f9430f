"""Deprecated location of the KTO trainer: use `trl.KTOConfig` and `trl.KTOTrainer`.

The classes here are thin subclasses of the stable ones that emit a `FutureWarning` when used; they will be removed in
TRL 2.0.
"""

import warnings
from dataclasses import dataclass

from ...trainer.kto_config import KTOConfig as _KTOConfig
from ...trainer.kto_trainer import KTOTrainer as _KTOTrainer


_MESSAGE = (
    "trl.experimental.kto.{name} is deprecated and will be removed in TRL 2.0; KTO is now stable: use trl.{name} "
    "(`from trl import {name}`) instead."
)


@dataclass
class KTOConfig(_KTOConfig):
    """Deprecated alias of [`trl.KTOConfig`] (emits a `FutureWarning`)."""

    def __post_init__(self):
        warnings.warn(_MESSAGE.format(name="KTOConfig"), FutureWarning, stacklevel=3)
        super().__post_init__()


class KTOTrainer(_KTOTrainer):
    """Deprecated alias of [`trl.KTOTrainer`] (emits a `FutureWarning`)."""

    def __init__(self, *args, **kwargs):
        warnings.warn(_MESSAGE.format(name="KTOTrainer"), FutureWarning, stacklevel=2)
        super().__init__(*args, **kwargs)


__all__ = ["KTOConfig", "KTOTrainer"]
