"""The report's curves: which metrics get a chart, drawn as inline SVG (no plotting library, no image files)."""

from __future__ import annotations

import math
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


# matplotlib's default colour cycle ("tab10"), so the charts look as the usual tools draw them.
_COLORS = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)
_DASHES = ("", "6 3", "2 3", "6 3 2 3")
_WIDTH, _HEIGHT = 600, 270
_LEFT, _RIGHT, _TOP, _BOTTOM = 62, 16, 34, 38


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def _nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About `count` round tick values covering `[low, high]` (steps of 1, 2 or 5 times a power of ten)."""
    if not math.isfinite(low) or not math.isfinite(high):
        return []
    if high <= low:
        high, low = low + (abs(low) or 1.0) * 0.5, low - (abs(low) or 1.0) * 0.5
    raw = (high - low) / max(count - 1, 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    first = math.floor(low / step) * step
    ticks, value = [], first
    while value <= high + step * 1e-9:
        ticks.append(round(value, 12))
        value += step
    if ticks[-1] < high:
        ticks.append(round(value, 12))
    return ticks


def _label(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1e4 or abs(value) < 1e-3:
        return f"{value:.2g}"
    return f"{value:.4g}"


class _Frame:
    """Maps data coordinates to the SVG's pixels and draws the axes, grid and ticks."""

    def __init__(self, xs: list[float], ys: list[float], log_scale: bool = False, integer_x: bool = True):
        self.log_scale = log_scale
        ys = [math.log10(y) for y in ys if y > 0] if log_scale else ys
        self.x_ticks = _nice_ticks(min(xs), max(xs), 6)
        if integer_x:
            self.x_ticks = [t for t in self.x_ticks if float(t).is_integer()] or self.x_ticks
        self.y_ticks = _nice_ticks(min(ys), max(ys), 5) if ys else [0.0, 1.0]
        self.x_low, self.x_high = min(xs + self.x_ticks), max(xs + self.x_ticks)
        self.y_low, self.y_high = min(ys + self.y_ticks), max(ys + self.y_ticks)

    def x(self, value: float) -> float:
        span = (self.x_high - self.x_low) or 1.0
        return _LEFT + (value - self.x_low) / span * (_WIDTH - _LEFT - _RIGHT)

    def y(self, value: float) -> float:
        if self.log_scale:
            value = math.log10(value) if value > 0 else self.y_low
        span = (self.y_high - self.y_low) or 1.0
        return _HEIGHT - _BOTTOM - (value - self.y_low) / span * (_HEIGHT - _TOP - _BOTTOM)

    def axes(self, x_label: str, y_label: str | None = None) -> list[str]:
        parts = []
        for tick in self.y_ticks:
            y = self.y(10**tick if self.log_scale else tick)
            text = _label(10**tick if self.log_scale else tick)
            parts.append(f'<line x1="{_LEFT}" x2="{_WIDTH - _RIGHT}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>')
            parts.append(f'<text x="{_LEFT - 6}" y="{y + 3:.1f}" text-anchor="end">{text}</text>')
        for tick in self.x_ticks:
            x = self.x(tick)
            parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{_TOP}" y2="{_HEIGHT - _BOTTOM}" class="grid"/>')
            parts.append(f'<text x="{x:.1f}" y="{_HEIGHT - _BOTTOM + 14}" text-anchor="middle">{_label(tick)}</text>')
        bottom = _HEIGHT - _BOTTOM
        parts.append(f'<line x1="{_LEFT}" x2="{_WIDTH - _RIGHT}" y1="{bottom}" y2="{bottom}" class="axis"/>')
        parts.append(f'<line x1="{_LEFT}" x2="{_LEFT}" y1="{_TOP}" y2="{bottom}" class="axis"/>')
        parts.append(
            f'<text x="{(_LEFT + _WIDTH - _RIGHT) / 2:.0f}" y="{_HEIGHT - 6}" text-anchor="middle">{x_label}</text>'
        )
        if y_label:
            parts.append(
                f'<text x="12" y="{(_TOP + bottom) / 2:.0f}" text-anchor="middle" '
                f'transform="rotate(-90 12 {(_TOP + bottom) / 2:.0f})">{y_label}</text>'
            )
        return parts


def _svg(title: str, body: list[str]) -> str:
    style = (
        "<style>text{font:11px sans-serif;fill:#57606a}.title{font-size:13px;fill:#1f2328}"
        ".grid{stroke:#d0d7de;stroke-opacity:.6}.axis{stroke:#57606a}</style>"
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {_WIDTH} {_HEIGHT}" role="img" '
        f'aria-label="{_escape(title)}">{style}<text x="{_LEFT}" y="18" class="title">{_escape(title)}</text>'
        + "".join(body)
        + "</svg>"
    )


def render_panel(panel: Panel, runs: list[RunHistory]) -> str | None:
    """Inline SVG of `panel` with one line per (run, metric); None when no run logged any of its metrics.

    With one run, colours tell the metrics apart; with several, colours tell the runs apart and dash patterns the
    metrics (the legend names both). Drawn as plain SVG (no plotting library): a page with a dozen charts renders in
    milliseconds at the end of a run.
    """
    several_runs = len(runs) > 1
    lines = []
    for run_index, run in enumerate(runs):
        for metric_index, name in enumerate(panel.metrics):
            steps, values = run.series(name)
            points = [(s, v) for s, v in zip(steps, values) if v is not None and math.isfinite(v)]
            if not points:
                continue
            color = _COLORS[(run_index if several_runs else metric_index) % len(_COLORS)]
            dash = _DASHES[metric_index % len(_DASHES)] if several_runs else ""
            label = f"{run.name} · {name}" if several_runs else name
            lines.append((points, color, dash, label))
    if not lines:
        return None
    frame = _Frame(
        [float(s) for points, *_ in lines for s, _ in points],
        [float(v) for points, *_ in lines for _, v in points],
        panel.log_scale,
    )
    body = frame.axes("step")
    for points, color, dash, _ in lines:
        coordinates = " ".join(f"{frame.x(s):.1f},{frame.y(v):.1f}" for s, v in points)
        dash_attribute = f' stroke-dasharray="{dash}"' if dash else ""
        body.append(
            f'<polyline points="{coordinates}" fill="none" stroke="{color}" stroke-width="1.6"{dash_attribute}/>'
        )
        if len(points) <= 25:
            body.extend(
                f'<circle cx="{frame.x(s):.1f}" cy="{frame.y(v):.1f}" r="2.2" fill="{color}"/>' for s, v in points
            )
    for index, (_, color, dash, label) in enumerate(lines):
        y = _TOP + 4 + 14 * index
        x = _WIDTH - _RIGHT - 150
        dash_attribute = f' stroke-dasharray="{dash}"' if dash else ""
        body.append(
            f'<line x1="{x}" x2="{x + 18}" y1="{y}" y2="{y}" stroke="{color}" stroke-width="2"{dash_attribute}/>'
        )
        body.append(f'<text x="{x + 22}" y="{y + 4}">{_escape(label[:28])}</text>')
    return _svg(panel.title, body)


def render_histogram(edges: list[float], counts: list[int], title: str) -> str | None:
    """Inline SVG bar chart of a histogram (`len(edges) == len(counts) + 1`); None when it is empty."""
    if not counts or len(edges) != len(counts) + 1 or not any(counts):
        return None
    frame = _Frame([float(e) for e in edges], [0.0, float(max(counts))], integer_x=False)
    body = frame.axes("tokens", "rows")
    for left, right, count in zip(edges[:-1], edges[1:], counts):
        x0, x1 = frame.x(left), frame.x(right)
        top, bottom = frame.y(count), frame.y(0.0)
        body.append(
            f'<rect x="{x0:.1f}" y="{top:.1f}" width="{max(x1 - x0 - 1, 0.5):.1f}" height="{bottom - top:.1f}" '
            f'fill="{_COLORS[0]}" fill-opacity="0.8"/>'
        )
    return _svg(title, body)
