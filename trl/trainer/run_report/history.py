"""The run history file `metrics.jsonl`: how rows are written while training and read back for a report.

Each line of `output_dir/metrics.jsonl` is one JSON object with a `"type"`:

- `"run"`: a training run started (or resumed): trainer, model, config, world size, step it started at.
- `"data"`: a summary of the training (and evaluation) data.
- `"log"`: one row the trainer logged (train or eval metrics), with `step`, `epoch` and `time`.
- `"samples"`: a few completions of an online trainer at a step.
- `"checkpoint"`: a checkpoint was written.
- `"end"`: training finished.

Rows are appended and flushed as they happen, so a run that is killed keeps every row written before the kill. This
module needs nothing beyond the standard library, so that `trl report` starts fast.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any


METRICS_FILE_NAME = "metrics.jsonl"
REPORT_FILE_NAME = "report.html"

# Keys of a log row that locate it rather than measure something.
POSITION_KEYS = ("type", "time", "step", "epoch")
# Keys of the closing row transformers logs at the end of `train()` (run totals, not per-step values).
RUN_TOTAL_KEYS = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos", "train_loss")


def to_json_value(value: Any) -> Any:
    """`value` as something `json.dumps` accepts: numbers, strings, bools and None stay; containers are converted
    item by item; tensors and numpy scalars become numbers; anything else becomes its `repr`."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(key): to_json_value(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [to_json_value(item) for item in value]
    item = getattr(value, "item", None)  # torch and numpy scalars
    if callable(item):
        try:
            return to_json_value(item())
        except (TypeError, ValueError, RuntimeError):
            pass
    enum_value = getattr(value, "value", None)  # transformers' enums (IntervalStrategy, ...)
    if isinstance(enum_value, (str, int, float)):
        return enum_value
    return repr(value)


class MetricsFileWriter:
    """Appends rows to a `metrics.jsonl` file, one JSON object a line, flushed after every row.

    Args:
        path (`str`):
            Path of the file; its directory is created on the first write.
    """

    def __init__(self, path: str):
        self.path = path
        self._file = None

    def start_new(self) -> None:
        """Empty the file: the rows that follow belong to a new run."""
        self.close()
        if os.path.exists(self.path):
            os.remove(self.path)

    @staticmethod
    def make_row(row_type: str, **values: Any) -> dict[str, Any]:
        """A row of `row_type` stamped with the current time, its values made JSON-ready."""
        return {"type": row_type, "time": round(time.time(), 3), **to_json_value(values)}

    def write(self, row_type: str, **values: Any) -> dict[str, Any]:
        """Append one row of `row_type` (its `time` is now) and return it."""
        return self.append(self.make_row(row_type, **values))

    def append(self, row: dict[str, Any]) -> dict[str, Any]:
        """Append a row made by `make_row` and return it."""
        if self._file is None:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")
        # One write call per line, flushed at once: a killed process leaves whole lines behind (at worst the very
        # last one cut short, which the reader skips).
        self._file.write(json.dumps(row, ensure_ascii=False) + "\n")
        self._file.flush()
        return row

    def close(self) -> None:
        """Close the file (the next `write` opens it again)."""
        if self._file is not None:
            self._file.close()
            self._file = None


def read_rows(path: str) -> list[dict[str, Any]]:
    """The rows of a `metrics.jsonl` file, in order. Lines that are not JSON objects (a last line cut short by a
    kill) are skipped."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows


def is_number(value: Any) -> bool:
    """Whether `value` is a finite or infinite real number that can be plotted (NaN and bools are not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


@dataclass
class RunHistory:
    """Everything a report shows about one run, parsed from its `metrics.jsonl` rows.

    Args:
        name (`str`):
            Short name of the run in the report (the output directory's name).
        source (`str`):
            Path of the `metrics.jsonl` file.
        run (`dict`):
            The latest `"run"` row (empty when the file has none, e.g. `evaluate()` without training).
        data (`dict` or `None`):
            The latest `"data"` row.
        logs (`list[dict]`):
            Per-step log rows (train and eval), without rows a resumed run logged again.
        totals (`dict`):
            The run totals transformers logs when training ends (`train_runtime`, ...).
        samples (`list[dict]`):
            `"samples"` rows, oldest first.
        checkpoints (`list[dict]`):
            `"checkpoint"` rows, oldest first.
        end (`dict` or `None`):
            The `"end"` row when training finished.
        started (`float` or `None`):
            Time (seconds since the epoch) the first training segment started.
    """

    name: str
    source: str
    run: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] | None = None
    logs: list[dict[str, Any]] = field(default_factory=list)
    totals: dict[str, Any] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    end: dict[str, Any] | None = None
    started: float | None = None
    segments: int = 0

    @classmethod
    def from_rows(cls, rows: list[dict[str, Any]], name: str, source: str) -> RunHistory:
        """Parse rows in file order. A `"run"` row of a resumed run (`resumed_from_step` S) drops the rows the
        interrupted run wrote after step S: the resumed run logs those steps again."""
        history = cls(name=name, source=source)
        for row in rows:
            kind = row.get("type")
            if kind == "run":
                resumed_from = row.get("resumed_from_step")
                if resumed_from is not None:
                    history._drop_after(resumed_from)
                else:
                    history.started = row.get("time")
                if history.started is None:
                    history.started = row.get("time")
                history.run = row
                history.end = None
                history.segments += 1
            elif kind == "data":
                history.data = row
            elif kind == "log":
                if any(key in row for key in RUN_TOTAL_KEYS[:3]):
                    history.totals = row
                else:
                    history.logs.append(row)
            elif kind == "samples":
                history.samples.append(row)
            elif kind == "checkpoint":
                history.checkpoints.append(row)
            elif kind == "end":
                history.end = row
        return history

    def _drop_after(self, step: int) -> None:
        def keep(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
            return [row for row in rows if (row.get("step") or 0) <= step]

        self.logs = keep(self.logs)
        self.samples = keep(self.samples)
        self.checkpoints = keep(self.checkpoints)

    # -------------------------------------------------------------------------------------------------------------
    # Metrics
    # -------------------------------------------------------------------------------------------------------------
    def metric_names(self) -> list[str]:
        """Names of the numeric metrics logged at least once, in the order they first appeared."""
        names: dict[str, None] = {}
        for row in self.logs:
            for key, value in row.items():
                if key not in POSITION_KEYS and is_number(value):
                    names.setdefault(key, None)
        return list(names)

    def series(self, name: str) -> tuple[list[float], list[float]]:
        """`(steps, values)` of metric `name`; a step logged twice keeps its last value."""
        by_step: dict[float, float] = {}
        for row in self.logs:
            value = row.get(name)
            if is_number(value):
                by_step[row.get("step") or 0] = float(value)
        steps = sorted(by_step)
        return steps, [by_step[step] for step in steps]

    def last_value(self, name: str) -> float | None:
        """The latest logged value of metric `name`, or None."""
        _, values = self.series(name)
        return values[-1] if values else None

    # -------------------------------------------------------------------------------------------------------------
    # Progress and timing
    # -------------------------------------------------------------------------------------------------------------
    @property
    def last_step(self) -> int:
        """The highest step any row reached."""
        steps = [row.get("step") or 0 for row in self.logs + self.checkpoints]
        for row in (self.end, self.run):
            if row:
                steps.append(row.get("step") or 0)
        return int(max(steps, default=0))

    @property
    def last_time(self) -> float | None:
        times = [row.get("time") for row in self.logs + self.checkpoints + self.samples if row.get("time")]
        for row in (self.end, self.totals, self.run, self.data):
            if row and row.get("time"):
                times.append(row["time"])
        return max(times) if times else None

    @property
    def status(self) -> str:
        """One of `finished`, `in progress or stopped` (no end row yet) or `no training` (evaluation rows only)."""
        if self.end is not None:
            return "finished"
        if self.run:
            return "in progress or stopped"
        return "no training"

    def wall_time_s(self) -> float | None:
        """Seconds from the start of the run to its latest row (includes time spent in interrupted segments)."""
        last = self.last_time
        if self.started is None or last is None:
            return None
        return max(0.0, last - self.started)

    def throughput(self) -> dict[str, float]:
        """Training speed: transformers' end-of-run totals when present, else measured from the rows (steps per
        second since the latest start), plus tokens per second when `num_tokens` is logged."""
        speed: dict[str, float] = {}
        runtime = self.totals.get("train_runtime")
        if is_number(runtime) and runtime > 0:
            speed["train_runtime_s"] = float(runtime)
            for key in ("train_samples_per_second", "train_steps_per_second"):
                if is_number(self.totals.get(key)):
                    speed[key] = float(self.totals[key])
        else:
            start_time, start_step = self.run.get("time"), self.run.get("step") or 0
            last = self.last_time
            if start_time and last and last > start_time and self.last_step > start_step:
                runtime = last - start_time
                speed["train_runtime_s"] = runtime
                speed["train_steps_per_second"] = (self.last_step - start_step) / runtime
        tokens = self.last_value("num_tokens")
        if tokens and speed.get("train_runtime_s"):
            speed["tokens_per_second"] = tokens / speed["train_runtime_s"]
        return speed


def metrics_file_of(path: str) -> str:
    """The `metrics.jsonl` file of `path`: the path itself when it is a file, else `path/metrics.jsonl`."""
    return path if os.path.isfile(path) else os.path.join(path, METRICS_FILE_NAME)


def load_run(path: str, name: str | None = None) -> RunHistory:
    """Read the run history of an output directory (or of a `metrics.jsonl` file).

    Args:
        path (`str`):
            An output directory holding `metrics.jsonl`, or the file itself.
        name (`str` or `None`, defaults to `None`):
            Name of the run in the report; the directory's name when None.

    Raises:
        FileNotFoundError: When there is no `metrics.jsonl` at `path`.
    """
    file_path = metrics_file_of(path)
    if not os.path.isfile(file_path):
        raise FileNotFoundError(
            f"No {METRICS_FILE_NAME} in {path!r}. It is written into a trainer's output_dir while training (unless "
            "save_run_report=False); pass that directory."
        )
    if name is None:
        directory = os.path.dirname(os.path.abspath(file_path))
        name = os.path.basename(directory) or directory
    return RunHistory.from_rows(read_rows(file_path), name=name, source=file_path)
