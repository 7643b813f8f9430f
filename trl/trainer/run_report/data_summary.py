"""Cheap facts about the data a trainer was given and what preparation made of it, for the run report.

Everything here reads column names, row counts and, for tokenised columns, the lengths stored in the Arrow table
(offsets only, no Python lists), so it costs milliseconds even on large datasets. Anything that would need a pass
over the text (tokenising raw prompts) is left out.
"""

from __future__ import annotations

import math
from typing import Any


# Lengths are measured on at most this many rows (evenly spaced) of a dataset.
_MAX_MEASURED_ROWS = 50_000
_HISTOGRAM_BINS = 20


def _row_count(dataset: Any) -> int | None:
    from datasets import IterableDataset

    if dataset is None or isinstance(dataset, IterableDataset):
        return None
    try:
        return len(dataset)
    except TypeError:
        return None


def describe_given_dataset(dataset: Any) -> dict[str, Any]:
    """What the user passed as a training dataset, before the trainer prepares it: rows, format and whether it is
    conversational.

    Args:
        dataset: A `datasets.Dataset` or `IterableDataset` (other inputs give an empty summary).

    Returns:
        `dict`: `raw_rows` (None when streamed), `raw_format` (e.g. `"prompt_completion"`) and `conversational`.
    """
    from datasets import Dataset, IterableDataset

    from ..._data.formats import detect_dataset_format, get_dataset_column_names
    from ...data_utils import is_conversational

    if not isinstance(dataset, (Dataset, IterableDataset)):
        return {}
    summary: dict[str, Any] = {"raw_rows": _row_count(dataset)}
    try:
        summary["raw_format"] = detect_dataset_format(get_dataset_column_names(dataset))
    except ValueError:
        summary["raw_format"] = None
    if isinstance(dataset, Dataset) and len(dataset) > 0:
        try:
            summary["conversational"] = bool(is_conversational(dataset[0]))
        except (KeyError, TypeError, ValueError, IndexError):
            pass
    return summary


def _percentile(sorted_values: list[int], fraction: float) -> int:
    index = min(len(sorted_values) - 1, max(0, math.ceil(fraction * len(sorted_values)) - 1))
    return sorted_values[index]


def _histogram(sorted_values: list[int]) -> tuple[list[float], list[int]]:
    """At most 20 equal bins centred on whole token counts (one bin per count when the range is that small)."""
    low, high = sorted_values[0], sorted_values[-1]
    span = high - low + 1
    bins = min(_HISTOGRAM_BINS, span)
    width = span / bins
    edges = [low - 0.5 + i * width for i in range(bins + 1)]
    counts = [0] * bins
    for value in sorted_values:
        counts[min(bins - 1, int((value - low + 0.5) / width))] += 1
    return edges, counts


def length_statistics(lengths: list[int], max_length: int | None = None) -> dict[str, Any]:
    """Distribution of token counts: min, mean, p50/p90/p99, max, a 20-bin histogram, and with `max_length` how many
    rows reach it (cut by truncation, or exactly that long)."""
    values = sorted(int(length) for length in lengths)
    if not values:
        return {"count": 0}
    edges, counts = _histogram(values)
    stats: dict[str, Any] = {
        "count": len(values),
        "min": values[0],
        "mean": round(sum(values) / len(values), 1),
        "p50": _percentile(values, 0.5),
        "p90": _percentile(values, 0.9),
        "p99": _percentile(values, 0.99),
        "max": values[-1],
        "hist_edges": edges,
        "hist_counts": counts,
    }
    if max_length:
        stats["max_length"] = int(max_length)
        stats["at_max_length"] = sum(1 for value in values if value >= max_length)
    return stats


def _column_lengths(dataset: Any, column: str) -> tuple[list[int], bool]:
    """Lengths of the list column `column` (from the Arrow offsets), on an evenly spaced sample of a large dataset."""
    import pyarrow.compute as pc

    rows = len(dataset)
    sampled = rows > _MAX_MEASURED_ROWS
    if sampled:
        stride = rows / _MAX_MEASURED_ROWS
        dataset = dataset.select([int(i * stride) for i in range(_MAX_MEASURED_ROWS)])
    array = dataset.with_format("arrow")[column]
    return pc.list_value_length(array).to_pylist(), sampled


def describe_prepared_dataset(dataset: Any, max_length: int | None = None) -> dict[str, Any]:
    """What the trainer trains on after preparation: rows, columns and the token-length distribution of every
    tokenised column (`input_ids`, `prompt_input_ids`, `chosen_input_ids`, ...).

    Args:
        dataset: The trainer's prepared `train_dataset` / `eval_dataset`.
        max_length (`int` or `None`, defaults to `None`):
            The config's `max_length`; rows of `input_ids` reaching it are counted.
    """
    from datasets import Dataset, IterableDataset

    if isinstance(dataset, IterableDataset):
        return {"streaming": True, "columns": list(dataset.column_names or [])}
    summary: dict[str, Any] = {"rows": _row_count(dataset)}
    if not isinstance(dataset, Dataset):
        return summary
    summary["columns"] = list(dataset.column_names)
    token_lengths = {}
    for column in dataset.column_names:
        if not column.endswith("input_ids") or len(dataset) == 0:
            continue
        try:
            lengths, sampled = _column_lengths(dataset, column)
        except Exception:  # not a list column (e.g. a scalar id): nothing to measure
            continue
        lengths = [length for length in lengths if length is not None]
        stats = length_statistics(lengths, max_length if column == "input_ids" else None)
        stats["sampled"] = sampled
        token_lengths[column] = stats
    if token_lengths:
        summary["token_lengths"] = token_lengths
    return summary


# Prompts of online trainers are tokenised for the report on at most this many rows.
_PROMPT_ROWS_MEASURED = 256


def prompt_token_lengths(dataset: Any, processing_class: Any) -> dict[str, Any] | None:
    """Token counts of the `prompt` column as the online trainers render it (chat template for conversational
    prompts), on an evenly spaced sample of at most 256 rows; None when the data has no text prompts to measure."""
    from datasets import Dataset

    from ...data_utils import maybe_apply_chat_template

    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    if not isinstance(dataset, Dataset) or "prompt" not in dataset.column_names or len(dataset) == 0:
        return None
    if not callable(tokenizer):
        return None
    rows = len(dataset)
    measured = min(rows, _PROMPT_ROWS_MEASURED)
    indices = [int(i * rows / measured) for i in range(measured)]
    lengths = []
    for index in indices:
        text = maybe_apply_chat_template({"prompt": dataset[index]["prompt"]}, tokenizer)["prompt"]
        if not isinstance(text, str):
            return None
        lengths.append(len(tokenizer(text, add_special_tokens=False)["input_ids"]))
    stats = length_statistics(lengths)
    stats["sampled"] = len(indices) < rows
    return stats


def describe_trainer_data(trainer: Any) -> dict[str, Any]:
    """The `"data"` row of a run: a summary per split (`train`, and `eval` / `eval_<name>` when present)."""
    args = trainer.args
    max_length = getattr(args, "max_length", None)
    max_length = max_length if isinstance(max_length, int) and max_length > 0 else None
    splits: dict[str, Any] = {}
    # Exact counts a TRL trainer's data preparation recorded (a plain `Trainer` has none).
    counts = getattr(trainer, "_preparation_counts", None) or {}
    if trainer.train_dataset is not None:
        train = describe_prepared_dataset(trainer.train_dataset, max_length)
        train.update(getattr(trainer, "_given_train_data", None) or {})
        rows, raw_rows = train.get("rows"), train.get("raw_rows")
        if getattr(args, "packing", False):
            train["packed"] = True  # fewer rows by design: sequences were packed together, not dropped
        elif rows is not None and raw_rows is not None and raw_rows > rows:
            train["dropped_rows"] = raw_rows - rows
        if "token_lengths" not in train and getattr(trainer, "processing_class", None) is not None:
            try:  # online trainers keep raw prompts: measure a sample of them
                prompt_stats = prompt_token_lengths(trainer.train_dataset, trainer.processing_class)
            except Exception:  # a prompt the tokenizer cannot render (images, tools): leave the lengths out
                prompt_stats = None
            if prompt_stats is not None:
                train["token_lengths"] = {"prompt": prompt_stats}
        train.update(counts.get("train", {}))
        splits["train"] = {key: value for key, value in train.items() if value is not None}
    eval_dataset = trainer.eval_dataset
    if isinstance(eval_dataset, dict):
        for name, dataset in eval_dataset.items():
            splits[f"eval_{name}"] = {
                **describe_prepared_dataset(dataset, max_length),
                **counts.get(name, {}),
            }
    elif eval_dataset is not None:
        splits["eval"] = {
            **describe_prepared_dataset(eval_dataset, max_length),
            **counts.get("eval", {}),
        }
    return splits
