"""Entry point of the `trl` command (`trl = trl.cli:main`, or `python -m trl.cli.main`)."""

import argparse
import sys

from .commands import CommandContext, get_commands


class _HelpFormatter(argparse.HelpFormatter):
    """Keeps sub-command names and their help on one line (argparse sizes the column before seeing them)."""

    def __init__(self, prog: str):
        super().__init__(prog, max_help_position=32)
        self._action_max_length = 20


def main(argv: list[str] | None = None) -> int:
    """Run the `trl` command line.

    Args:
        argv (`list[str]` or `None`, defaults to `None`):
            Arguments after the program name; `sys.argv[1:]` when `None`.

    Returns:
        `int`: The exit status (0 on success).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="trl",
        usage="trl <command> [<args>]",
        description="TRL command line: post-train transformer language models.",
        epilog="Run `trl <command> --help` for the options of a command.",
        allow_abbrev=False,
        formatter_class=_HelpFormatter,
    )
    subparsers = parser.add_subparsers(dest="command", title="commands", metavar="<command>")
    commands = {}
    for command in get_commands():
        command.register(subparsers)
        commands[command.name] = command
    try:
        args, _ = parser.parse_known_args(argv)
        if args.command is None:
            parser.print_help()
            return 0
        return commands[args.command].run(args, CommandContext(argv=argv))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
