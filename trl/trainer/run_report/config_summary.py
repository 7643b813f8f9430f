"""The config as the run report shows it: the fields the user set first, every field after, credentials hidden.

Which fields the user set is recorded when the config is built (`record_fields_set`, called at the start of the
config's `__post_init__`): afterwards, defaults resolved on this machine (`bf16=None` -> False on a CPU,
`report_to="none"` -> `[]`, ...) can no longer be told apart from a user's choice.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .history import to_json_value


# Fields named `*_token` that hold a token string of the tokenizer, not a credential.
_TOKENIZER_TOKEN_FIELDS = frozenset({"bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "mask_token"})
_FIELDS_SET_ATTRIBUTE = "_fields_set_by_user"


def declared_defaults(config: Any) -> dict[str, Any]:
    """`{field: default}` of a dataclass instance's init fields, as declared (JSON-ready; required fields left out)."""
    defaults = {}
    for config_field in dataclasses.fields(config):
        if not config_field.init:
            continue
        if config_field.default is not dataclasses.MISSING:
            defaults[config_field.name] = to_json_value(config_field.default)
        elif config_field.default_factory is not dataclasses.MISSING:
            defaults[config_field.name] = to_json_value(config_field.default_factory())
    return defaults


def record_fields_set(config: Any) -> None:
    """Remember which fields of `config` differ from their declared default, before `__post_init__` resolves any.

    Stored as a plain attribute (not a dataclass field), so the config's fields, parsing and serialisation are
    unchanged.
    """
    if hasattr(config, _FIELDS_SET_ATTRIBUTE):  # a subclass's __post_init__ already recorded them
        return
    defaults = declared_defaults(config)
    fields_set = []
    for name, default in defaults.items():
        try:
            if to_json_value(getattr(config, name, None)) != default:
                fields_set.append(name)
        except Exception:  # an exotic value that cannot be compared: count it as set
            fields_set.append(name)
    object.__setattr__(config, _FIELDS_SET_ATTRIBUTE, tuple(fields_set))


def _config_values(config: Any) -> dict[str, Any]:
    """Every init field of a config, JSON-ready, with credentials (`hub_token`, ...) hidden."""
    values = {}
    for config_field in dataclasses.fields(config):
        if not config_field.init:
            continue
        name = config_field.name
        value = getattr(config, name, None)
        if value is not None and name.endswith("_token") and name not in _TOKENIZER_TOKEN_FIELDS:
            value = "<hidden>"
        values[name] = to_json_value(value)
    return values


def describe_config(config: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """`(changed, full)` for the report.

    `changed` maps each field the user set (see `record_fields_set`; for a config that did not record them, each
    field whose value differs from its declared default) to `{"value": current value, "default": declared
    default}`. `full` holds every field's value, the changed ones first.
    """
    full = _config_values(config)
    defaults = declared_defaults(config)
    recorded = getattr(config, _FIELDS_SET_ATTRIBUTE, None)
    if recorded is None:
        names = [name for name, value in full.items() if name in defaults and value != defaults[name]]
    else:
        names = [name for name in recorded if name in full]
    changed = {name: {"value": full[name], "default": defaults.get(name)} for name in names}
    full = {**{name: full[name] for name in changed}, **{k: v for k, v in full.items() if k not in changed}}
    return changed, full
