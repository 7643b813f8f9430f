"""The report's curves: which metrics get a chart, and PNG rendering with matplotlib (optional).

matplotlib is used through its object-oriented `Figure` API only: no `pyplot`, no global backend switch, so a run in
a notebook or with an interactive backend keeps its own settings.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass

from .history import RunHistory


@dataclass(frozen=True)
class Panel:
    """One chart of the report.

    Args:
        title (`str`):
            Heading of the chart.
        metrics (`tuple[str, ...]`):
            Metric names drawn on it (those a run did not log are skipped).
        log_scale (`bool`, defaults to `False`):
            Whether the y axis is logarithmic.
    """

    title: str
    metrics: tuple[str, ...]
    log_scale: bool = False


# The charts every report starts with, in this order, when their metrics were logged: the shared training signals,
# then each trainer family's own (online: rewards and KL; preference: rewards and margins; SFT: token accuracy).
KEY_PANELS = (
    Panel("Loss", ("loss", "eval_loss")),
    Panel("Learning rate", ("learning_rate",)),
    Panel("Gradient norm", ("grad_norm",)),
    Panel("Reward", ("reward", "eval_reward")),
    Panel("Reward spread within groups", ("reward_std", "frac_reward_zero_std")),
    Panel("KL to the reference", ("kl", "eval_kl", "objective/kl")),
    Panel(
        "Preference rewards", ("rewards/chosen", "rewards/rejected", "eval_rewards/chosen", "eval_rewards/rejected")
    ),
    Panel("Reward margin", ("rewards/margins", "eval_rewards/margins")),
    Panel("Preference accuracy", ("rewards/accuracies", "eval_rewards/accuracies")),
    Panel("Accuracy", ("accuracy", "eval_accuracy")),
    Panel("Token accuracy", ("mean_token_accuracy", "eval_mean_token_accuracy")),
    Panel("Entropy", ("entropy", "eval_entropy")),
    Panel("Completion length", ("completions/mean_length", "eval_completions/mean_length")),
)
# Per-reward-function means of the online trainers: `rewards/<function name>/mean`.
_PER_FUNCTION_REWARD = re.compile(r"^rewards/.+/mean$")


def select_panels(runs: list[RunHistory]) -> list[Panel]:
    """The key charts for `runs`: each panel of `KEY_PANELS` with at least one logged metric, plus one chart of the
    per-function rewards of online trainers with several reward functions."""
    logged: dict[str, None] = {}
    for run in runs:
        logged.update(dict.fromkeys(run.metric_names()))
    panels = []
    for panel in KEY_PANELS:
        present = tuple(name for name in panel.metrics if name in logged)
        if present:
            panels.append(Panel(panel.title, present, panel.log_scale))
    per_function = tuple(name for name in logged if _PER_FUNCTION_REWARD.match(name))
    if len(per_function) > 1:
        titles = [panel.title for panel in panels]
        position = titles.index("Reward") + 1 if "Reward" in titles else len(panels)
        panels.insert(position, Panel("Reward per function", per_function))
    return panels


def charted_metrics(panels: list[Panel]) -> set[str]:
    """Every metric name drawn by `panels`."""
    return {name for panel in panels for name in panel.metrics}


def matplotlib_available() -> bool:
    """Whether matplotlib can be imported (the report falls back to tables without it)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


_LINE_STYLES = ("-", "--", ":", "-.")


def _new_axes(width: float = 6.0, height: float = 2.8):
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(width, height), dpi=96, layout="constrained")
    axes = figure.subplots()
    axes.grid(True, alpha=0.3)
    axes.spines[["top", "right"]].set_visible(False)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps and token counts are whole numbers
    return figure, axes


def _png_bytes(figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def render_panel(panel: Panel, runs: list[RunHistory]) -> bytes | None:
    """PNG of `panel` with one line per (run, metric); None when no run logged any of its metrics.

    With one run, colours tell the metrics apart; with several, colours tell the runs apart and line styles the
    metrics (the legend names both).
    """
    figure, axes = _new_axes()
    drawn = 0
    several_runs = len(runs) > 1
    for run_index, run in enumerate(runs):
        for metric_index, name in enumerate(panel.metrics):
            steps, values = run.series(name)
            if not steps:
                continue
            color = f"C{run_index % 10}" if several_runs else f"C{metric_index % 10}"
            style = _LINE_STYLES[metric_index % len(_LINE_STYLES)] if several_runs else "-"
            label = f"{run.name} · {name}" if several_runs else name
            marker = "o" if len(steps) <= 25 else None
            axes.plot(steps, values, style, color=color, label=label, marker=marker, markersize=3, linewidth=1.4)
            drawn += 1
    if not drawn:
        return None
    if panel.log_scale:
        axes.set_yscale("log")
    axes.set_title(panel.title, fontsize=11, loc="left")
    axes.set_xlabel("step", fontsize=9)
    axes.tick_params(labelsize=8)
    axes.legend(fontsize=8, frameon=False)
    return _png_bytes(figure)


def render_histogram(edges: list[float], counts: list[int], title: str) -> bytes | None:
    """PNG bar chart of a histogram (`len(edges) == len(counts) + 1`); None when it is empty."""
    if not counts or len(edges) != len(counts) + 1 or not any(counts):
        return None
    figure, axes = _new_axes(width=5.0, height=2.4)
    widths = [right - left for left, right in zip(edges[:-1], edges[1:])]
    axes.bar(edges[:-1], counts, width=widths, align="edge", color="C0", alpha=0.8, edgecolor="white")
    axes.set_title(title, fontsize=11, loc="left")
    axes.set_xlabel("tokens", fontsize=9)
    axes.set_ylabel("rows", fontsize=9)
    axes.tick_params(labelsize=8)
    return _png_bytes(figure)
