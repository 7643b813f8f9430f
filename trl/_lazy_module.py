"""A module type that imports its submodules only when one of their names is first touched.

Keeps `import trl` cheap: torch and transformers load only when a name that needs them is used.
"""

import importlib
import os
from types import ModuleType
from typing import Any


class _LazyModule(ModuleType):
    """Module whose public names are resolved from submodules on first access.

    Args:
        name: Fully qualified name of the module being replaced.
        module_file: `__file__` of the module being replaced.
        import_structure: Mapping of submodule name to the list of public names it defines.
        module_spec: `__spec__` of the module being replaced.
        extra_objects: Names that are set eagerly (for example `__version__`).
    """

    def __init__(
        self,
        name: str,
        module_file: str,
        import_structure: dict[str, list[str]],
        module_spec: Any = None,
        extra_objects: dict[str, Any] | None = None,
    ):
        super().__init__(name)
        self._modules = set(import_structure.keys())
        self._class_to_module = {}
        for submodule, names in import_structure.items():
            for value in names:
                self._class_to_module[value] = submodule
        self.__all__ = list(import_structure.keys()) + list(self._class_to_module.keys())
        self.__file__ = module_file
        self.__spec__ = module_spec
        self.__path__ = [os.path.dirname(module_file)]
        self._objects = {} if extra_objects is None else extra_objects
        self._name = name
        self._import_structure = import_structure

    def __dir__(self):
        result = super().__dir__()
        return result + [attr for attr in self.__all__ if attr not in result]

    def __getattr__(self, name: str) -> Any:
        if name in self._objects:
            return self._objects[name]
        if name in self._class_to_module:
            module = self._get_module(self._class_to_module[name])
            value = getattr(module, name)
        elif name in self._modules:
            value = self._get_module(name)
        else:
            raise AttributeError(f"module {self.__name__} has no attribute {name}")
        setattr(self, name, value)
        return value

    def _get_module(self, module_name: str) -> ModuleType:
        try:
            return importlib.import_module("." + module_name, self.__name__)
        except Exception as e:
            raise RuntimeError(
                f"Failed to import {self.__name__}.{module_name} because of the following error (look up to see its "
                f"traceback):\n{e}"
            ) from e

    def __reduce__(self):
        return (self.__class__, (self._name, self.__file__, self._import_structure))
