"""The sub-commands of `trl`."""

from .base import Command, CommandContext
from .env import EnvCommand
from .report import ReportCommand
from .training import TrainingCommand
from .vllm_serve import VllmServeCommand


def get_commands() -> list[Command]:
    """All sub-commands, in the order `trl --help` lists them."""
    return [
        TrainingCommand("distillation"),
        TrainingCommand("dpo"),
        EnvCommand(),
        TrainingCommand("grpo"),
        TrainingCommand("kto"),
        ReportCommand(),
        TrainingCommand("reward"),
        TrainingCommand("rloo"),
        TrainingCommand("sft"),
        VllmServeCommand(),
    ]


__all__ = [
    "Command",
    "CommandContext",
    "EnvCommand",
    "ReportCommand",
    "TrainingCommand",
    "VllmServeCommand",
    "get_commands",
]
