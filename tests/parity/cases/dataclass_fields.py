"""Parity cases: the public dataclasses, field names, types and defaults (issue 29)."""

from __future__ import annotations

import dataclasses
import importlib
import types
import typing

from . import case, to_jsonable


# (case suffix, module, class): every public dataclass a TRL script composes.
PUBLIC_DATACLASSES = [
    ("SFTConfig", "trl", "SFTConfig"),
    ("DPOConfig", "trl", "DPOConfig"),
    ("GRPOConfig", "trl", "GRPOConfig"),
    ("KTOConfig", "trl", "KTOConfig"),
    ("RewardConfig", "trl", "RewardConfig"),
    ("RLOOConfig", "trl", "RLOOConfig"),
    ("CPOConfig", "trl.experimental.cpo", "CPOConfig"),
    ("ORPOConfig", "trl.experimental.orpo", "ORPOConfig"),
    ("ModelConfig", "trl", "ModelConfig"),
    ("ScriptArguments", "trl", "ScriptArguments"),
    ("DatasetMixtureConfig", "trl", "DatasetMixtureConfig"),
    ("DatasetConfig", "trl.scripts.utils", "DatasetConfig"),
    ("GRPOScriptArguments", "trl.scripts.grpo", "GRPOScriptArguments"),
    ("RLOOScriptArguments", "trl.scripts.rloo", "RLOOScriptArguments"),
    ("vllm_serve.ScriptArguments", "trl.scripts.vllm_serve", "ScriptArguments"),
]


# This project's additions to every trainer config that cannot change a TRL run (a switch whose default keeps TRL's
# behaviour and that no TRL dataclass defines): left out of the comparison, listed in docs/parity.md.
PROJECT_ADDITIONS = {"save_run_report"}


def _type_name(tp) -> str:
    """A spelling of a type that does not depend on how it was written (`Optional[X]` and `X | None` agree)."""
    if isinstance(tp, str):
        return tp.replace(" ", "")
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return "|".join(sorted(_type_name(arg) for arg in typing.get_args(tp)))
    if origin is typing.Literal:
        return "Literal[" + ",".join(repr(arg) for arg in typing.get_args(tp)) + "]"
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[" + ",".join(_type_name(arg) for arg in typing.get_args(tp)) + "]"
    return getattr(tp, "__name__", str(tp))


def _fields(cls) -> dict:
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # an annotation that cannot be resolved: compare the declared text
        hints = {}
    out = {}
    for f in dataclasses.fields(cls):
        if f.name in PROJECT_ADDITIONS:
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = "<required>"
        out[f.name] = {"type": _type_name(hints.get(f.name, f.type)), "default": to_jsonable(default)}
    return out


def _register_dataclass_case(label: str, module: str, name: str) -> None:
    @case(f"dataclasses/{label}")
    def _fields_case(ctx):
        return _fields(getattr(importlib.import_module(module), name))


for _label, _module, _name in PUBLIC_DATACLASSES:
    _register_dataclass_case(_label, _module, _name)
