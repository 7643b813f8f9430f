"""Deprecated `trl.experimental.<method>` classes of methods that TRL has since made stable.

Each alias is a thin subclass of the stable class that emits a `FutureWarning` when instantiated; they will be removed
in TRL 2.0.
"""

import warnings
from dataclasses import dataclass


_MESSAGE = (
    "trl.experimental.{package}.{name} is deprecated and will be removed in TRL 2.0; {method} is now stable: use "
    "trl.{name} (`from trl import {name}`) instead."
)


def deprecated_aliases(config_class: type, trainer_class: type, package: str, method: str) -> tuple[type, type]:
    """Build the deprecated subclasses of a stable config (a dataclass) and trainer.

    Args:
        config_class: The stable config, e.g. `trl.KTOConfig`.
        trainer_class: The stable trainer, e.g. `trl.KTOTrainer`.
        package: Name of the experimental package (`"kto"` for `trl.experimental.kto`).
        method: Name of the method in the warning (`"KTO"`).

    Returns:
        `(config_alias, trainer_alias)`, named like the stable classes and living in `trl.experimental.<package>`.
    """
    module = f"trl.experimental.{package}"

    def message(name: str) -> str:
        return _MESSAGE.format(package=package, name=name, method=method)

    def __post_init__(self):
        # The dataclass `__init__` calls this: stacklevel 3 points at the user's line.
        warnings.warn(message(config_class.__name__), FutureWarning, stacklevel=3)
        config_class.__post_init__(self)

    def __init__(self, *args, **kwargs):
        warnings.warn(message(trainer_class.__name__), FutureWarning, stacklevel=2)
        trainer_class.__init__(self, *args, **kwargs)

    def namespace(cls: type, **methods) -> dict:
        doc = f"Deprecated alias of [`trl.{cls.__name__}`] (emits a `FutureWarning`)."
        return {"__doc__": doc, "__module__": module, "__qualname__": cls.__name__, **methods}

    config_alias = dataclass(
        type(config_class.__name__, (config_class,), namespace(config_class, __post_init__=__post_init__))
    )
    trainer_alias = type(trainer_class.__name__, (trainer_class,), namespace(trainer_class, __init__=__init__))
    return config_alias, trainer_alias
