"""YAML config-file handling shared by `TrlParser` and the `trl` command.

Kept free of torch/transformers imports so that the `trl` command can split its arguments (and print help) before
any heavy library is loaded.
"""

import argparse
import difflib
import os
from collections.abc import Iterable
from typing import Any


CONFIG_FLAG = "--config"


def pop_config_argument(args: list[str]) -> tuple[str | None, list[str]]:
    """Remove `--config PATH` (or `--config=PATH`) from `args`.

    Args:
        args (`list[str]`):
            Command-line strings.

    Returns:
        `tuple[str | None, list[str]]`: The config path (or `None` when absent) and the strings without the pair.
    """
    args = list(args)
    for i, arg in enumerate(args):
        if arg == CONFIG_FLAG:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise ValueError(
                    "`--config` expects the path of a YAML file, e.g. `--config sft.yaml`; none was given."
                )
            return args[i + 1], args[:i] + args[i + 2 :]
        if arg.startswith(CONFIG_FLAG + "="):
            return arg.split("=", 1)[1], args[:i] + args[i + 1 :]
    return None, args


def load_config_file(path: str) -> dict[str, Any]:
    """Read a YAML config file with the safe loader and check that it holds a mapping.

    Args:
        path (`str`):
            Path of the YAML file.

    Returns:
        `dict[str, Any]`: The parsed mapping (empty for an empty file).
    """
    import yaml

    # Through the plain `open` (no existence check first), so code that substitutes `open` reads its config too.
    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
    except (FileNotFoundError, IsADirectoryError) as error:
        raise ValueError(
            f"Config file {path!r} does not exist; pass the path of a YAML file to `--config`."
        ) from error
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise ValueError(
            f"Config file {path!r} must hold a mapping of option names to values at its top level, but it holds a "
            f"{type(config).__name__}. Write it as `key: value` lines."
        )
    return config


def export_env_section(config: dict[str, Any]) -> dict[str, str]:
    """Pop the optional `env:` mapping from `config` and export each entry to `os.environ`.

    Args:
        config (`dict[str, Any]`):
            Parsed config file; modified in place (the `env` key is removed).

    Returns:
        `dict[str, str]`: The exported variables.
    """
    env = config.pop("env", None)
    if env is None:
        return {}
    if not isinstance(env, dict):
        raise ValueError(
            f"The `env` section of the config file must be a mapping of variable names to values, got "
            f"{type(env).__name__}: {env!r}."
        )
    exported = {str(key): str(value) for key, value in env.items()}
    os.environ.update(exported)
    return exported


def apply_config_defaults(parser: argparse.ArgumentParser, config: dict[str, Any]) -> dict[str, Any]:
    """Turn config values into argparse defaults, so that explicit command-line flags still win.

    Every matched argument also stops being required. Sub-parsers are visited too.

    Args:
        parser (`argparse.ArgumentParser`):
            Parser to update in place.
        config (`dict[str, Any]`):
            Option names (argparse destinations) mapped to values.

    Returns:
        `dict[str, Any]`: The entries that matched no argument, in their original order.
    """
    used = _apply(parser, config)
    return {key: value for key, value in config.items() if key not in used}


def _apply(parser: argparse.ArgumentParser, config: dict[str, Any]) -> set[str]:
    used = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_parser in action.choices.values():
                used |= _apply(sub_parser, config)
        elif action.dest in config and action.dest not in used:
            # The first action of a destination wins (the `--flag` of a bool, not its `--no_flag` complement).
            action.default = config[action.dest]
            action.required = False
            used.add(action.dest)
    return used


def leftovers_to_strings(leftovers: dict[str, Any]) -> list[str]:
    """Render unmatched config entries as command-line strings, `["--key", "str(value)", ...]`."""
    strings = []
    for key, value in leftovers.items():
        strings.extend([f"--{key}", str(value)])
    return strings


def parser_option_names(parser: argparse.ArgumentParser) -> list[str]:
    """Destinations of all the options of `parser` (and its sub-parsers), without `help`."""
    names = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_parser in action.choices.values():
                names.extend(parser_option_names(sub_parser))
        elif action.option_strings and action.dest not in ("help", argparse.SUPPRESS) and action.dest not in names:
            names.append(action.dest)
    return names


def closest_name(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate most similar to `name` (difflib ratio >= 0.6), or `None`."""
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return matches[0] if matches else None


def unknown_keys_message(keys: Iterable[str], candidates: Iterable[str], source: str) -> str:
    """Error text naming each unknown key and, where one exists, the closest valid name."""
    candidates = list(candidates)
    parts = []
    for key in keys:
        suggestion = closest_name(key, candidates)
        hint = f" (did you mean {suggestion!r}?)" if suggestion else ""
        parts.append(f"{key!r}{hint}")
    return f"Unknown key(s) in {source}: {', '.join(parts)}. Remove them or fix their spelling."
