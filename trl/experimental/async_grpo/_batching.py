"""From the rollout queue to packed micro-batches: staleness filtering, batch planning and collation (rank 0).

Public names are re-exported by `async_grpo_trainer`, TRL's import path.
"""

from __future__ import annotations

import logging
import math
import queue
import re
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from .packing import TreeRow


logger = logging.getLogger(__name__)

# Keys reduced by sum / max / min over a logging window: the last path part holds the word.
_SUM_WORD = re.compile(r"(?:^|_)total(?:_|$)")
_MAX_WORD = re.compile(r"(?:^|_)max(?:_|$)")
_MIN_WORD = re.compile(r"(?:^|_)min(?:_|$)")

TRACE_EVERY_N_VERSIONS = 8
TRACES_PER_LOG = 8


def _reduce_metric(key: str, values: list[float | tuple[float, float]]) -> float:
    """One value for a metric over a logging window.

    `(numerator, denominator)` pairs give `sum(num) / sum(den)` (NaN for a zero denominator); otherwise the last
    path part of `key` decides: containing the word `total` → sum, `max` → max, `min` → min, anything else → mean.
    Python's `sum`/`max`/`min` semantics apply to NaN entries.
    """
    if isinstance(values[0], tuple):
        numerator = sum(pair[0] for pair in values)
        denominator = sum(pair[1] for pair in values)
        return numerator / denominator if denominator else float("nan")
    last = key.rsplit("/", 1)[-1]
    if _SUM_WORD.search(last):
        return sum(values)
    if _MAX_WORD.search(last):
        return max(values)
    if _MIN_WORD.search(last):
        return min(values)
    return sum(values) / len(values)


def log_rollout_traces(samples: list, step: int, report_to: list[str], max_traces: int = 16) -> None:
    """Log up to `max_traces` rollout samples (prompt, completion, advantage, version) as a trackio table.

    A no-op unless `"trackio"` is in `report_to` and trackio is installed.
    """
    from ...import_utils import is_trackio_available

    if not report_to or "trackio" not in report_to or not is_trackio_available() or not samples:
        return
    import trackio

    rows = [
        [step, str(sample.prompt), str(sample.completion), float(sample.advantage), int(sample.model_version)]
        for sample in samples[:max_traces]
    ]
    table = trackio.Table(columns=["step", "prompt", "completion", "advantage", "model_version"], data=rows)
    trackio.log({"rollout_traces": table}, step=step)


class RolloutQueueDataset(IterableDataset):
    """Rollout samples read from the worker's queue, stale ones dropped.

    A sample generated at policy version `v` is dropped (and counted in `sample/dropped_stale_total`) when the
    current version exceeds `v` by more than `max_staleness`. While the queue stays empty, `check_health_fn` is called
    every `poll_interval_s` seconds so a dead rollout worker stops training instead of blocking it.

    Args:
        rollout_queue: Queue of `RolloutSample`s (a `multiprocessing` or `queue` queue).
        model_version_fn: Returns the trainer's current policy version.
        check_health_fn: Called with `stale_after_s`; raises when the worker failed or stopped beating.
        stale_after_s: Heartbeat age after which the worker counts as dead.
        metrics: `defaultdict(list)` the queue metrics are appended to.
        max_staleness: Largest accepted version lag.
        poll_interval_s: Seconds of one blocking read.
        report_to: Trackers; with `"trackio"` a few sample traces are logged every 8 versions.
    """

    def __init__(
        self,
        rollout_queue,
        model_version_fn: Callable[[], int],
        check_health_fn: Callable[[float], None],
        stale_after_s: float,
        metrics: dict,
        max_staleness: int = 3,
        poll_interval_s: float = 5.0,
        report_to: list[str] | None = None,
    ):
        self.queue = rollout_queue
        self.model_version_fn = model_version_fn
        self.check_health_fn = check_health_fn
        self.stale_after_s = stale_after_s
        self.metrics = metrics
        self.max_staleness = max_staleness
        self.poll_interval_s = poll_interval_s
        self.report_to = report_to
        self._traces: list = []
        self._last_traced_version = -1

    # The sample attributes each yielded item carries (AsyncDistillation's samples carry teacher scores instead).
    _item_fields = ("input_ids", "completion_mask", "old_log_probs", "advantage", "group_id", "metrics")

    def _queue_size(self) -> float:
        try:
            return float(self.queue.qsize())
        except NotImplementedError:  # multiprocessing queues on macOS
            return float("nan")

    def _drain_traces(self, version: int) -> None:
        """Log the buffered traces once per multiple of `TRACE_EVERY_N_VERSIONS`."""
        if version % TRACE_EVERY_N_VERSIONS == 0 and version != self._last_traced_version and self._traces:
            log_rollout_traces(self._traces, version, self.report_to or [], max_traces=TRACES_PER_LOG)
            self._traces = []
            self._last_traced_version = version

    def __iter__(self) -> Iterator[dict]:
        while True:
            try:
                sample = self.queue.get(timeout=self.poll_interval_s)
            except queue.Empty:
                self.check_health_fn(self.stale_after_s)
                continue
            version = self.model_version_fn()
            staleness = version - sample.model_version
            if staleness > self.max_staleness:
                logger.info("dropping a stale sample (staleness %d > max_staleness %d)", staleness, self.max_staleness)
                self.metrics["sample/dropped_stale_total"].append(1.0)
                continue
            self.metrics["sample/rollout_queue_size"].append(self._queue_size())
            self.metrics["sample/staleness_mean"].append(float(staleness))
            self.metrics["sample/staleness_max"].append(float(staleness))
            if sample.enqueued_at is not None:
                self.metrics["sample/time_in_queue_s"].append(time.time() - sample.enqueued_at)
            if len(self._traces) < TRACES_PER_LOG:
                self._traces.append(sample)
            self._drain_traces(version)
            yield {name: getattr(sample, name) for name in self._item_fields}


class _EmptyIterableDataset(IterableDataset):
    """What the dataloader of a non-zero rank iterates: rank 0 dispatches every batch."""

    def __iter__(self) -> Iterator:
        return iter(())


class TokenBudgetBatcher(IterableDataset):
    """Micro-batches of `num_processes` packed rows, each holding at most `token_budget` forwarded tokens.

    Samples longer than the budget are dropped (`batch/dropped_oversize_total`). A sample goes to the least-loaded
    row that already holds its group and fits it; when its group has a row but none fits and every row is in use,
    the micro-batch is emitted (keeping a group together beats filling rows); otherwise to the least-loaded row that
    fits; when none fits the micro-batch is emitted and the sample starts the next one. No row is ever empty.
    """

    def __init__(self, dataset: Iterable[dict], num_processes: int, token_budget: int, metrics: dict):
        self.dataset = dataset
        self.num_processes = num_processes
        self.token_budget = token_budget
        self.metrics = metrics

    def _place(self, rows: list[TreeRow], sample: dict) -> TreeRow | None:
        """The row `sample` goes to, or None when the micro-batch must be emitted first."""
        group = sample["group_id"]
        fitting = [row for row in rows if row.fits(sample, self.token_budget)]
        home = [row for row in fitting if group in row.groups]
        if home:
            return min(home, key=lambda row: row.load)
        if any(group in row.groups for row in rows) and all(row.samples for row in rows):
            return None
        return min(fitting, key=lambda row: row.load) if fitting else None

    def __iter__(self) -> Iterator[list[TreeRow]]:
        rows = [TreeRow() for _ in range(self.num_processes)]
        for sample in self.dataset:
            if len(sample["input_ids"]) > self.token_budget:
                logger.warning(
                    "A rollout sample of %d tokens is longer than token_budget=%d and is skipped; raise token_budget "
                    "to train on such samples.",
                    len(sample["input_ids"]),
                    self.token_budget,
                )
                self.metrics["batch/dropped_oversize_total"].append(1.0)
                continue
            row = self._place(rows, sample)
            if row is None:
                yield rows
                rows = [TreeRow() for _ in range(self.num_processes)]
                row = rows[0]
            row.add(sample)


def _split_largest_group(groups: list[list[dict]]) -> list[list[dict]]:
    """Replace the (first) largest group by its two halves, the smaller first half, appended at the end."""
    largest = max(range(len(groups)), key=lambda index: len(groups[index]))
    group = groups[largest]
    half = len(group) // 2
    return [*groups[:largest], *groups[largest + 1 :], group[:half], group[half:]]


def _group_cost(samples: list[dict]) -> int:
    """Attention cost of a group packed alone (its trie `load`)."""
    row = TreeRow()
    for sample in samples:
        row.add(sample)
    return row.load


class FixedCountBatcher(IterableDataset):
    """Micro-batches of exactly `microbatch_size` samples spread over `num_processes` rows.

    Samples of a group stay together when possible: the buffered samples are grouped by `group_id`, the largest
    group is halved until there are at least `num_processes` groups, and groups go costliest-first to the
    least-loaded row (longest-processing-time scheduling).
    """

    def __init__(self, dataset: Iterable[dict], num_processes: int, microbatch_size: int):
        self.dataset = dataset
        self.num_processes = num_processes
        self.microbatch_size = microbatch_size

    def _plan(self, buffer: list[dict]) -> list[TreeRow]:
        by_group: dict[Any, list[dict]] = defaultdict(list)
        for sample in buffer:
            by_group[sample["group_id"]].append(sample)
        groups = list(by_group.values())
        while len(groups) < self.num_processes and max(map(len, groups)) > 1:
            groups = _split_largest_group(groups)
        rows = [TreeRow() for _ in range(self.num_processes)]
        for group in sorted(groups, key=_group_cost, reverse=True):
            row = min(rows, key=lambda row: row.load)
            for sample in group:
                row.add(sample)
        return rows

    def __iter__(self) -> Iterator[list[TreeRow]]:
        buffer: list[dict] = []
        for sample in self.dataset:
            buffer.append(sample)
            if len(buffer) == self.microbatch_size:
                yield self._plan(buffer)
                buffer = []


# Padding value of each packed key when rows are stacked.
_PAD_VALUES = {
    "position_ids": 0,
    "shift_labels": -100,
    "tree_kv_index": -1,
    "tree_cu_seqlens_q": -1,
    "tree_cu_seqlens_k": -1,
    "tree_max_seqlens": 0,
    "token_index": -1,
    "old_log_probs": 0,
    "advantages": 0,
    "segment_id": 0,
}


def log_sample_and_row_metrics(
    metrics: dict[str, list], samples: list[dict], row_tokens: list[int], row_loads: list[float]
) -> None:
    """The collator metrics shared by the asynchronous trainers: per-sample token counts, the masked-token share, the
    samples' own metrics (averaged), and the rows' sizes and imbalance (max / mean of `row_loads`)."""
    lengths = [len(sample["input_ids"]) for sample in samples]
    masked = [int(np.sum(sample["completion_mask"])) for sample in samples]
    total = sum(lengths)
    metrics["sample/forwarded_tokens_mean"].append(float(np.mean(lengths)))
    metrics["sample/forwarded_tokens_max"].append(float(max(lengths)))
    metrics["sample/trained_tokens_mean"].append(float(np.mean(masked)))
    metrics["batch/masked_token_frac"].append((total - sum(masked), total))
    per_sample: dict[str, list[float]] = defaultdict(list)
    for sample in samples:
        for key, value in (sample.get("metrics") or {}).items():
            per_sample[key].append(value)
    for key, values in per_sample.items():
        metrics[key].append(sum(values) / len(values))
    metrics["batch/samples_per_row"].append(len(samples) / len(row_tokens))
    metrics["batch/row_tokens_mean"].append(float(np.mean(row_tokens)))
    metrics["batch/row_tokens_max"].append(float(max(row_tokens)))
    mean_load = float(np.mean(row_loads))
    metrics["batch/row_imbalance"].append(max(row_loads) / mean_load if mean_load else math.nan)


def _stack_padded(tensors: list[torch.Tensor], value: float) -> torch.Tensor:
    length = max(tensor.numel() for tensor in tensors)
    out = torch.full((len(tensors), length), value, dtype=tensors[0].dtype)
    for index, tensor in enumerate(tensors):
        out[index, : tensor.numel()] = tensor
    return out


@dataclass
class DataCollatorForRollout:
    """Collates one planned micro-batch (a list of [`TreeRow`]s, dataloader batch size 1) into padded tensors.

    Rows are packed and right-padded to the longest row; `attention_mask` marks real tokens. The scalars
    `global_n_tokens` (trained tokens of the micro-batch), `global_n_forward_tokens` and `mean_seq_len` are repeated
    once per process so that every rank receives its copy. The trained group ids are added to `groups_trained` and
    the batch metrics appended to `metrics`.

    Args:
        pad_token_id: Id used to pad `input_ids`.
        num_processes: Number of training processes (rows per micro-batch).
        return_tensors: Only `"pt"`.
        groups_trained: Set the group ids of collated samples are added to.
        metrics: `defaultdict(list)` of batch metrics.
        token_budget: The planner's token budget (`> 0` adds `batch/row_fill_frac`).
    """

    pad_token_id: int
    num_processes: int = 1
    return_tensors: str = "pt"
    groups_trained: set[int] = field(default_factory=set)
    metrics: dict[str, list] = field(default_factory=lambda: defaultdict(list))
    token_budget: int = 0

    def __call__(self, examples: list[list[TreeRow]]) -> dict[str, torch.Tensor]:
        return self.torch_call(examples)

    def torch_call(self, examples: list[list[TreeRow]]) -> dict[str, torch.Tensor]:
        rows = [row for micro_batch in examples for row in micro_batch]
        packed = [row.pack() for row in rows]
        batch = {"input_ids": _stack_padded([p["input_ids"] for p in packed], self.pad_token_id)}
        for key, value in _PAD_VALUES.items():
            batch[key] = _stack_padded([p[key] for p in packed], value)
        batch["attention_mask"] = _stack_padded([torch.ones_like(p["input_ids"]) for p in packed], 0)
        trained = sum(p["token_index"].numel() for p in packed)
        forwarded = sum(p["input_ids"].numel() for p in packed)
        samples = [sample for row in rows for sample in row.samples]
        repeat = (self.num_processes,)
        batch["global_n_tokens"] = torch.full(repeat, float(trained), dtype=torch.float32)
        batch["global_n_forward_tokens"] = torch.full(repeat, float(forwarded), dtype=torch.float32)
        batch["mean_seq_len"] = torch.full(repeat, forwarded / max(len(samples), 1), dtype=torch.float32)
        for sample in samples:
            self.groups_trained.add(int(sample["group_id"]))
        self._log_metrics(rows, packed, samples, batch["input_ids"].shape[1])
        return batch

    def _log_metrics(self, rows: list[TreeRow], packed: list[dict], samples: list[dict], padded_len: int) -> None:
        row_tokens = [p["input_ids"].numel() for p in packed]
        log_sample_and_row_metrics(self.metrics, samples, row_tokens, [row.load for row in rows])
        total, forwarded = sum(len(sample["input_ids"]) for sample in samples), sum(row_tokens)
        self.metrics["batch/packing_ratio"].append((total, forwarded))
        if self.token_budget > 0:
            self.metrics["batch/row_fill_frac"].append((forwarded, self.token_budget * len(rows)))
        self.metrics["batch/pad_frac"].append((padded_len * len(rows) - forwarded, padded_len * len(rows)))
