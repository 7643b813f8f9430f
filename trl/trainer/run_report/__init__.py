"""The run report every TRL trainer leaves in its `output_dir` (see `docs/run_report.md`).

- `metrics.jsonl`: every logged row (train and eval), appended as it is logged, plus the run's config, a data summary,
  sample completions of online trainers and the checkpoints written (`history.py` documents the rows).
- `report.html`: one self-contained page with the curves (inline SVG), tables of every metric, the data summary,
  the checkpoints, wall time, throughput and the config, written at each checkpoint and when training ends.

`RunReportCallback` writes both; `write_report` renders the page from one or several `metrics.jsonl` files (what
`trl report` runs). Importing this package does not load transformers; the callback is imported on
first use.
"""

from __future__ import annotations

import os
from typing import Any

from .history import METRICS_FILE_NAME, REPORT_FILE_NAME, RunHistory, load_run, read_rows


def write_report(paths: list[str], output_path: str | None = None) -> str:
    """Render the report of one run, or of several runs overlaid, into one HTML file.

    Args:
        paths (`list[str]`):
            Output directories holding a `metrics.jsonl` (or the files themselves).
        output_path (`str` or `None`, defaults to `None`):
            Where to write the page; `<path>/report.html` for a single run, `./report.html` for several.

    Returns:
        `str`: The path of the written page.

    Raises:
        FileNotFoundError: When a path has no `metrics.jsonl`.
    """
    from .page import build_page

    if not paths:
        raise ValueError("write_report needs at least one output directory.")
    runs = [load_run(path) for path in paths]
    # Two runs from directories of the same name (out/a/run, out/b/run) get told apart by their parent folders.
    names = [run.name for run in runs]
    for run in runs:
        if names.count(run.name) > 1:
            parent = os.path.basename(os.path.dirname(os.path.dirname(os.path.abspath(run.source))))
            run.name = f"{parent}/{run.name}"
    if output_path is None:
        base = paths[0] if len(paths) == 1 and os.path.isdir(paths[0]) else "."
        output_path = os.path.join(base, REPORT_FILE_NAME)
    page = build_page(runs)
    directory = os.path.dirname(os.path.abspath(output_path))
    os.makedirs(directory, exist_ok=True)
    # Written aside then renamed: a browser (or a crash) never sees half a page.
    temporary = os.path.join(directory, f".{os.path.basename(output_path)}.{os.getpid()}.tmp")
    with open(temporary, "w", encoding="utf-8") as f:
        f.write(page)
    os.replace(temporary, output_path)
    return output_path


def __getattr__(name: str) -> Any:
    # The callback needs transformers; load it only when asked for.
    if name in ("RunReportCallback", "keep_samples_for_report", "run_report_enabled"):
        from . import callback

        return getattr(callback, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "METRICS_FILE_NAME",
    "REPORT_FILE_NAME",
    "RunHistory",
    "RunReportCallback",
    "keep_samples_for_report",
    "load_run",
    "read_rows",
    "run_report_enabled",
    "write_report",
]
