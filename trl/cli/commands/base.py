"""Base class and context shared by the `trl` sub-commands."""

import argparse
from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(slots=True)
class CommandContext:
    """What a sub-command receives besides its parsed namespace.

    Args:
        argv (`list[str]`):
            The full command line after the program name, e.g. `["sft", "--config", "sft.yaml"]`.
    """

    argv: list[str]

    def argv_after(self, token: str) -> list[str]:
        """The strings that follow the first occurrence of `token` (all of `argv` when `token` is absent)."""
        if token in self.argv:
            return self.argv[self.argv.index(token) + 1 :]
        return list(self.argv)


class Command(ABC):
    """A `trl` sub-command.

    Args:
        name (`str`):
            Name typed on the command line, e.g. `"sft"`.
        help_text (`str`):
            One-line description shown by `trl --help`.
    """

    def __init__(self, name: str, help_text: str):
        self.name = name
        self.help_text = help_text

    @abstractmethod
    def register(self, subparsers: argparse._SubParsersAction) -> None:
        """Add this command's sub-parser to `subparsers`."""

    @abstractmethod
    def run(self, args: argparse.Namespace, context: CommandContext) -> int:
        """Execute the command and return its exit status."""
