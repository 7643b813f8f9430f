"""What a run prints to the console besides its progress bar: the logged metrics as numbers, a warning when
`accelerate launch` started fewer processes than asked for, and a note when the model is a tiny offline test model."""

import logging
import math
import os
import warnings
from typing import Any

from transformers.trainer_callback import PrinterCallback, ProgressCallback


logger = logging.getLogger(__name__)


def printable_logs(logs: dict[str, Any], max_str_len: int = 100) -> dict[str, Any]:
    """The logged row as printed: floats rounded to 4 significant digits but kept numbers (`{'loss': 7.843}`, where
    transformers 5 prints `{'loss': '7.843'}`), over-long strings elided, `total_flos` left out."""
    shown = {}
    for key, value in logs.items():
        if key == "total_flos":
            continue
        if isinstance(value, str) and len(value) > max_str_len:
            value = f"[String too long to display, length: {len(value)} > {max_str_len}.]"
        elif isinstance(value, float) and math.isfinite(value):
            value = float(f"{value:.4g}")
        shown[key] = value
    return shown


class NumericProgressCallback(ProgressCallback):
    """transformers' progress bar, printing each logged row with numbers as numbers."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None and logs is not None:
            self.training_bar.write(str(printable_logs(logs, getattr(self, "max_str_len", 100))))


class NumericPrinterCallback(PrinterCallback):
    """transformers' printer (`disable_tqdm=True`), printing each logged row with numbers as numbers."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None:
            return
        logs.pop("total_flos", None)  # as transformers' printer does
        if state.is_local_process_zero:
            print(printable_logs(logs))


def use_numeric_log_printers(trainer: Any) -> None:
    """Swap transformers' own progress/printer callbacks (exactly those classes; a user's subclass stays) for the
    numeric ones, keeping their place in the callback list."""
    replacements = {ProgressCallback: NumericProgressCallback, PrinterCallback: NumericPrinterCallback}
    callbacks = trainer.callback_handler.callbacks
    for index, callback in enumerate(callbacks):
        replacement = replacements.get(type(callback))
        if replacement is not None:
            swapped = replacement.__new__(replacement)
            swapped.__dict__.update(callback.__dict__)
            callbacks[index] = swapped


def _parent_command_line() -> list[str]:
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            return [part.decode(errors="replace") for part in f.read().split(b"\0") if part]
    except OSError:
        return []


def processes_asked_of_accelerate_launch(command: list[str] | None = None) -> int | None:
    """`--num_processes N` of the `accelerate launch` command that started this process, when it started it alone.

    On a machine without accelerators, `accelerate launch --num_processes 2 script.py` goes through accelerate's simple
    launcher, which runs the script once and passes it no world size. That launcher sets `ACCELERATE_DYNAMO_BACKEND`
    and no `WORLD_SIZE`; the number asked for is read from the launching command (Linux `/proc`).
    """
    if "ACCELERATE_DYNAMO_BACKEND" not in os.environ or "WORLD_SIZE" in os.environ:
        return None
    command = _parent_command_line() if command is None else command
    # `accelerate launch`, `python -m accelerate.commands.launch` or the `accelerate-launch` entry point.
    if not any(part == "launch" or part.endswith(("commands.launch", "accelerate-launch")) for part in command):
        return None
    for index, part in enumerate(command):
        for flag in ("--num_processes", "--num-processes"):
            value = None
            if part == flag and index + 1 < len(command):
                value = command[index + 1]
            elif part.startswith(flag + "="):
                value = part.split("=", 1)[1]
            if value is not None and value.isdigit():
                return int(value)
    return None


def warn_if_launch_dropped_processes(num_processes: int) -> None:
    """Warn when `accelerate launch --num_processes N` (N > 1) started this run as one process."""
    asked = processes_asked_of_accelerate_launch() if num_processes == 1 else None
    if asked is None or asked < 2:
        return
    warnings.warn(
        f"`accelerate launch --num_processes {asked}` started this run as 1 process: without GPUs, accelerate's "
        "simple launcher runs the script once and ignores --num_processes (an epoch takes "
        f"{asked} times as many steps). For {asked} CPU processes run `accelerate launch --multi_gpu --use_cpu --num_processes "
        f"{asked} <script> ...`, or `trl <command> ... --num_processes {asked}`.",
        UserWarning,
        stacklevel=3,
    )


_NOTED_TEST_MODELS: set[str] = set()


def note_offline_test_model(model: Any) -> None:
    """Say once per process when the model being trained is one of trl's tiny offline test models (random weights):
    the example scripts fall back to them when no model is given, and their flat losses are otherwise a puzzle."""
    from ...assets import offline_model_name

    config = getattr(model, "config", None)
    name = offline_model_name(getattr(config, "_name_or_path", None))
    if name is None or name in _NOTED_TEST_MODELS:
        return
    _NOTED_TEST_MODELS.add(name)
    logger.warning(
        f"Training {name}, a tiny test model with random weights from trl's offline assets (the example scripts "
        "use it when no model is given): its losses barely move and its completions are noise. Pass "
        "--model_name_or_path (or your model) to train a real one."
    )
