"""`trl report`: re-render the run report of one or several training runs from their `metrics.jsonl`."""

import argparse
import sys

from .base import Command, CommandContext


_DESCRIPTION = (
    "Render report.html from the metrics.jsonl that training writes into its output_dir. With one directory the page "
    "is written next to it (OUTPUT_DIR/report.html); with several, their curves are overlaid for comparison in one "
    "page (./report.html unless --output is given). Works while a run is still going or after it was killed."
)


class ReportCommand(Command):
    """Render `report.html` from one or several output directories' `metrics.jsonl` (curves overlaid)."""

    def __init__(self):
        super().__init__("report", "Render report.html from the metrics.jsonl of output directories")

    def register(self, subparsers: argparse._SubParsersAction) -> None:
        parser = subparsers.add_parser(self.name, help=self.help_text, description=_DESCRIPTION)
        parser.add_argument(
            "output_dirs",
            nargs="+",
            metavar="OUTPUT_DIR",
            help="A training output_dir holding metrics.jsonl (or the metrics.jsonl file itself).",
        )
        parser.add_argument(
            "--output",
            "-o",
            default=None,
            metavar="FILE",
            help="Where to write the page (default: OUTPUT_DIR/report.html for one run, ./report.html for several).",
        )

    def run(self, args: argparse.Namespace, context: CommandContext) -> int:
        from ...trainer.run_report import write_report

        try:
            path = write_report(list(args.output_dirs), args.output)
        except (FileNotFoundError, ValueError) as error:
            print(f"trl {self.name}: error: {error}", file=sys.stderr)
            return 2
        print(f"Report written to {path}")
        return 0
