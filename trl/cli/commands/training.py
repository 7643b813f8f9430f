"""`trl sft`, `trl dpo`, ...: thin dispatchers that run `trl/scripts/<name>.py` through `accelerate launch`."""

import argparse
import subprocess
import sys

from ..._config_file import apply_config_defaults, export_env_section, load_config_file, pop_config_argument
from ..._local_paths import missing_local_path_message
from .._script_parser import build_script_parser
from .base import Command, CommandContext


_EPILOG = (
    "Options can also come from a YAML file with --config FILE (command-line flags win over the file; an `env:` "
    "mapping in the file is exported as environment variables). Any `accelerate launch` option (--num_processes, "
    "--config_file, --mixed_precision, --multi_gpu, ...) is forwarded to accelerate, inline or as a key of the YAML "
    "file. --accelerate_config NAME|PATH selects a bundled accelerate profile (single_gpu, multi_gpu, multi_cpu, "
    "zero1, zero2, zero3, fsdp1, fsdp2) or an accelerate config file."
)


def remove_subsequence(strings: list[str], to_remove: list[str]) -> list[str]:
    """`strings` without the elements of `to_remove`, matched in order (each element removed once)."""
    result = []
    index = 0
    for string in strings:
        if index < len(to_remove) and string == to_remove[index]:
            index += 1
        else:
            result.append(string)
    return result


def check_input_paths(parser: argparse.ArgumentParser, script_args: list[str]) -> None:
    """Refuse a model or dataset given as a local path that does not exist, before anything is launched or loaded.

    Reads `--model_name_or_path`, `--dataset_name` and the `path` of each `datasets:` entry of a `--config` file, as
    the script will see them.

    Raises:
        ValueError: Naming the missing path.
    """
    config_path, rest = pop_config_argument(script_args)
    config = load_config_file(config_path) if config_path is not None else {}
    if config:
        apply_config_defaults(parser, config)
    namespace, _ = parser.parse_known_args(rest)
    candidates = [("model", getattr(namespace, "model_name_or_path", None))]
    candidates.append(("dataset", getattr(namespace, "dataset_name", None)))
    mixture = config.get("datasets") if isinstance(config, dict) else None
    for entry in mixture if isinstance(mixture, list) else []:
        if isinstance(entry, dict):
            candidates.append(("dataset", entry.get("path")))
    for what, name in candidates:
        message = missing_local_path_message(name, what)
        if message is not None:
            raise ValueError(message)


class TrainingCommand(Command):
    """Run `trl/scripts/<name>.py` through `accelerate launch`.

    Script options (the fields of the script's dataclasses) are passed to the script; every other option, on the
    command line or as a key of the `--config` YAML file, is passed to `accelerate launch`.

    Args:
        name (`str`):
            Script name, e.g. `"sft"`.
    """

    def __init__(self, name: str):
        super().__init__(name, f"Run the {name} training script")

    def register(self, subparsers: argparse._SubParsersAction) -> None:
        # No help of its own: `--help` goes to the script parser, which knows the options.
        subparsers.add_parser(self.name, help=self.help_text, add_help=False)

    @property
    def prog(self) -> str:
        return f"trl {self.name}"

    def run(self, args: argparse.Namespace, context: CommandContext) -> int:
        argv = context.argv_after(self.name)
        try:
            return self._run(argv)
        except ValueError as e:
            print(f"{self.prog}: error: {e}", file=sys.stderr)
            return 2

    def _run(self, argv: list[str]) -> int:
        if "-h" in argv or "--help" in argv:
            self.script_parser().print_help()
            return 0
        launch_args, script_args = self.split_arguments(argv)
        check_input_paths(self.script_parser(), script_args)

        from ..accelerate_launcher import launch_training_script

        try:
            launch_training_script(self.name, launch_args, script_args)
        except subprocess.CalledProcessError as e:
            # The script already printed its own traceback; only its status matters here.
            return e.returncode or 1
        except Exception as e:
            if type(e).__name__ == "ChildFailedError":  # torch.distributed.elastic: a worker process failed
                print(f"{self.prog}: a training process failed (see the log above).", file=sys.stderr)
                return 1
            raise
        return 0

    def script_parser(self) -> argparse.ArgumentParser:
        """Parser with the options of the script (built without importing the trainer; see `_dataclass_spec`)."""
        return build_script_parser(self.name, self.prog, description=self.help_text + ".", epilog=_EPILOG)

    def split_arguments(self, argv: list[str]) -> tuple[list[str], list[str]]:
        """Split the strings after `trl <name>` into `accelerate launch` arguments and script arguments.

        Script arguments are `argv` minus the strings the script parser does not know (so `--config` stays);
        launch arguments are the config-file keys that are not script options followed by the unknown command-line
        strings, with `--accelerate_config` resolved to `--config_file`. Variables of the config's `env:` section are
        exported to this process.

        Args:
            argv (`list[str]`):
                Strings after the sub-command name.

        Returns:
            `tuple[list[str], list[str]]`: `(launch_args, script_args)`.
        """
        parser = self.script_parser()
        config_path, rest = pop_config_argument(argv)
        config_leftovers = {}
        if config_path is not None:
            config = load_config_file(config_path)
            # Exported here too so that `accelerate launch` itself sees the variables.
            export_env_section(config)
            config_leftovers = apply_config_defaults(parser, config)
        _, cli_leftovers = parser.parse_known_args(rest)
        script_args = remove_subsequence(argv, cli_leftovers)

        from ..accelerate_config import resolve_accelerate_config_argument
        from ..accelerate_launcher import check_launch_arguments, config_leftovers_to_launch_args

        launch_args = config_leftovers_to_launch_args(config_leftovers) + cli_leftovers
        launch_args = resolve_accelerate_config_argument(launch_args)
        check_launch_arguments(launch_args, parser, config_path=config_path, config_keys=list(config_leftovers))
        return launch_args, script_args
