"""Timing helpers that report how long trainer sections take to the experiment trackers."""

import functools
import time
from collections.abc import Callable
from typing import Any

from ..import_utils import is_trackio_available, is_wandb_available


class ProfilingContext:
    """Context manager timing a block and logging the duration to Weights & Biases and/or trackio.

    On exit, the metric `f"{metric_prefix}: {name}"` (seconds) is logged on the main process to every tracker in
    `report_to` that is installed and has an active run. The measured time is also kept in `duration`.

    Args:
        name: Label of the timed section, e.g. `"GRPOTrainer._generate"`.
        report_to: Trackers to log to (e.g. `["wandb"]`, `"all"`, `"none"`).
        is_main_process: Only the main process logs.
        step: Global step logged alongside the duration as `train/global_step` (the x-axis the transformers
            tracker callbacks use), when given.
        metric_prefix: Prefix of the metric name.

    Example:
        >>> with ProfilingContext("my_section", report_to=[]) as ctx:
        ...     pass
        >>> ctx.duration >= 0
        True
    """

    def __init__(
        self,
        name: str,
        report_to: list[str] | str | None,
        is_main_process: bool = True,
        step: int | None = None,
        metric_prefix: str = "profiling/Time taken",
    ):
        self.name = name
        if report_to is None:
            report_to = []
        elif isinstance(report_to, str):
            report_to = [report_to]
        self.report_to = list(report_to)
        self.is_main_process = is_main_process
        self.step = step
        self.metric_prefix = metric_prefix
        self.start_time: float | None = None
        self.duration: float | None = None

    @property
    def metric_name(self) -> str:
        """Name under which the duration is logged."""
        return f"{self.metric_prefix}: {self.name}"

    def _reports(self, tracker: str) -> bool:
        return tracker in self.report_to or "all" in self.report_to

    def __enter__(self) -> "ProfilingContext":
        self.start_time = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        self.duration = time.perf_counter() - self.start_time
        if not self.is_main_process:
            return
        metrics = {self.metric_name: self.duration}
        if self.step is not None:
            metrics["train/global_step"] = self.step
        if self._reports("wandb") and is_wandb_available():
            import wandb

            if wandb.run is not None:
                wandb.log(metrics)
        if self._reports("trackio") and is_trackio_available():
            import trackio

            try:
                trackio.log(metrics)
            except Exception:  # no active trackio run: profiling must never break training
                pass


def profiling_context(trainer: Any, name: str) -> ProfilingContext:
    """Time a block of a trainer method; the metric is named `profiling/Time taken: <TrainerClass>.<name>`.

    Args:
        trainer: Trainer whose `args.report_to`, `accelerator.is_main_process` and `state.global_step` are used.
        name: Name of the timed section.

    Returns:
        A [`ProfilingContext`].

    Example:
        ```python
        with profiling_context(self, "reward_model"):
            rewards = self.reward_model(inputs)
        ```
    """
    args = getattr(trainer, "args", None)
    accelerator = getattr(trainer, "accelerator", None)
    state = getattr(trainer, "state", None)
    return ProfilingContext(
        name=f"{trainer.__class__.__name__}.{name}",
        report_to=getattr(args, "report_to", None),
        is_main_process=getattr(accelerator, "is_main_process", True),
        step=getattr(state, "global_step", None),
    )


def profiling_decorator(func: Callable) -> Callable:
    """Decorator for trainer methods: times each call with [`profiling_context`] under the method's name."""

    @functools.wraps(func)
    def wrapper(self, *args, **kwargs):
        with profiling_context(self, func.__name__):
            return func(self, *args, **kwargs)

    return wrapper


__all__ = ["ProfilingContext", "profiling_context", "profiling_decorator"]
