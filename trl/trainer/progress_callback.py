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
    if isinstance(value, bool):
        return str(value)
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


class RichProgressCallback(TrainerCallback):
    """Show training/evaluation progress with [rich](https://github.com/Textualize/rich) instead of tqdm.

    On the main process, a live panel shows a training bar (up to `max_steps`), an evaluation bar while evaluation
    runs, and the latest logged metrics, one table per prefix (`train/...`, `eval/...`, `rewards/...`; keys without
    a prefix form their own table), under the title `Step N`. When the console is not a terminal (logs redirected to
    a file, CI), nothing is redrawn: each logged set of metrics is printed once as static tables and a summary line
    closes training.

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

    def _render_metrics(self, step: int, logs: dict[str, Any]):
        from rich.console import Group
        from rich.panel import Panel
        from rich.table import Table

        tables = []
        for group, metrics in _group_metrics(logs).items():
            table = Table(title=group or None, show_header=True, header_style="bold", title_style="bold cyan")
            table.add_column("metric")
            table.add_column("value", justify="right")
            for name, value in metrics.items():
                table.add_row(name, _format_metric(value))
            tables.append(table)
        return Panel(Group(*tables), title=f"Step {step}", expand=False)

    def _refresh(self) -> None:
        from rich.console import Group
        from rich.panel import Panel

        if self.rich_live is None:
            return
        parts = [Panel(Group(self.training_bar, self.prediction_bar, self.training_status), title="Training")]
        if self.metrics_view is not None:
            parts.append(self.metrics_view)
        self.rich_group = Group(*parts)
        self.rich_live.update(self.rich_group, refresh=True)

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        self._remove_default_progress_callbacks()
        if not state.is_world_process_zero:
            return
        from rich.console import Console
        from rich.live import Live
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.text import Text

        if self.console is None:
            self.console = Console()
        self.current_step = 0
        self.metrics_view = None
        if not self.console.is_terminal:
            # No cursor control: print static output only (see on_log / on_train_end).
            return

        columns = (
            TextColumn("[progress.description]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
        )
        self.training_bar = Progress(*columns, console=self.console)
        self.prediction_bar = Progress(*columns, console=self.console)
        self.training_status = Text("")
        self.training_task_id = self.training_bar.add_task("[blue]Training", total=state.max_steps)
        self.rich_live = Live(console=self.console, refresh_per_second=4, transient=False)
        self._refresh()
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
            self.prediction_task_id = self.prediction_bar.add_task("[cyan]Evaluating", total=total)
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
        logs = {key: value for key, value in logs.items() if key != "total_flos"}
        self.metrics_view = self._render_metrics(state.global_step, logs)
        if self._is_live:
            self.training_status.plain = f"step {state.global_step}/{state.max_steps}"
            self._refresh()
        else:
            self.console.print(self.metrics_view)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if not state.is_world_process_zero:
            return
        if self._is_live:
            self._refresh()
            self.rich_live.stop()
        elif self.console is not None and self.current_step is not None:
            self.console.print(f"Training finished at step {state.global_step}/{state.max_steps}.")
        self._reset_display()
