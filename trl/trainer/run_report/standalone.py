"""The run report of a trainer that is not a `transformers.Trainer` (the diffusion trainers): the same
`metrics.jsonl` rows and `report.html` as `RunReportCallback`, written through explicit calls."""

from __future__ import annotations

import os
import warnings
from typing import Any

from .history import METRICS_FILE_NAME, REPORT_FILE_NAME, MetricsFileWriter


class StandaloneRunReport:
    """Writes `output_dir/metrics.jsonl` and `output_dir/report.html` for a custom training loop.

    Only the process that builds it with `enabled=True` writes; a failure is a warning (once per kind), never the end
    of the run.

    Args:
        output_dir (`str`): Where the files go.
        enabled (`bool`): Whether to write at all (e.g. `config.save_run_report and is_main_process`).
    """

    def __init__(self, output_dir: str, enabled: bool):
        self.output_dir = output_dir
        self.enabled = enabled
        self._writer = MetricsFileWriter(os.path.join(output_dir, METRICS_FILE_NAME))
        self._warned: set[str] = set()

    def _guarded(self, what: str, action, *args: Any, **kwargs: Any) -> Any:
        if not self.enabled:
            return None
        try:
            return action(*args, **kwargs)
        except Exception as error:  # the report must never end a run
            if what not in self._warned:
                self._warned.add(what)
                warnings.warn(
                    f"Run report: could not {what} ({type(error).__name__}: {error}). Training goes on; set "
                    "save_run_report=False to turn the report off.",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return None

    def start(self, step: int, trainer: str, model: str | None, config: Any, max_steps: int | None = None) -> None:
        """Record the run's start (a fresh run at step 0 replaces the previous history in `output_dir`)."""

        def write() -> None:
            from .callback import _versions
            from .config_summary import describe_config

            if step == 0:
                self._writer.start_new()
            changed, full = describe_config(config)
            self._writer.write(
                "run",
                step=step,
                resumed_from_step=step if step > 0 else None,
                trainer=trainer,
                model=model,
                output_dir=os.path.abspath(self.output_dir),
                max_steps=max_steps,
                world_size=1,
                config_class=type(config).__name__,
                config_changed=changed,
                config=full,
                versions=_versions(),
            )

        self._guarded("write the run's start to metrics.jsonl", write)

    def log(self, step: int, logs: dict[str, Any]) -> None:
        """Record one logged row; values that are not scalars (arrays of per-sample rewards) are left out."""

        def write() -> None:
            scalars = {}
            for key, value in logs.items():
                if hasattr(value, "ndim") and getattr(value, "ndim", 0) > 0:
                    continue
                scalars[key] = value
            self._writer.write("log", step=step, **scalars)

        self._guarded("write a row to metrics.jsonl", write)

    def checkpoint(self, step: int, path: str) -> None:
        """Record a checkpoint and re-render the page."""
        self._guarded("record the checkpoint in metrics.jsonl", self._writer.write, "checkpoint", step=step, path=path)
        self.render()

    def end(self, step: int) -> None:
        """Record the end of training, render the page and close the file."""
        self._guarded("write the run's end to metrics.jsonl", self._writer.write, "end", step=step, max_steps=step)
        self.render()
        self._writer.close()

    def render(self) -> str | None:
        """Write `report.html` from the rows so far; its path, or None."""
        from . import write_report

        return self._guarded(
            "write report.html", write_report, [self.output_dir], os.path.join(self.output_dir, REPORT_FILE_NAME)
        )
