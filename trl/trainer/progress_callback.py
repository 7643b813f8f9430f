"""`RichProgressCallback`: rich progress bars and a live table of the latest metrics, in place of tqdm.

Re-exported by `trl.trainer.callbacks` (TRL's import path) and `trl`.
"""

from __future__ import annotations

import inspect
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import CallbackHandler, ProgressCallback

from ..import_utils import is_rich_available


def _format_metric(value: Any) -> str:
    """Numbers (booleans included) with three decimals, anything else as `str()` (TRL's cell format)."""
    if isinstance(value, (int, float)):
        return f"{value:.3f}"
    return str(value)


def _group_metrics(logs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Split `logs` by the part of each key before its first `/`; keys without `/` go to the `""` group."""
    groups: dict[str, dict[str, Any]] = {}
    for key, value in logs.items():
        group, sep, name = key.partition("/")
        if not sep:
            group, name = "", key
        groups.setdefault(group, {})[name] = value
    return groups


def _progress_columns() -> tuple:
    """The columns of the training and evaluation bars: description (wide enough for "Evaluation", so both bars
    line up), bar, percentage, time remaining."""
    from rich.progress import BarColumn, TaskProgressColumn, TextColumn, TimeRemainingColumn
    from rich.table import Column

    return (
        TextColumn("[progress.description]{task.description}", table_column=Column(min_width=len("Evaluation"))),
        BarColumn(),
        TaskProgressColumn(),
        TimeRemainingColumn(),
    )


class RichProgressCallback(TrainerCallback):
    """Show training/evaluation progress with [rich](https://github.com/Textualize/rich) instead of tqdm.

    On the main process, a live panel (TRL's layout) shows a training bar (up to `max_steps`), an evaluation bar
    while evaluation runs, and, next to a spinner, the latest logged metrics under the title `Step N`: one
    `Metric`/`Value` table per prefix (`rewards/accuracy` goes to a table titled `rewards`; keys without a `/` form
    the untitled first table), side by side, numbers with three decimals. When the console is not a terminal (logs
    redirected to a file, CI), the panel is printed once, in its final state, when training ends. Metrics logged
    outside training (`trainer.evaluate()` alone) are printed as a static `Step N` panel.

    Adding this callback to a trainer removes the trainer's default tqdm progress callback, so progress is not
    shown twice. Output goes to `self.console`, a `rich.console.Console` created when training starts unless one was
    assigned before.

    Example:

    ```python
    from trl import RichProgressCallback

    trainer = Trainer(..., callbacks=[RichProgressCallback()])
    ```
    """

    def __init__(self):
        if not is_rich_available():
            raise ImportError("RichProgressCallback requires the `rich` package. Install it with `pip install rich`.")
        self.console = None
        self.metrics_view = None
        self._reset_display()

    def _reset_display(self) -> None:
        """Forget the bars, the live display and the current step (before training starts and after it ends)."""
        self.training_bar = None
        self.prediction_bar = None
        self.training_task_id = None
        self.prediction_task_id = None
        self.rich_group = None
        self.rich_live = None
        self.training_status = None
        self.current_step = None

    # -- replacing the default progress bar -----------------------------------------------------------------------

    def _calling_handler(self) -> CallbackHandler | None:
        """The `CallbackHandler` currently dispatching an event to this callback, found on the call stack."""
        frame = inspect.currentframe()
        try:
            for _ in range(8):
                frame = frame.f_back if frame is not None else None
                if frame is None:
                    return None
                owner = frame.f_locals.get("self")
                if isinstance(owner, CallbackHandler) and any(cb is self for cb in owner.callbacks):
                    return owner
            return None
        finally:
            del frame

    def _remove_default_progress_callbacks(self) -> None:
        """Drop tqdm/notebook progress callbacks from the handler that calls us; they would duplicate our display."""
        try:
            from transformers.utils.notebook import NotebookProgressCallback
        except ImportError:  # transformers before 5.24 imports IPython there: without it, no notebook bar exists
            NotebookProgressCallback = ProgressCallback

        handler = self._calling_handler()
        if handler is None:
            return
        callbacks = handler.callbacks
        position = next(i for i, cb in enumerate(callbacks) if cb is self)
        duplicates = [cb for cb in callbacks if isinstance(cb, (ProgressCallback, NotebookProgressCallback))]
        if not duplicates:
            return
        for cb in duplicates:
            # A bar that already started (its callback ran before us for this event) must be closed.
            bar = getattr(cb, "training_bar", None)
            if bar is not None and hasattr(bar, "close"):
                bar.close()
                cb.training_bar = None
        if all(callbacks.index(cb) > position for cb in duplicates):
            # The handler is iterating over this very list: removing items after us in place keeps it consistent
            # and stops them from receiving the current event.
            for cb in duplicates:
                callbacks.remove(cb)
        else:
            # Removing an item before us would shift the list under the running loop: swap in a new list instead.
            handler.callbacks = [cb for cb in callbacks if cb not in duplicates]

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        self._remove_default_progress_callbacks()

    # -- display ----------------------------------------------------------------------------------------------------

    @property
    def _is_live(self) -> bool:
        return self.rich_live is not None

    @staticmethod
    def _render_metrics(step: int, logs: dict[str, Any]):
        """The `Step N` panel: one bordered `Metric`/`Value` table per key prefix, side by side."""
        from rich.columns import Columns
        from rich.panel import Panel
        from rich.table import Table

        tables = []
        for group, metrics in _group_metrics(logs).items():
            table = Table(title=group or None, box=None, header_style="bold")
            table.add_column("Metric")
            table.add_column("Value", justify="right")
            for name, value in metrics.items():
                table.add_row(name, _format_metric(value))
            tables.append(Panel(table))
        return Panel(Columns(tables, expand=True), title=f"Step {step}")

    def _refresh(self) -> None:
        if self.rich_live is not None:
            self.rich_live.update(self.rich_group, refresh=True)

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        self._remove_default_progress_callbacks()
        if not state.is_world_process_zero:
            return
        from rich.console import Console, Group
        from rich.live import Live
        from rich.panel import Panel
        from rich.progress import Progress
        from rich.spinner import Spinner

        if self.console is None:
            self.console = Console()
        self.current_step = 0
        self.metrics_view = None
        # Off a terminal, Live draws nothing until it stops and then prints the final panel once.
        self.training_bar = Progress(*_progress_columns(), console=self.console)
        self.prediction_bar = Progress(*_progress_columns(), console=self.console)
        self.training_status = Spinner("dots", text="Nothing to log yet ...")
        self.training_task_id = self.training_bar.add_task("[blue]Training", total=state.max_steps)
        self.rich_group = Panel(Group(self.training_bar, self.prediction_bar, self.training_status))
        self.rich_live = Live(self.rich_group, console=self.console, refresh_per_second=4, transient=False)
        self.rich_live.start()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if not state.is_world_process_zero or self.current_step is None:
            return
        if self._is_live:
            self.training_bar.update(self.training_task_id, advance=state.global_step - self.current_step)
        self.current_step = state.global_step

    def on_prediction_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, eval_dataloader=None, **kwargs
    ):
        if not state.is_world_process_zero or not self._is_live:
            return
        if self.prediction_task_id is None:
            try:
                total = len(eval_dataloader)
            except TypeError:
                total = None
            self.prediction_task_id = self.prediction_bar.add_task("[blue]Evaluation", total=total)
        self.prediction_bar.advance(self.prediction_task_id, 1)

    def _end_prediction(self, state: TrainerState) -> None:
        if state.is_world_process_zero and self._is_live and self.prediction_task_id is not None:
            self.prediction_bar.remove_task(self.prediction_task_id)
            self.prediction_task_id = None

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        self._end_prediction(state)

    def on_predict(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        self._end_prediction(state)

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        if self.console is None:
            # Logged outside training (e.g. `trainer.evaluate()` alone): print statically.
            from rich.console import Console

            self.console = Console()
        self.metrics_view = self._render_metrics(state.global_step, logs)
        if self._is_live:
            self.training_status.update(text=self.metrics_view)
            self._refresh()
        else:
            self.console.print(self.metrics_view)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if not state.is_world_process_zero:
            return
        if self._is_live:
            self._refresh()
            self.rich_live.stop()
        self._reset_display()
