"""`--accelerate_config`: pick a bundled accelerate profile by name, or any accelerate config file by path."""

import os
from importlib.resources import files


FLAG = "--accelerate_config"


def available_profiles() -> list[str]:
    """Names of the accelerate profiles bundled in `trl/accelerate_configs/`."""
    folder = files("trl.accelerate_configs")
    return sorted(entry.name[: -len(".yaml")] for entry in folder.iterdir() if entry.name.endswith(".yaml"))


def _profile_path(value: str) -> str:
    if os.path.isfile(value):
        return value
    candidate = files("trl.accelerate_configs").joinpath(f"{value}.yaml")
    if candidate.is_file():
        return str(candidate)
    raise ValueError(
        f"--accelerate_config {value!r} is neither an existing file nor a bundled profile. Use the path of an "
        f"accelerate config file or one of: {', '.join(available_profiles())}."
    )


def resolve_accelerate_config_argument(launch_args: list[str]) -> list[str]:
    """Replace `--accelerate_config VALUE` with `--config_file PATH` at the front of the launch arguments.

    `VALUE` is used as a path when such a file exists, otherwise it names a profile bundled in
    `trl/accelerate_configs/` (`single_gpu`, `multi_gpu`, `multi_cpu`, `zero1`, `zero2`, `zero3`, `fsdp1`, `fsdp2`).

    Args:
        launch_args (`list[str]`):
            Arguments meant for `accelerate launch`.

    Returns:
        `list[str]`: The arguments with the pair replaced (unchanged when the flag is absent).
    """
    launch_args = list(launch_args)
    for i, arg in enumerate(launch_args):
        if arg == FLAG:
            if i + 1 >= len(launch_args) or launch_args[i + 1].startswith("--"):
                raise ValueError(
                    f"--accelerate_config expects a profile name ({', '.join(available_profiles())}) or the path of "
                    "an accelerate config file, but no value was given."
                )
            path = _profile_path(launch_args[i + 1])
            return ["--config_file", path] + launch_args[:i] + launch_args[i + 2 :]
        if arg.startswith(FLAG + "="):
            path = _profile_path(arg.split("=", 1)[1])
            return ["--config_file", path] + launch_args[:i] + launch_args[i + 1 :]
    return launch_args
