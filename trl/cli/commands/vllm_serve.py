"""`trl vllm-serve`: start a vLLM server for online-generation trainers."""

import argparse
import sys

from .._script_parser import build_script_parser
from .base import Command, CommandContext


class VllmServeCommand(Command):
    """Parse the `trl.scripts.vllm_serve` options and hand over to its `main`."""

    def __init__(self):
        super().__init__("vllm-serve", "Serve a model with vLLM")

    def register(self, subparsers: argparse._SubParsersAction) -> None:
        subparsers.add_parser(self.name, help=self.help_text, add_help=False)

    def run(self, args: argparse.Namespace, context: CommandContext) -> int:
        argv = context.argv_after(self.name)
        prog = f"trl {self.name}"
        if "-h" in argv or "--help" in argv:
            build_script_parser("vllm_serve", prog, description=self.help_text + ".").print_help()
            return 0
        from ...scripts.vllm_serve import main, make_parser

        parser = make_parser(prog=prog)
        try:
            script_args, extra_args = parser.parse_args_and_config(argv, return_remaining_strings=True)
        except ValueError as e:
            print(f"{prog}: error: {e}", file=sys.stderr)
            return 2
        result = main(script_args, extra_args)
        return result if isinstance(result, int) else 0
