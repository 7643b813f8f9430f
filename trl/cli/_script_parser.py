"""Locate the TRL scripts and build their argument parsers cheaply (see `_dataclass_spec`)."""

import argparse
import importlib
import os

from ._dataclass_spec import DataclassSpecError, add_dataclass_arguments, module_file, script_dataclasses


# The dataclasses of each script as the compatibility contract lists them; used when `make_parser` cannot be read.
SCRIPT_DATACLASSES = {
    "sft": ["trl.trainer.sft_config.SFTConfig"],
    "dpo": ["trl.trainer.dpo_config.DPOConfig"],
    "grpo": ["trl.trainer.grpo_config.GRPOConfig"],
    "kto": ["trl.trainer.kto_config.KTOConfig"],
    "reward": ["trl.trainer.reward_config.RewardConfig"],
    "rloo": ["trl.trainer.rloo_config.RLOOConfig"],
    "distillation": ["trl.trainer.distillation_config.DistillationConfig"],
}
_SCRIPT_ARGUMENTS = {"grpo": "trl.scripts.grpo.GRPOScriptArguments", "rloo": "trl.scripts.rloo.RLOOScriptArguments"}


def scripts_dir() -> str:
    """Directory of the `trl.scripts` package."""
    return os.path.dirname(module_file("trl.scripts"))


def script_path(name: str) -> str:
    """Path of `trl/scripts/<name>.py` (which may not exist)."""
    return os.path.join(scripts_dir(), f"{name}.py")


def script_exists(name: str) -> bool:
    """Whether `trl/scripts/<name>.py` is part of this build."""
    return os.path.isfile(script_path(name))


def _contract_dataclasses(name: str) -> list[tuple[str, str]]:
    if name not in SCRIPT_DATACLASSES:
        raise DataclassSpecError(f"no known dataclasses for {name}")
    dotted = [
        _SCRIPT_ARGUMENTS.get(name, "trl.scripts.utils.ScriptArguments"),
        *SCRIPT_DATACLASSES[name],
        "trl.trainer.model_config.ModelConfig",
        "trl.scripts.utils.DatasetMixtureConfig",
    ]
    return [tuple(d.rsplit(".", 1)) for d in dotted]


def build_script_parser(
    name: str, prog: str, description: str | None = None, epilog: str | None = None
) -> argparse.ArgumentParser:
    """An argument parser with the options of `trl/scripts/<name>.py`.

    The options are read from source code so that no heavy library is imported; when that fails, the script module
    is imported and its own `make_parser` is used.

    Args:
        name (`str`):
            Script module name inside `trl.scripts`, e.g. `"sft"` or `"vllm_serve"`.
        prog (`str`):
            Program name shown in usage lines, e.g. `"trl sft"`.
        description (`str` or `None`, *optional*):
            Text shown above the options in `--help`.
        epilog (`str` or `None`, *optional*):
            Text shown below the options in `--help`.

    Returns:
        `argparse.ArgumentParser`: A parser whose option destinations are the dataclass field names.
    """
    module_name = f"trl.scripts.{name}"
    formatter = argparse.ArgumentDefaultsHelpFormatter
    # The generated usage line would list hundreds of options (and be repeated in every error message).
    usage = f"{prog} [--config FILE] [options]"
    try:
        try:
            classes = script_dataclasses(module_name)
        except DataclassSpecError:
            classes = _contract_dataclasses(name)
        parser = argparse.ArgumentParser(
            prog=prog, usage=usage, description=description, epilog=epilog, formatter_class=formatter
        )
        for owner, class_name in classes:
            add_dataclass_arguments(parser, owner, class_name)
        return parser
    except DataclassSpecError:
        module = importlib.import_module(module_name)
        parser = module.make_parser(prog=prog)
        parser.description = description if description is not None else parser.description
        parser.epilog = epilog if epilog is not None else parser.epilog
        parser.formatter_class = formatter
        parser.usage = usage
        return parser
