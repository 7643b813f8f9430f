"""`trl env`: print the environment for bug reports."""

import argparse

from .base import Command, CommandContext


class EnvCommand(Command):
    """Print the platform, Python and library versions in a form ready to paste into an issue."""

    def __init__(self):
        super().__init__("env", "Print the environment information")

    def register(self, subparsers: argparse._SubParsersAction) -> None:
        subparsers.add_parser(self.name, help=self.help_text, description=self.help_text)

    def run(self, args: argparse.Namespace, context: CommandContext) -> int:
        from ...scripts.env import print_env

        print_env()
        return 0
