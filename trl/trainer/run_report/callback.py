"""`RunReportCallback`: the run history (`metrics.jsonl`) and report (`report.html`) every TRL trainer writes into
its `output_dir`. See `docs/run_report.md`."""

from __future__ import annotations

import os
import warnings
import weakref
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from .config_summary import describe_config
from .data_summary import describe_trainer_data
from .history import METRICS_FILE_NAME, REPORT_FILE_NAME, MetricsFileWriter, to_json_value


# At most this many completions are kept per logged step for the report's samples.
_SAMPLES_KEPT = 4


def run_report_enabled(args: Any) -> bool:
    """Whether `args` asks for a run report: `save_run_report` (default True) and an `output_dir` to write into."""
    return bool(getattr(args, "save_run_report", True)) and bool(getattr(args, "output_dir", None))


def _versions() -> dict[str, str]:
    import importlib.metadata

    versions = {}
    for package in ("trl", "transformers", "torch", "accelerate", "datasets"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions


def keep_samples_for_report(
    trainer: Any, prompts: list[Any], completions: list[Any], rewards: Any, reward_names: list[str]
) -> None:
    """Keep a few of this process's latest completions (with their rewards) for the run report's samples.

    Called by the online trainers after each scored generation batch; cheap (a handful of rows, no gathering).

    Args:
        trainer: The online trainer (the rows are kept on it).
        prompts (`list`): This process's prompts of the batch.
        completions (`list`): Their completions.
        rewards: `(len(prompts), len(reward_names))` rewards of these completions, or None.
        reward_names (`list[str]`): Names of the reward columns.
    """
    if not run_report_enabled(trainer.args) or not trainer.is_world_process_zero() or not completions:
        return
    try:
        count = len(completions)
        kept = min(_SAMPLES_KEPT, count)
        indices = [int(i * count / kept) for i in range(kept)]  # spread over the batch: several prompts
        reward_rows = rewards[indices].tolist() if rewards is not None and reward_names else None
        rows = []
        for position, index in enumerate(indices):
            row = {"prompt": to_json_value(prompts[index]), "completion": to_json_value(completions[index])}
            if reward_rows is not None:
                row.update({name: value for name, value in zip(reward_names, reward_rows[position])})
            rows.append(row)
    except Exception as error:  # the report must never end a run: leave the samples out
        if not getattr(trainer, "_run_report_samples_failed", False):
            trainer._run_report_samples_failed = True
            warnings.warn(f"Run report: could not keep sample completions ({type(error).__name__}: {error}).")
        return
    trainer._run_report_samples = (trainer.state.global_step, rows)


class RunReportCallback(TrainerCallback):
    """Writes `output_dir/metrics.jsonl` as the trainer logs, and `output_dir/report.html` at each checkpoint and
    when training ends.

    Every TRL trainer installs it (opt out with `save_run_report=False`); with another `Trainer`, add it by hand.
    Only the main process writes. A failure while writing is reported as a warning and never stops training.

    Args:
        trainer (`transformers.Trainer` or `None`, defaults to `None`):
            The trainer, for the data summary and sample completions (held through a weak reference). Without it the
            report has the metrics, config and checkpoints only.

    Example:
    ```python
    from transformers import Trainer
    from trl.trainer.run_report import RunReportCallback

    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    trainer.add_callback(RunReportCallback(trainer))
    trainer.train()  # then open args.output_dir + "/report.html"
    ```
    """

    def __init__(self, trainer: Any = None):
        self._trainer = weakref.ref(trainer) if trainer is not None else (lambda: None)
        self._writer: MetricsFileWriter | None = None
        self._rows_written = 0
        # The start rows of a run wait here until it logs something: a run refused at its first step (a reward
        # function returning NaN, ...) leaves output_dir as it was.
        self._pending_rows: list[dict] = []
        self._start_fresh = False
        self._samples_step_written: int | None = None
        self._failures_warned: set[str] = set()

    # -------------------------------------------------------------------------------------------------------------
    # Plumbing
    # -------------------------------------------------------------------------------------------------------------
    def _active(self, args: TrainingArguments, state: TrainerState) -> bool:
        return run_report_enabled(args) and state.is_world_process_zero

    def _writer_for(self, args: TrainingArguments) -> MetricsFileWriter:
        path = os.path.join(args.output_dir, METRICS_FILE_NAME)
        if self._writer is None or self._writer.path != path:
            if self._writer is not None:
                self._writer.close()
            self._writer = MetricsFileWriter(path)
        return self._writer

    def _write(self, args: TrainingArguments, row_type: str, **values: Any) -> None:
        writer = self._writer_for(args)
        if self._start_fresh:
            writer.start_new()  # a fresh run in this output_dir replaces the previous run's history
            self._start_fresh = False
        pending, self._pending_rows = self._pending_rows, []
        for row in pending:
            writer.append(row)
        writer.write(row_type, **values)
        self._rows_written += 1 + len(pending)

    def _defer(self, row_type: str, **values: Any) -> None:
        self._pending_rows.append(MetricsFileWriter.make_row(row_type, **values))

    def _warn_once(self, what: str, error: Exception) -> None:
        # One warning per kind of failure: a full disk would otherwise warn at every logging step.
        if what in self._failures_warned:
            return
        self._failures_warned.add(what)
        warnings.warn(
            f"Run report: could not {what} ({type(error).__name__}: {error}). Training goes on; set "
            "save_run_report=False to turn the report off.",
            RuntimeWarning,
            stacklevel=3,
        )

    def render(self, args: TrainingArguments) -> str | None:
        """Write `report.html` from the rows written so far; returns its path (None if it could not be written)."""
        from . import write_report

        try:
            return write_report([args.output_dir], os.path.join(args.output_dir, REPORT_FILE_NAME))
        except Exception as error:  # the report must never end a run
            self._warn_once("write report.html", error)
            return None

    # -------------------------------------------------------------------------------------------------------------
    # Events
    # -------------------------------------------------------------------------------------------------------------
    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if not self._active(args, state):
            return
        trainer = self._trainer()
        try:
            resumed = state.global_step > 0
            self._start_fresh = not resumed and self._rows_written == 0
            self._pending_rows = []
            changed, full = describe_config(args)
            model = getattr(getattr(trainer, "model", None), "config", None)
            self._defer(
                "run",
                step=state.global_step,
                resumed_from_step=state.global_step if resumed else None,
                trainer=type(trainer).__name__ if trainer is not None else None,
                model=getattr(model, "_name_or_path", None),
                output_dir=os.path.abspath(args.output_dir),
                max_steps=state.max_steps,
                num_train_epochs=state.num_train_epochs,
                world_size=args.world_size,
                config_class=type(args).__name__,
                config_changed=changed,
                config=full,
                versions=_versions(),
            )
        except Exception as error:
            self._warn_once("write the run's start to metrics.jsonl", error)
            return
        if trainer is not None:
            try:
                self._defer("data", **describe_trainer_data(trainer))
            except Exception as error:
                self._warn_once("summarise the data", error)

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs=None, **kwargs):
        if not self._active(args, state) or not logs:
            return
        try:
            self._write(args, "log", **{"step": state.global_step, "epoch": state.epoch, **logs})
            self._write_new_samples(args)
        except Exception as error:
            self._warn_once("append to metrics.jsonl", error)

    def _write_new_samples(self, args: TrainingArguments) -> None:
        trainer = self._trainer()
        kept = getattr(trainer, "_run_report_samples", None)
        if kept is None or kept[0] == self._samples_step_written:
            return
        step, rows = kept
        self._write(args, "samples", step=step, samples=rows)
        self._samples_step_written = step

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if not self._active(args, state):
            return
        try:
            path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            self._write(args, "checkpoint", step=state.global_step, path=os.path.abspath(path))
        except Exception as error:
            self._warn_once("record the checkpoint in metrics.jsonl", error)
        self.render(args)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if not self._active(args, state):
            return
        try:
            self._write(args, "end", step=state.global_step, max_steps=state.max_steps)
        except Exception as error:
            self._warn_once("write the run's end to metrics.jsonl", error)
        self.render(args)
        if self._writer is not None:
            self._writer.close()
