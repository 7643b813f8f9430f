"""Run a TRL script through `accelerate launch`, in this process (the launcher then spawns the workers)."""

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from accelerate.commands.launch import launch_command, launch_command_parser

from .._config_file import closest_name, parser_option_names
from ._script_parser import script_path


_TRUE_STRINGS = ("true", "yes", "y", "1", "on")


def _launch_parser_options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {option: action for option, action in parser._option_string_actions.items() if option.startswith("--")}


def config_leftovers_to_launch_args(leftovers: dict[str, Any]) -> list[str]:
    """Turn YAML keys that are not script options into `accelerate launch` arguments.

    Switches such as `multi_gpu: true` become a bare `--multi_gpu` (dropped when false); lists become
    comma-separated values (`gpu_ids: [0, 1]` -> `--gpu_ids 0,1`); everything else becomes `--key str(value)`.

    Args:
        leftovers (`dict[str, Any]`):
            Config entries that matched no script option.

    Returns:
        `list[str]`: Command-line strings for `accelerate launch`.
    """
    actions = _launch_parser_options(launch_command_parser())
    strings = []
    for key, value in leftovers.items():
        option = f"--{key}"
        action = actions.get(option)
        if action is not None and action.nargs == 0:
            if value is True or str(value).lower() in _TRUE_STRINGS:
                strings.append(option)
            continue
        if value is None:
            continue
        if isinstance(value, (list, tuple)):
            value = ",".join(str(v) for v in value)
        strings.extend([option, str(value)])
    return strings


def _is_value(token: str) -> bool:
    if not token.startswith("-"):
        return True
    try:
        float(token)  # negative numbers are values, not options
        return True
    except ValueError:
        return False


def _find_action(options: dict[str, argparse.Action], name: str) -> argparse.Action | None:
    if name in options:
        return options[name]
    # `accelerate launch` accepts unambiguous prefixes (argparse abbreviations).
    matches = {id(action): action for option, action in options.items() if option.startswith(name)}
    return next(iter(matches.values())) if len(matches) == 1 else None


def check_launch_arguments(
    launch_args: list[str],
    script_parser: argparse.ArgumentParser | None = None,
    config_path: str | None = None,
    config_keys: list[str] | None = None,
) -> None:
    """Raise a `ValueError` naming every argument that neither the script nor `accelerate launch` accepts.

    Args:
        launch_args (`list[str]`):
            Arguments meant for `accelerate launch`.
        script_parser (`argparse.ArgumentParser` or `None`, *optional*):
            Parser of the script, used to suggest the closest valid option.
        config_path (`str` or `None`, *optional*):
            YAML file the arguments partly come from (named in the error).
        config_keys (`list[str]` or `None`, *optional*):
            Keys of that file that were forwarded to accelerate.
    """
    options = _launch_parser_options(launch_command_parser())
    problems = []
    candidates = [option[2:] for option in options]
    if script_parser is not None:
        candidates = parser_option_names(script_parser) + candidates
    config_keys = config_keys or []
    i = 0
    while i < len(launch_args):
        token = launch_args[i]
        i += 1
        if _is_value(token):
            problems.append(f"unexpected value {token!r} (values must follow an option such as `--name`)")
            continue
        name, _, inline_value = token.partition("=")
        action = _find_action(options, name) if name.startswith("--") else None
        if action is None:
            key = name.lstrip("-")
            suggestion = closest_name(key, candidates) or closest_name(key.replace("-", "_"), candidates)
            if key in config_keys:
                hint = f" (did you mean {suggestion!r}?)" if suggestion else ""
                problems.append(f"unknown key {key!r} in config file {config_path!r}{hint}")
            else:
                hint = f" (did you mean '--{suggestion}'?)" if suggestion else ""
                problems.append(f"unrecognized argument {name!r}{hint}")
            while i < len(launch_args) and _is_value(launch_args[i]):
                i += 1  # the values of an unknown option are part of the same mistake
            continue
        if inline_value or "=" in token:
            continue
        nargs = action.nargs
        if nargs is None:
            count = 1
        elif isinstance(nargs, int):
            count = nargs
        elif nargs == "?":
            count = 1 if i < len(launch_args) and _is_value(launch_args[i]) else 0
        else:
            count = 0
            while i + count < len(launch_args) and _is_value(launch_args[i + count]):
                count += 1
        i += count
    if problems:
        raise ValueError(
            "; ".join(problems)
            + ". The accepted options are those of the script (listed by `--help`) and those of `accelerate launch`."
        )


@contextlib.contextmanager
def _temporary_environ(values: dict[str, str]) -> Iterator[None]:
    previous = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _load_accelerate_config(args: argparse.Namespace) -> dict[str, Any]:
    import yaml

    path = args.config_file
    if path is None:
        from accelerate.commands.config import default_config_file

        # accelerate reads its default config file only when `--cpu` is not given.
        path = default_config_file if os.path.isfile(default_config_file) and not args.cpu else None
    if path is None or not path.endswith((".yaml", ".yml")):
        return {}
    with open(path, encoding="utf-8") as f:
        config = yaml.safe_load(f)
    return config if isinstance(config, dict) else {}


def has_accelerator() -> bool:
    """Whether a device that `accelerate launch` can spread processes over (CUDA, XPU, NPU, ...) is present."""
    from accelerate import utils

    checks = ["is_cuda_available", "is_xpu_available", "is_npu_available", "is_mlu_available", "is_hpu_available"]
    checks += ["is_musa_available", "is_sdaa_available", "is_neuron_available"]
    return any(getattr(utils, name, lambda: False)() for name in checks)


def route_cpu_processes(args: argparse.Namespace) -> dict[str, str]:
    """Make a multi-process CPU request start several processes.

    `accelerate launch --cpu --num_processes N` (or a config with `distributed_type: MULTI_CPU`) goes through the
    simple launcher, which starts a single process; on a machine without accelerator, `--num_processes N` alone does
    the same, and `--multi_gpu` starts processes that do not talk to each other. Such requests are rewritten as a
    torchrun launch (`--multi_gpu --num_machines 1 --mixed_precision no --dynamo_backend no`) whose workers are told
    to stay on the CPU through `ACCELERATE_USE_CPU=true` (read by `TrainingArguments`, which then uses gloo).

    Args:
        args (`argparse.Namespace`):
            Parsed `accelerate launch` arguments, modified in place.

    Returns:
        `dict[str, str]`: Environment variables the launch needs (empty when nothing was rewritten).
    """
    config = _load_accelerate_config(args)
    distributed_type = str(config.get("distributed_type", "NO")).upper()
    wants_cpu = bool(args.cpu) or config.get("use_cpu") is True or distributed_type == "MULTI_CPU"
    num_processes = args.num_processes if args.num_processes is not None else config.get("num_processes")
    num_machines = args.num_machines if args.num_machines is not None else config.get("num_machines", 1)
    if num_processes is None or int(num_processes) < 2 or int(num_machines or 1) > 1:
        return {}
    if args.use_deepspeed or args.use_fsdp or args.tpu or distributed_type not in ("NO", "MULTI_CPU", "MULTI_GPU"):
        return {}
    if not wants_cpu and has_accelerator():
        return {}
    args.cpu = False
    args.multi_gpu = True
    args.num_processes = int(num_processes)
    args.num_machines = 1
    if args.mixed_precision is None:
        args.mixed_precision = "no"
    if args.dynamo_backend is None:
        args.dynamo_backend = "no"
    return {"ACCELERATE_USE_CPU": "true"}


def _uses_accelerate_config_file(args: argparse.Namespace) -> bool:
    """Whether `accelerate launch` will read a config file (`--config_file`, or its default file without `--cpu`);
    it then takes its settings from the file and warns about nothing."""
    from accelerate.commands.config import default_config_file

    return args.config_file is not None or (os.path.isfile(default_config_file) and not args.cpu)


def _local_device_count() -> int:
    """Accelerator devices on this machine, looked up in the order `accelerate launch` does (0 on a CPU)."""
    import torch
    from accelerate import utils

    for check, backend in (
        ("is_xpu_available", "xpu"),
        ("is_mlu_available", "mlu"),
        ("is_sdaa_available", "sdaa"),
        ("is_musa_available", "musa"),
        ("is_npu_available", "npu"),
        ("is_hpu_available", "hpu"),
        ("is_neuron_available", "neuron"),
    ):
        if getattr(utils, check, lambda: False)():
            return getattr(torch, backend).device_count()
    return torch.cuda.device_count()


def fill_launch_defaults(args: argparse.Namespace) -> str | None:
    """Set the `accelerate launch` values a user did not pass to the defaults accelerate would pick, so that it does
    not print its "were not passed ... had defaults used instead" warning block on every run.

    Without a config file, accelerate fills `num_processes` (the number of local accelerators, 0 meaning one process
    on the CPU), `num_machines` (1), `mixed_precision` ("no") and `dynamo_backend` ("no"), and warns about each. The
    same values are set here; the line returned states them instead.

    Args:
        args (`argparse.Namespace`):
            Parsed `accelerate launch` arguments, modified in place.

    Returns:
        `str` or `None`: A one-line summary of the launch settings, or None when a config file provides them (or the
        user passed them all).
    """
    if _uses_accelerate_config_file(args):
        return None
    filled = []
    if args.num_processes is None:
        args.num_processes = _local_device_count()
        filled.append("num_processes")
    for name, default in (("num_machines", 1), ("mixed_precision", "no"), ("dynamo_backend", "no")):
        if getattr(args, name) is None:
            setattr(args, name, default)
            filled.append(name)
    if not filled:
        return None
    processes = max(1, int(args.num_processes))
    where = "CPU" if args.cpu or _local_device_count() == 0 else "local accelerator(s)"
    return (
        f"Launching {processes} process{'es' if processes > 1 else ''} on the {where} (mixed_precision="
        f"{args.mixed_precision}, dynamo_backend={args.dynamo_backend}); pass --num_processes, --mixed_precision, "
        "... or --accelerate_config to change this."
    )


def launch_training_script(
    script_name: str,
    launch_args: list[str],
    training_script_args: list[str],
    *,
    launch_command_fn: Callable[[argparse.Namespace], Any] = launch_command,
    launch_parser_fn: Callable[[], argparse.ArgumentParser] = launch_command_parser,
) -> Any:
    """Run `trl/scripts/<script_name>.py` like `accelerate launch [launch_args] SCRIPT [training_script_args]`.

    Multi-process CPU requests are rewritten so that they really start several processes (see
    [`route_cpu_processes`]).

    Args:
        script_name (`str`):
            Script name inside `trl/scripts/` (e.g. `"sft"`), or the path of any script.
        launch_args (`list[str]`):
            Arguments for `accelerate launch`.
        training_script_args (`list[str]`):
            Arguments for the script.
        launch_command_fn (`Callable`, defaults to `accelerate.commands.launch.launch_command`):
            Function that performs the launch from the parsed namespace.
        launch_parser_fn (`Callable`, defaults to `accelerate.commands.launch.launch_command_parser`):
            Factory of the `accelerate launch` argument parser.

    Returns:
        Whatever `launch_command_fn` returns.
    """
    path = script_name if os.path.isfile(script_name) else script_path(script_name)
    args = launch_parser_fn().parse_args(list(launch_args) + [path] + list(training_script_args))
    environment = route_cpu_processes(args)
    settings = fill_launch_defaults(args)
    if settings is not None:
        print(settings, file=sys.stderr)
    with _temporary_environ(environment):
        return launch_command_fn(args)
