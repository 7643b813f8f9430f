"""The report page: one self-contained HTML file (inline CSS, curves as inline SVG, no script, no link to
anything outside the file) built from one or several run histories."""

from __future__ import annotations

import datetime
import html
import os
from collections.abc import Iterable
from typing import Any

from .charts import charted_metrics, render_histogram, render_panel, select_panels
from .history import RunHistory, is_number


# How many steps' worth of sample completions the page shows, and how much of each text.
_SAMPLE_STEPS_SHOWN = 3
_SAMPLE_TEXT_CHARS = 1200

_STYLE = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 2rem auto; max-width: 1180px;
       padding: 0 1rem; color: #1f2328; line-height: 1.45; }
h1 { font-size: 1.6rem; margin-bottom: 0.2rem; }
h2 { font-size: 1.2rem; margin-top: 2.2rem; border-bottom: 1px solid #d0d7de; padding-bottom: 0.3rem; }
h3 { font-size: 1rem; margin-bottom: 0.4rem; }
.subtitle, .note { color: #59636e; font-size: 0.9rem; }
.note { background: #f6f8fa; border-left: 3px solid #d0d7de; padding: 0.5rem 0.8rem; }
table { border-collapse: collapse; font-size: 0.85rem; margin: 0.5rem 0 1rem; }
th, td { border: 1px solid #d0d7de; padding: 0.25rem 0.6rem; text-align: left; vertical-align: top; }
th { background: #f6f8fa; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.charts { display: grid; grid-template-columns: repeat(auto-fill, minmax(560px, 1fr)); gap: 0.8rem; }
figure.chart { margin: 0.4rem 0; max-width: 640px; }
figure.chart svg { width: 100%; height: auto; border: 1px solid #eaeef2; border-radius: 4px; }
pre { white-space: pre-wrap; word-break: break-word; margin: 0; font-size: 0.8rem; max-height: 16rem; overflow: auto; }
details summary { cursor: pointer; color: #0969da; margin: 0.5rem 0; }
code { background: #f6f8fa; padding: 0 0.2rem; border-radius: 3px; }
"""


# ---------------------------------------------------------------------------------------------------------------------
# Formatting
# ---------------------------------------------------------------------------------------------------------------------
def format_number(value: Any) -> str:
    """A number for a table: integers in full with thousands separators, other values with 4 significant digits."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "" if value is None else str(value)
    if isinstance(value, int) or (value.is_integer() and abs(value) < 1e15):
        return f"{int(value):,}"
    return f"{value:.4g}"


def format_duration(seconds: float | None) -> str:
    """`seconds` as `1 h 02 min`, `3 min 05 s` or `12.3 s`."""
    if seconds is None:
        return ""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def _text(value: Any) -> str:
    return html.escape("" if value is None else str(value))


def _table(header: list[str], rows: Iterable[list[Any]], numeric_columns: Iterable[int] = ()) -> str:
    numeric = set(numeric_columns)
    head = "".join(f"<th>{_text(cell)}</th>" for cell in header)
    body = []
    for row in rows:
        cells = []
        for index, cell in enumerate(row):
            if index in numeric:
                cells.append(f'<td class="num">{_text(format_number(cell))}</td>')
            else:
                cells.append(f"<td>{cell if isinstance(cell, _Raw) else _text(cell)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


class _Raw(str):
    """HTML that a table cell takes as is (already escaped)."""


def _figure(svg: str) -> str:
    return f'<figure class="chart">{svg}</figure>'


def _preformatted(value: Any) -> _Raw:
    text = _as_text(value)
    if len(text) > _SAMPLE_TEXT_CHARS:
        text = text[:_SAMPLE_TEXT_CHARS] + " …"
    return _Raw(f"<pre>{_text(text)}</pre>")


def _as_text(value: Any) -> str:
    """A prompt or completion as plain text: conversations become `role: content` lines."""
    if isinstance(value, list) and all(isinstance(message, dict) for message in value):
        return "\n".join(f"{message.get('role', '?')}: {message.get('content', '')}" for message in value)
    return "" if value is None else str(value)


# ---------------------------------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------------------------------
def _overview(runs: list[RunHistory]) -> str:
    rows = []
    for run in runs:
        info = run.run
        speed = run.throughput()
        max_steps = info.get("max_steps")
        steps = f"{run.last_step:,}" + (f" / {max_steps:,}" if is_number(max_steps) and max_steps > 0 else "")
        last_epoch = next((row["epoch"] for row in reversed(run.logs) if is_number(row.get("epoch"))), None)
        rows.append(
            [
                run.name,
                info.get("trainer", ""),
                info.get("model", ""),
                run.status,
                steps,
                last_epoch,
                format_duration(run.wall_time_s()),
                speed.get("train_steps_per_second"),
                speed.get("train_samples_per_second"),
                speed.get("tokens_per_second"),
                run.last_value("loss"),
                run.last_value("eval_loss"),
                info.get("world_size", ""),
            ]
        )
    header = ["run", "trainer", "model", "status", "steps", "epoch", "wall time", "steps/s", "samples/s"]
    header += ["tokens/s", "final loss", "final eval loss", "processes"]
    section = "<h2>Overview</h2>" + _table(header, rows, numeric_columns=(5, 7, 8, 9, 10, 11))
    resumed = [run.name for run in runs if run.segments > 1]
    if resumed:
        section += f'<p class="note">Resumed from a checkpoint: {_text(", ".join(resumed))}.</p>'
    return section


def _curves(runs: list[RunHistory]) -> str:
    panels = select_panels(runs)
    section = "<h2>Curves</h2>"
    if not panels:
        return section + '<p class="note">No metric was logged yet.</p>'
    images = []
    for panel in panels:
        svg = render_panel(panel, runs)
        if svg is not None:
            images.append(_figure(svg))
    return section + '<div class="charts">' + "".join(images) + "</div>"


def _metrics_table(runs: list[RunHistory]) -> str:
    """Last, minimum and maximum of every metric; the charted ones first."""
    charted = charted_metrics(select_panels(runs))
    names: dict[str, None] = {}
    for run in runs:
        names.update(dict.fromkeys(run.metric_names()))
    ordered = [name for name in names if name in charted] + [name for name in names if name not in charted]
    rows = []
    for name in ordered:
        for run in runs:
            _, values = run.series(name)
            if not values:
                continue
            label = (
                name if len(runs) == 1 else _Raw(f"{_text(name)} <span class='subtitle'>({_text(run.name)})</span>")
            )
            rows.append([label, values[-1], min(values), max(values), len(values)])
    if not rows:
        return ""
    table = _table(["metric", "last", "min", "max", "logged"], rows, numeric_columns=(1, 2, 3, 4))
    return "<h2>All metrics</h2>" + table


def _length_stats_rows(lengths: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for column, stats in lengths.items():
        at_max = stats.get("at_max_length")
        rows.append(
            [
                column,
                stats.get("count"),
                stats.get("min"),
                stats.get("mean"),
                stats.get("p50"),
                stats.get("p90"),
                stats.get("p99"),
                stats.get("max"),
                "" if at_max is None else f"{at_max:,} (max_length {stats.get('max_length')})",
            ]
        )
    return rows


def _data_section(runs: list[RunHistory]) -> str:
    parts = []
    for run in runs:
        data = run.data or {}
        splits = {key: value for key, value in data.items() if isinstance(value, dict)}
        if not splits:
            continue
        if len(runs) > 1:
            parts.append(f"<h3>{_text(run.name)}</h3>")
        for split, summary in splits.items():
            facts = []
            if summary.get("raw_format"):
                facts.append(f"format <b>{_text(summary['raw_format'].replace('_', ' '))}</b>")
            if summary.get("conversational") is not None:
                facts.append("conversational" if summary["conversational"] else "plain text")
            if is_number(summary.get("raw_rows")):
                facts.append(f"{summary['raw_rows']:,} rows given")
            if is_number(summary.get("rows")):
                facts.append(f"{summary['rows']:,} rows after preparation")
            if summary.get("packed"):
                facts.append("sequences packed together")
            dropped = summary.get("dropped_rows")
            if is_number(dropped) and dropped > 0:
                facts.append(f"<b>{dropped:,} rows dropped</b> in preparation (filtered, e.g. empty or over-long)")
            truncated = summary.get("truncated_rows")
            if is_number(truncated) and truncated > 0:
                facts.append(f"<b>{truncated:,} rows truncated</b> to max_length")
            untrainable = summary.get("rows_without_trainable_token")
            if is_number(untrainable) and untrainable > 0:
                facts.append(f"<b>{untrainable:,} rows dropped</b> with no token left to train on")
            if summary.get("streaming"):
                facts.append("streamed (rows unknown)")
            if summary.get("columns"):
                facts.append("columns " + ", ".join(f"<code>{_text(c)}</code>" for c in summary["columns"]))
            parts.append(f"<h3>{_text(split)}</h3><p>{'; '.join(facts)}.</p>")
            lengths = summary.get("token_lengths") or {}
            if lengths:
                header = [
                    "tokens of",
                    "rows measured",
                    "min",
                    "mean",
                    "p50",
                    "p90",
                    "p99",
                    "max",
                    "rows at max_length",
                ]
                parts.append(_table(header, _length_stats_rows(lengths), numeric_columns=range(1, 8)))
                if any(stats.get("sampled") for stats in lengths.values()):
                    parts.append('<p class="subtitle">Lengths measured on an evenly spaced sample of the rows.</p>')
                for column, stats in lengths.items():
                    svg = render_histogram(
                        stats.get("hist_edges") or [], stats.get("hist_counts") or [], f"{split}: {column} per row"
                    )
                    if svg is not None:
                        parts.append(_figure(svg))
    if not parts:
        return ""
    return "<h2>Data</h2>" + "".join(parts)


def _samples_section(runs: list[RunHistory]) -> str:
    parts = []
    for run in runs:
        if not run.samples:
            continue
        if len(runs) > 1:
            parts.append(f"<h3>{_text(run.name)}</h3>")
        for row in run.samples[-_SAMPLE_STEPS_SHOWN:]:
            samples = row.get("samples") or []
            reward_names = [key for key in (samples[0] if samples else {}) if key not in ("prompt", "completion")]
            header = ["prompt", "completion", *reward_names]
            table_rows = [
                [_preformatted(s.get("prompt")), _preformatted(s.get("completion"))] + [s.get(k) for k in reward_names]
                for s in samples
            ]
            numeric = range(2, 2 + len(reward_names))
            parts.append(f"<h3>Step {_text(row.get('step'))}</h3>" + _table(header, table_rows, numeric))
    if not parts:
        return ""
    return "<h2>Sample completions</h2>" + "".join(parts)


def _checkpoints_section(runs: list[RunHistory]) -> str:
    rows = []
    for run in runs:
        for row in run.checkpoints:
            path = row.get("path", "")
            present = "yes" if path and os.path.isdir(path) else "no (removed, e.g. by save_total_limit)"
            rows.append([run.name, row.get("step"), path, present])
    if not rows:
        return "<h2>Checkpoints</h2><p>None written (save_strategy, or training ended before the first save).</p>"
    return "<h2>Checkpoints</h2>" + _table(["run", "step", "path", "still on disk"], rows, numeric_columns=(1,))


def _config_section(runs: list[RunHistory]) -> str:
    configs = [(run, run.run.get("config_changed") or {}, run.run.get("config") or {}) for run in runs]
    if not any(full for _, _, full in configs):
        return ""
    section = "<h2>Configuration</h2>"
    changed_names: dict[str, None] = {}
    for _, changed, _ in configs:
        changed_names.update(dict.fromkeys(changed))
    if changed_names:
        if len(runs) == 1:
            changed = configs[0][1]
            rows = [
                [name, _json_text(entry.get("value")), _json_text(entry.get("default"))]
                for name, entry in changed.items()
            ]
            section += "<h3>Fields that differ from the defaults</h3>" + _table(["field", "value", "default"], rows)
        else:
            header = ["field", *[run.name for run in runs]]
            differing, shared = [], []
            for name in sorted(changed_names):
                values = [_json_text(full.get(name, "")) for _, _, full in configs]
                if len(set(values)) > 1:
                    differing.append([_Raw(f"<b>{_text(name)}</b>"), *values])
                else:
                    shared.append([name, *values])
            section += (
                "<h3>Fields set in any run</h3><p class='subtitle'>Those whose value differs between the runs come "
                "first, in bold.</p>" + _table(header, differing + shared)
            )
    for run, _, full in configs:
        if full:
            rows = [[name, _json_text(value)] for name, value in full.items()]
            title = f"All {len(rows)} fields of {run.run.get('config_class', 'the config')}"
            if len(runs) > 1:
                title += f" ({run.name})"
            section += f"<details><summary>{_text(title)}</summary>{_table(['field', 'value'], rows)}</details>"
    return section


def _json_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return format_number(value)
    return str(value)


# ---------------------------------------------------------------------------------------------------------------------
# Page
# ---------------------------------------------------------------------------------------------------------------------
def build_page(runs: list[RunHistory]) -> str:
    """The whole HTML document for `runs` (one run, or several overlaid for comparison)."""
    if len(runs) == 1:
        run = runs[0]
        title = f"Training report: {run.name}"
        subtitle = " · ".join(str(part) for part in (run.run.get("trainer"), run.run.get("model"), run.status) if part)
    else:
        title = f"Training report: {len(runs)} runs compared"
        subtitle = ", ".join(run.name for run in runs)
    generated = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    versions = runs[0].run.get("versions") or {}
    version_text = ", ".join(f"{name} {version}" for name, version in versions.items())
    sections = [
        _overview(runs),
        _curves(runs),
        _metrics_table(runs),
        _data_section(runs),
        _samples_section(runs),
        _checkpoints_section(runs),
        _config_section(runs),
    ]
    sources = ", ".join(run.source for run in runs)
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<meta name='viewport' content='width=device-width, initial-scale=1'><title>{_text(title)}</title>"
        f"<style>{_STYLE}</style></head><body>"
        f"<h1>{_text(title)}</h1><p class='subtitle'>{_text(subtitle)}</p>"
        + "".join(sections)
        + f"<p class='subtitle'>Generated {_text(generated)} from {_text(sources)}"
        + (f" ({_text(version_text)})" if version_text else "")
        + ". Re-render with <code>trl report OUTPUT_DIR [OUTPUT_DIR ...]</code>.</p></body></html>\n"
    )
