"""Parity cases: what `RichProgressCallback` renders, as text (spinner frame and times masked).

The callback is driven with the trainer's events (train begin, steps, evaluation, logs, train end) on an 80-100
column console that is not a terminal, where rich prints the live panel once, in its final state, when training ends.
The consoles are the ones the callback creates itself (or rich's global one); the case makes every `rich` console
write to a string for the duration of the run.
"""

from __future__ import annotations

import re

from . import register


_SPINNER = re.compile("[⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏]")
_TIMES = re.compile(r"\d+:\d\d:\d\d|-:--:--")


def _render(ctx, steps: list[tuple[int, dict | None, bool]], max_steps: int = 3, width: int = 100) -> dict:
    """Drive a `RichProgressCallback` through `steps` (global step, logs or None, whether an evaluation of two
    batches runs first) and return the text it printed."""
    import io
    from unittest import mock

    import rich
    from rich.console import Console
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from trl.trainer.callbacks import RichProgressCallback

    consoles = []
    original_init = Console.__init__

    def recording_init(self, *args, **kwargs):
        kwargs.update(file=io.StringIO(), force_terminal=False, width=width, color_system=None, force_jupyter=False)
        original_init(self, *args, **kwargs)
        consoles.append(self)

    args = TrainingArguments(output_dir=ctx.tmpdir(), report_to="none", use_cpu=True)
    state, control = TrainerState(max_steps=max_steps), TrainerControl()
    # rich's global console (`rich.get_console()`, used by bars given no console) is rebuilt under the patch too.
    with mock.patch.object(Console, "__init__", recording_init), mock.patch.object(rich, "_console", None):
        callback = RichProgressCallback()
        callback.on_train_begin(args, state, control)
        for step, logs, evaluate in steps:
            state.global_step = step
            callback.on_step_end(args, state, control)
            if evaluate:
                for _ in range(2):
                    callback.on_prediction_step(args, state, control, eval_dataloader=[0, 1])
                callback.on_evaluate(args, state, control, metrics={})
            if logs is not None:
                callback.on_log(args, state, control, logs=logs)
        callback.on_train_end(args, state, control)
    text = "".join(console.file.getvalue() for console in consoles)
    return {"lines": _TIMES.sub("T", _SPINNER.sub("*", text)).rstrip("\n").split("\n")}


_TRAIN_LOGS = {"loss": 1.2345, "grad_norm": 0.5, "learning_rate": 2e-5, "num_tokens": 27.0, "epoch": 0.5}
_GROUPED_LOGS = {**_TRAIN_LOGS, "rewards/accuracy": 0.75, "rewards/format/mean": 0.25, "rewards/std": 0.1}
_VALUE_KINDS = {"int": 3, "flag": True, "none": None, "text": "abc", "big": 123456789.0, "tiny": 1.5e-7, "neg": -2.25}

register("callbacks/rich_progress/one_table", lambda ctx: _render(ctx, [(1, _TRAIN_LOGS, False)]))
register("callbacks/rich_progress/grouped_metrics", lambda ctx: _render(ctx, [(1, _GROUPED_LOGS, False)]))
register("callbacks/rich_progress/value_kinds", lambda ctx: _render(ctx, [(2, _VALUE_KINDS, False)]))
register(
    "callbacks/rich_progress/evaluation_then_summary",
    lambda ctx: _render(
        ctx,
        [
            (1, _TRAIN_LOGS, False),
            (2, {"eval_loss": 1.1, "eval_rewards/chosen": 0.3, "epoch": 1.0}, True),
            (3, {"train_runtime": 3.5, "train_loss": 1.5, "total_flos": 1234.0, "epoch": 1.5}, False),
        ],
    ),
)
register("callbacks/rich_progress/nothing_logged", lambda ctx: _render(ctx, [(1, None, False)]))
register("callbacks/rich_progress/width=80", lambda ctx: _render(ctx, [(1, _GROUPED_LOGS, False)], width=80))
