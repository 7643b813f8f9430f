"""Building blocks shared by the trainers: tensor helpers, memory-efficient log-probabilities, samplers, model loading,
PEFT wrapping, logging helpers and model cards."""

import functools
import hashlib
import importlib.metadata
import inspect
import math
import os
import random
import socket
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn as nn
from accelerate import PartialState
from accelerate.utils import DistributedType
from torch.utils.data import Sampler
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

from ..import_utils import (
    is_comet_available,
    is_peft_available,
    is_rich_available,
    is_trackio_available,
)


# Working-set budget (bytes of float32) for one chunk of rows in the chunked log-softmax helpers. Bounds the extra
# memory to a few times this value whatever the batch size or sequence length.
_CHUNK_BYTES = 32 * 1024 * 1024

_DTYPE_NAMES = ("auto", "bfloat16", "float16", "float32")


# ---------------------------------------------------------------------------------------------------------------------
# Padding and alignment
# ---------------------------------------------------------------------------------------------------------------------


def pad(
    tensors: list[torch.Tensor],
    padding_value: int = 0,
    padding_side: str = "right",
    pad_to_multiple_of: int | None = None,
) -> torch.Tensor:
    """Stack tensors of different shapes into one tensor, padding every dimension to the largest size.

    Args:
        tensors: Tensors with the same number of dimensions (sizes may differ per dimension).
        padding_value: Value written into the padded positions.
        padding_side: `"right"` puts the data at the start of each dimension, `"left"` at the end.
        pad_to_multiple_of: If set, the first dimension of the stacked items is rounded up to a multiple of it.

    Returns:
        Tensor of shape `(len(tensors), *max_shape)` with the dtype and device of the first tensor.

    Example:
        >>> pad([torch.tensor([1, 2, 3]), torch.tensor([4, 5])], padding_side="left")
        tensor([[1, 2, 3],
                [0, 4, 5]])
    """
    if len(tensors) == 0:
        raise ValueError("`pad` expected a non-empty list of tensors, got an empty list.")
    ndim = tensors[0].dim()
    if any(t.dim() != ndim for t in tensors):
        found = sorted({t.dim() for t in tensors})
        raise ValueError(
            f"`pad` expected tensors with the same number of dimensions, found dimensions {found}. Reshape them so "
            "they all have the same rank."
        )
    if padding_side not in ("left", "right"):
        raise ValueError(f"`padding_side` must be 'left' or 'right', got {padding_side!r}.")
    output_shape = [max(t.shape[d] for t in tensors) for d in range(ndim)]
    if pad_to_multiple_of is not None and ndim > 0:
        output_shape[0] = math.ceil(output_shape[0] / pad_to_multiple_of) * pad_to_multiple_of

    output = torch.full((len(tensors), *output_shape), padding_value, dtype=tensors[0].dtype, device=tensors[0].device)
    for i, tensor in enumerate(tensors):
        if padding_side == "left":
            region = tuple(slice(size - n, size) for size, n in zip(output_shape, tensor.shape))
        else:
            region = tuple(slice(0, n) for n in tensor.shape)
        output[i][region] = tensor
    return output


def _gather_rows(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Gather along dim 1 with a `(B, L)` index, broadcasting it over any trailing dimensions of `tensor`."""
    expanded = index.reshape(*index.shape, *([1] * (tensor.dim() - 2))).expand(*index.shape, *tensor.shape[2:])
    return tensor.gather(1, expanded)


def flush_left(mask: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Shift every row left so it starts at its first non-zero mask entry, then drop trailing all-zero columns.

    Args:
        mask: 2D mask of shape `(batch, length)`.
        *tensors: Tensors of shape `(batch, length, ...)` shifted with the same per-row offsets.

    Returns:
        The shifted mask alone when no other tensor is given, otherwise a tuple `(mask, *tensors)`.

    Example:
        >>> flush_left(torch.tensor([[0, 1, 1, 0], [0, 0, 1, 0]]))
        tensor([[1, 1],
                [1, 0]])
    """
    if mask.dim() != 2:
        raise ValueError(f"`flush_left` expected a 2D mask of shape (batch, length), got shape {tuple(mask.shape)}.")
    _, length = mask.shape
    first_one = (mask != 0).int().argmax(dim=1)
    positions = torch.arange(length, device=mask.device)
    index = (positions.unsqueeze(0) + first_one.unsqueeze(1)) % length
    new_mask = mask.gather(1, index)
    new_tensors = [_gather_rows(t, index) for t in tensors]

    used = (new_mask != 0).any(dim=0).nonzero()
    keep = int(used.max()) + 1 if used.numel() > 0 else 0
    new_mask = new_mask[:, :keep]
    new_tensors = [t[:, :keep] for t in new_tensors]
    if not new_tensors:
        return new_mask
    return (new_mask, *new_tensors)


def flush_right(mask: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Shift every row right so it ends at its last non-zero mask entry, then drop leading all-zero columns.

    Args:
        mask: 2D mask of shape `(batch, length)`.
        *tensors: Tensors of shape `(batch, length, ...)` shifted with the same per-row offsets.

    Returns:
        The shifted mask alone when no other tensor is given, otherwise a tuple `(mask, *tensors)`.

    Example:
        >>> flush_right(torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0]]))
        tensor([[1, 1],
                [0, 1]])
    """
    if mask.dim() != 2:
        raise ValueError(f"`flush_right` expected a 2D mask of shape (batch, length), got shape {tuple(mask.shape)}.")
    _, length = mask.shape
    last_one = length - 1 - (mask != 0).int().flip(dims=[1]).argmax(dim=1)
    shift = length - 1 - last_one
    positions = torch.arange(length, device=mask.device)
    index = (positions.unsqueeze(0) - shift.unsqueeze(1)) % length
    new_mask = mask.gather(1, index)
    new_tensors = [_gather_rows(t, index) for t in tensors]

    used = (new_mask != 0).any(dim=0).nonzero()
    start = int(used.min()) if used.numel() > 0 else length
    new_mask = new_mask[:, start:]
    new_tensors = [t[:, start:] for t in new_tensors]
    if not new_tensors:
        return new_mask
    return (new_mask, *new_tensors)


# ---------------------------------------------------------------------------------------------------------------------
# Chunked log-softmax statistics
# ---------------------------------------------------------------------------------------------------------------------


def _iter_row_chunks(lead_shape: Sequence[int], max_rows: int) -> Iterator[tuple]:
    """Yield basic-indexing keys that cover the rows of a `(*lead_shape, V)` tensor in blocks of at most `max_rows`.

    Only slices and integers are used, so indexing with a key returns a view: no copy of the full tensor is made even
    when it is not contiguous (for instance `logits[:, :-1]`).
    """
    if len(lead_shape) == 0:
        yield ()
        return
    inner = math.prod(lead_shape[1:])
    if inner <= max_rows:
        step = max(1, max_rows // max(inner, 1))
        for start in range(0, lead_shape[0], step):
            yield (slice(start, min(start + step, lead_shape[0])),)
    else:
        for i in range(lead_shape[0]):
            for sub in _iter_row_chunks(lead_shape[1:], max_rows):
                yield (i, *sub)


def _chunk_selection(row_mask: torch.Tensor | None, key: tuple) -> tuple[bool, torch.Tensor | None]:
    """Return `(skip, sub_mask)` for a chunk: skip chunks without selected rows; `None` means every row is selected."""
    if row_mask is None:
        return False, None
    sub_mask = row_mask[key]
    if not bool(sub_mask.any()):
        return True, None
    if bool(sub_mask.all()):
        return False, None
    return False, sub_mask


def _read(tensor: torch.Tensor, key: tuple, sub_mask: torch.Tensor | None) -> torch.Tensor:
    view = tensor[key]
    return view if sub_mask is None else view[sub_mask]


def _write(tensor: torch.Tensor, key: tuple, sub_mask: torch.Tensor | None, value: torch.Tensor) -> None:
    if sub_mask is None:
        tensor[key] = value
    else:
        tensor[key][sub_mask] = value


def _chunk_log_probs(
    logits: torch.Tensor,
    key: tuple,
    sub_mask: torch.Tensor | None,
    compute_dtype: torch.dtype,
    temperature: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-softmax of one chunk of `logits / temperature`, computed in `compute_dtype` (written into `out` if given).

    `log_softmax` is a single fused pass, faster than `logsumexp` followed by a subtraction, and converts bf16/fp16
    inputs on the fly through its `dtype` argument.
    """
    chunk = _read(logits, key, sub_mask)
    if temperature != 1.0:
        scaled = chunk.to(compute_dtype)
        chunk = scaled.div_(temperature) if scaled is not chunk or sub_mask is not None else scaled / temperature
    return torch.log_softmax(chunk, dim=-1, dtype=compute_dtype, out=out)


class _LogSoftmaxStats(torch.autograd.Function):
    """Log-probability of the selected token and/or entropy of softmax(logits / T), computed chunk by chunk.

    The forward keeps only one row-chunk of work tensors (in float32, or float64 for float64 logits) alive at a time
    and saves only the inputs and the per-row entropy. The backward recomputes the log-softmax chunk by chunk, works
    in place, and writes the gradient straight into a tensor shaped like `logits`, so no full-vocabulary float32
    tensor of the whole batch exists in either direction.
    """

    @staticmethod
    def forward(ctx, logits, index, row_mask, temperature, max_rows, want_logps, want_entropy):
        lead_shape = logits.shape[:-1]
        compute_dtype = torch.promote_types(logits.dtype, torch.float32)
        logps = torch.zeros(lead_shape, dtype=compute_dtype, device=logits.device)
        entropy = torch.zeros(lead_shape, dtype=compute_dtype, device=logits.device)

        for key in _iter_row_chunks(lead_shape, max_rows):
            skip, sub_mask = _chunk_selection(row_mask, key)
            if skip:
                continue
            log_probs = _chunk_log_probs(logits, key, sub_mask, compute_dtype, temperature)
            if want_logps:
                idx = _read(index, key, sub_mask).unsqueeze(-1)
                _write(logps, key, sub_mask, log_probs.gather(-1, idx).squeeze(-1))
            if want_entropy:
                probs = log_probs.exp()
                # 0 * (-inf) is NaN for masked-out vocabulary entries; their contribution is exactly 0.
                vanishing = probs == 0
                weighted = probs.mul_(log_probs).masked_fill_(vanishing, 0.0)
                _write(entropy, key, sub_mask, weighted.sum(dim=-1).neg_())
                del probs, weighted, vanishing
            del log_probs

        if not want_logps:
            ctx.mark_non_differentiable(logps)
        if not want_entropy:
            ctx.mark_non_differentiable(entropy)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, index, row_mask, entropy)
        ctx.temperature = temperature
        ctx.max_rows = max_rows
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy):
        if grad_logps is None and grad_entropy is None:
            return (None,) * 7
        logits, index, row_mask, entropy = ctx.saved_tensors
        temperature = ctx.temperature
        compute_dtype = entropy.dtype
        # Without a row mask every row is written below, so the buffer needs no zero-filling.
        grad_logits = torch.empty_like(logits) if row_mask is None else torch.zeros_like(logits)
        in_place = row_mask is None and logits.dtype == compute_dtype

        for key in _iter_row_chunks(logits.shape[:-1], ctx.max_rows):
            skip, sub_mask = _chunk_selection(row_mask, key)
            if skip:
                continue
            # Same dtype and no mask: work directly in the gradient's memory (no temporary, no final copy).
            out = grad_logits[key] if in_place else None
            log_probs = _chunk_log_probs(logits, key, sub_mask, compute_dtype, temperature, out=out)
            g_lp = None if grad_logps is None else _read(grad_logps, key, sub_mask).to(compute_dtype).unsqueeze(-1)
            if grad_entropy is None:
                # d log p_y / d z_j = 1[j == y] - p_j
                grad = log_probs.exp_().mul_(-g_lp)
            else:
                # dH / d z_j = -p_j * (log p_j + H)
                g_h = _read(grad_entropy, key, sub_mask).to(compute_dtype).unsqueeze(-1)
                h = _read(entropy, key, sub_mask).unsqueeze(-1)
                probs = log_probs.exp()
                vanishing = probs == 0
                grad = log_probs.add_(h).mul_(probs).masked_fill_(vanishing, 0.0).mul_(-g_h)
                if g_lp is not None:
                    grad.sub_(probs.mul_(g_lp))
                del probs, vanishing
            if g_lp is not None:
                idx = _read(index, key, sub_mask).unsqueeze(-1)
                grad.scatter_add_(-1, idx, g_lp)
            if temperature != 1.0:
                grad.div_(temperature)
            if not in_place:
                _write(grad_logits, key, sub_mask, grad.to(grad_logits.dtype))
            del log_probs, grad

        return grad_logits, None, None, None, None, None, None


def _rows_per_chunk(vocab_size: int) -> int:
    return max(1, _CHUNK_BYTES // (max(vocab_size, 1) * 4))


def _prepare_row_mask(row_mask: torch.Tensor | None, lead_shape: torch.Size) -> torch.Tensor | None:
    """Validate `row_mask` and broadcast a prefix-shaped mask (e.g. one flag per sequence) to the row shape."""
    if row_mask is None:
        return None
    row_mask = row_mask.to(torch.bool)
    if tuple(row_mask.shape) == tuple(lead_shape):
        return row_mask
    if tuple(row_mask.shape) == tuple(lead_shape[: row_mask.dim()]):
        extra = len(lead_shape) - row_mask.dim()
        return row_mask.reshape(*row_mask.shape, *([1] * extra)).expand(lead_shape)
    raise ValueError(
        f"`row_mask` must have the shape of `index` {tuple(lead_shape)} or a leading part of it (for example one "
        f"flag per sequence), got shape {tuple(row_mask.shape)}."
    )


def _log_softmax_stats(
    logits: torch.Tensor,
    index: torch.Tensor | None,
    temperature: float,
    row_mask: torch.Tensor | None,
    max_rows: int | None,
    want_logps: bool,
    want_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    if logits.dim() < 1:
        raise ValueError("`logits` must have at least one dimension (the vocabulary).")
    lead_shape = logits.shape[:-1]
    if index is not None:
        if tuple(index.shape) != tuple(lead_shape):
            raise ValueError(
                f"`index` must have the shape of `logits` without its last dimension, {tuple(lead_shape)}, got "
                f"{tuple(index.shape)}."
            )
        index = index.to(torch.long)
    else:
        index = torch.zeros(lead_shape, dtype=torch.long, device=logits.device)
    if temperature <= 0:
        raise ValueError(f"`temperature` must be > 0, got {temperature}.")
    row_mask = _prepare_row_mask(row_mask, lead_shape)
    if max_rows is None:
        max_rows = _rows_per_chunk(logits.shape[-1])
    logps, entropy = _LogSoftmaxStats.apply(
        logits, index, row_mask, float(temperature), int(max_rows), want_logps, want_entropy
    )
    return logps.to(logits.dtype), entropy.to(logits.dtype)


def selective_log_softmax(
    logits: torch.Tensor,
    index: torch.Tensor,
    temperature: float = 1.0,
    row_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-probability of the `index` tokens under `softmax(logits / temperature)`, without a full log-softmax.

    Equivalent to `torch.log_softmax(logits / temperature, -1).gather(-1, index.unsqueeze(-1)).squeeze(-1)`, but the
    log-softmax is computed one chunk of rows at a time (in float32, or float64 for float64 logits), so memory
    beyond the inputs stays bounded by a few chunk-sized buffers. Gradients are supported through a custom backward
    that also works chunk by chunk.

    Args:
        logits: Tensor of shape `(..., vocab_size)`; float32, float64, bfloat16 or float16.
        index: Integer tensor of shape `(...)` with the token ids to score.
        temperature: Logits are divided by this value before the softmax.
        row_mask: Optional boolean tensor with the shape of `index` (or a leading part of it, e.g. `(batch,)`). Rows
            where it is False are skipped entirely and get 0.

    Returns:
        Tensor with the shape of `index` and the dtype of `logits`.
    """
    logps, _ = _log_softmax_stats(logits, index, temperature, row_mask, None, want_logps=True, want_entropy=False)
    return logps


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 128) -> torch.Tensor:
    """Entropy of the softmax distribution at every position, computed `chunk_size` rows at a time.

    Args:
        logits: Tensor of shape `(..., vocab_size)`.
        chunk_size: Number of rows (positions) processed together; bounds the temporary memory.

    Returns:
        Tensor of shape `(...)` with the dtype of `logits`.
    """
    if chunk_size < 1:
        raise ValueError(f"`chunk_size` must be a positive integer, got {chunk_size}.")
    _, entropy = _log_softmax_stats(logits, None, 1.0, None, chunk_size, want_logps=False, want_entropy=True)
    return entropy


def selective_log_softmax_and_entropy(
    logits: torch.Tensor,
    index: torch.Tensor,
    temperature: float = 1.0,
    row_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Selected-token log-probabilities and per-position entropies of `softmax(logits / temperature)` in one pass.

    Both come from the same per-chunk log-softmax, so it costs about one chunked pass over the logits.

    Args:
        logits: Tensor of shape `(..., vocab_size)`.
        index: Integer tensor of shape `(...)` with the token ids to score.
        temperature: Logits are divided by this value before the softmax.
        row_mask: Optional boolean mask with the shape of `index` (or a leading part of it); skipped rows get 0.

    Returns:
        `(log_probs, entropy)`, both with the shape of `index` and the dtype of `logits`.
    """
    return _log_softmax_stats(logits, index, temperature, row_mask, None, want_logps=True, want_entropy=True)


# ---------------------------------------------------------------------------------------------------------------------
# NaN-aware reductions
# ---------------------------------------------------------------------------------------------------------------------


def nanstd(tensor: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Unbiased standard deviation that ignores NaN entries.

    Args:
        tensor: Input tensor.
        dim: Dimension to reduce; `None` reduces over every element.
        keepdim: Keep the reduced dimension with size 1.

    Returns:
        The standard deviation (NaN where fewer than two values are present).
    """
    valid = ~torch.isnan(tensor)
    if dim is None:
        mean = torch.nanmean(tensor)
        count = valid.sum()
        squared = torch.nanmean((tensor - mean) ** 2)
        if keepdim:
            shape = [1] * tensor.dim()
            count, squared = count.reshape(shape), squared.reshape(shape)
    else:
        mean = torch.nanmean(tensor, dim=dim, keepdim=True)
        count = valid.sum(dim=dim, keepdim=keepdim)
        squared = torch.nanmean((tensor - mean) ** 2, dim=dim, keepdim=keepdim)
    variance = squared * count / (count - 1)
    return torch.sqrt(variance)


def nanmin(tensor: torch.Tensor) -> torch.Tensor:
    """Smallest non-NaN value of `tensor` (NaN when every entry is NaN)."""
    valid = tensor[~torch.isnan(tensor)]
    if valid.numel() == 0:
        return torch.tensor(float("nan"), dtype=tensor.dtype, device=tensor.device)
    return valid.min()


def nanmax(tensor: torch.Tensor) -> torch.Tensor:
    """Largest non-NaN value of `tensor` (NaN when every entry is NaN)."""
    valid = tensor[~torch.isnan(tensor)]
    if valid.numel() == 0:
        return torch.tensor(float("nan"), dtype=tensor.dtype, device=tensor.device)
    return valid.max()


# ---------------------------------------------------------------------------------------------------------------------
# Sampling and batch splitting
# ---------------------------------------------------------------------------------------------------------------------


class RepeatSampler(Sampler):
    """Sampler that repeats every index and every batch, as needed to build groups of completions (GRPO).

    Indices are (optionally) shuffled, cut into batches of `batch_size` unique indices (an incomplete last batch is
    dropped), then each batch is emitted `repeat_count` times, and inside it every index `mini_repeat_count` times in
    a row.

    Args:
        data_source: Sized collection being sampled.
        mini_repeat_count: Consecutive repetitions of each index.
        batch_size: Number of unique indices per batch.
        repeat_count: Number of times each batch is repeated.
        shuffle: Shuffle the indices once per iteration.
        seed: Seed of the shuffling generator, for reproducible orders.

    Example:
        >>> list(RepeatSampler(["a", "b", "c", "d", "e"], mini_repeat_count=2, batch_size=2, repeat_count=2, shuffle=False))
        [0, 0, 1, 1, 0, 0, 1, 1, 2, 2, 3, 3, 2, 2, 3, 3]
    """

    def __init__(
        self,
        data_source: Any,
        mini_repeat_count: int,
        batch_size: int = 1,
        repeat_count: int = 1,
        shuffle: bool = True,
        seed: int | None = None,
    ):
        self.data_source = data_source
        self.mini_repeat_count = mini_repeat_count
        self.batch_size = batch_size
        self.repeat_count = repeat_count
        self.num_samples = len(data_source)
        self.shuffle = shuffle
        self.seed = seed
        if shuffle:
            self.generator = torch.Generator()
            if seed is not None:
                self.generator.manual_seed(seed)

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            order = torch.randperm(self.num_samples, generator=self.generator).tolist()
        else:
            order = list(range(self.num_samples))
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        batches = [b for b in batches if len(b) == self.batch_size]
        for batch in batches:
            for _ in range(self.repeat_count):
                for index in batch:
                    for _ in range(self.mini_repeat_count):
                        yield index

    def __len__(self) -> int:
        full = (self.num_samples // self.batch_size) * self.batch_size
        return full * self.mini_repeat_count * self.repeat_count


def repeat_iterable_dataset(
    dataset: Iterable[dict],
    mini_repeat_count: int,
    batch_size: int = 1,
    repeat_count: int = 1,
):
    """Streaming counterpart of [`RepeatSampler`] for iterable datasets.

    Examples are read `batch_size` at a time (an incomplete last batch is dropped); each batch is emitted
    `repeat_count` times and inside it every example `mini_repeat_count` times in a row.

    Args:
        dataset: Iterable of examples, typically a `datasets.IterableDataset`.
        mini_repeat_count: Consecutive repetitions of each example.
        batch_size: Number of unique examples per batch.
        repeat_count: Number of times each batch is repeated.

    Returns:
        A `datasets.IterableDataset` yielding the repeated examples.
    """
    from datasets import IterableDataset

    def generate():
        batch = []
        for example in dataset:
            batch.append(example)
            if len(batch) == batch_size:
                for _ in range(repeat_count):
                    for item in batch:
                        for _ in range(mini_repeat_count):
                            yield item
                batch = []

    features = getattr(dataset, "features", None)
    return IterableDataset.from_generator(generate, features=features)


def _batch_length(values: Iterable[Any]) -> int:
    for value in values:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
        if isinstance(value, (list, tuple)):
            return len(value)
    raise ValueError("Expected at least one tensor (with a batch dimension) or list in the dictionary, found none.")


def split_tensor_dict(tensor_dict: dict[str, Any], num_chunks: int) -> list[dict[str, Any]]:
    """Split every tensor/list in a dictionary into `num_chunks` equal parts along the first dimension.

    `None` values and 0-d tensors are copied unchanged into every chunk.

    Args:
        tensor_dict: Mapping of names to tensors of shape `(batch, ...)`, lists of length `batch`, `None` or scalars.
        num_chunks: Number of chunks; `batch // num_chunks` items go into each.

    Returns:
        List of `num_chunks` dictionaries with the same keys.
    """
    chunk_size = _batch_length(tensor_dict.values()) // num_chunks
    chunks = []
    for i in range(num_chunks):
        chunk = {}
        for key, value in tensor_dict.items():
            if value is None or (isinstance(value, torch.Tensor) and value.dim() == 0):
                chunk[key] = value
            elif isinstance(value, (torch.Tensor, list, tuple)):
                chunk[key] = value[i * chunk_size : (i + 1) * chunk_size]
            else:
                chunk[key] = value
        chunks.append(chunk)
    return chunks


def shuffle_sequence_dict(seq_dict: dict[str, Any]) -> dict[str, Any]:
    """Shuffle every tensor/list of a dictionary along the first dimension with one shared random permutation.

    `None` values and 0-d tensors are kept as they are.

    Args:
        seq_dict: Mapping of names to tensors of shape `(batch, ...)`, lists of length `batch`, `None` or scalars.

    Returns:
        New dictionary with permuted entries.
    """
    permutation = torch.randperm(_batch_length(seq_dict.values()))
    order = permutation.tolist()
    shuffled = {}
    for key, value in seq_dict.items():
        if value is None or (isinstance(value, torch.Tensor) and value.dim() == 0):
            shuffled[key] = value
        elif isinstance(value, torch.Tensor):
            shuffled[key] = value[permutation.to(value.device)]
        elif isinstance(value, (list, tuple)):
            shuffled[key] = type(value)(value[i] for i in order)
        else:
            shuffled[key] = value
    return shuffled


# ---------------------------------------------------------------------------------------------------------------------
# Console output
# ---------------------------------------------------------------------------------------------------------------------


def _render_messages(value: Any):
    """Turn a prompt/completion (string or list of chat messages) into rich text."""
    from rich.text import Text

    if isinstance(value, str):
        return Text(value)
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        text = Text()
        for i, message in enumerate(value):
            if i > 0:
                text.append("\n")
            text.append(f"{message.get('role', '?')}: ", style="bold")
            content = message.get("content", "")
            if isinstance(content, list):  # multimodal content blocks
                parts = []
                for block in content:
                    if isinstance(block, dict) and block.get("type") == "text":
                        parts.append(block.get("text", ""))
                    elif isinstance(block, dict):
                        parts.append(f"<{block.get('type', 'block')}>")
                content = " ".join(parts)
            text.append(str(content) if content is not None else "")
            if message.get("tool_calls"):
                text.append(f"\n[tool calls] {message['tool_calls']}", style="italic")
        return text
    return Text(str(value))


def print_prompt_completions_sample(
    prompts: list,
    completions: list,
    rewards: dict[str, list[float]],
    advantages: list[float],
    step: int,
    num_samples: int | None = None,
    extra: dict[str, list] | None = None,
) -> None:
    """Print a table of prompts, completions, per-function rewards and advantages to the console with rich.

    Args:
        prompts: Prompts (strings or lists of chat messages).
        completions: Completions, aligned with `prompts`.
        rewards: Mapping of reward-function name to one reward per completion.
        advantages: One advantage per completion.
        step: Training step shown in the title.
        num_samples: If set (and smaller than the number of rows), print this many randomly chosen rows.
        extra: Optional extra columns, name -> one value per completion.
    """
    if not is_rich_available():
        raise ImportError("`print_prompt_completions_sample` needs `rich`; install it with `pip install rich`.")
    from rich.console import Console
    from rich.panel import Panel
    from rich.table import Table

    console = Console()
    table = Table(show_header=True, header_style="bold white", expand=True, show_lines=True)
    table.add_column("Prompt", style="bright_yellow")
    table.add_column("Completion", style="bright_green")
    for name in rewards:
        table.add_column(name, style="bold cyan", justify="right")
    table.add_column("Advantage", style="bold magenta", justify="right")
    extra = extra or {}
    for name in extra:
        table.add_column(name, justify="right")

    rows = list(range(len(prompts)))
    if num_samples is not None and num_samples < len(rows):
        rows = sorted(random.sample(rows, max(num_samples, 0)))

    def fmt(value: Any) -> str:
        if isinstance(value, torch.Tensor):
            value = value.item()
        return f"{value:.2f}" if isinstance(value, float) else str(value)

    for i in rows:
        cells = [_render_messages(prompts[i]), _render_messages(completions[i])]
        cells += [fmt(values[i]) for values in rewards.values()]
        cells.append(fmt(advantages[i]))
        cells += [fmt(values[i]) for values in extra.values()]
        table.add_row(*cells)
    console.print(Panel(table, expand=False, title=f"Step {step}", border_style="bold white"))


# ---------------------------------------------------------------------------------------------------------------------
# Model and environment helpers
# ---------------------------------------------------------------------------------------------------------------------


def disable_dropout_in_model(model: nn.Module) -> None:
    """Set the probability of every dropout layer of `model` to 0 (in place)."""
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0


def _find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def ensure_master_addr_port(addr: str | None = None, port: int | None = None) -> None:
    """Make sure `MASTER_ADDR` and `MASTER_PORT` are set for `torch.distributed` initialisation.

    `MASTER_ADDR` keeps an existing value, else `addr`, else `"localhost"`. `MASTER_PORT` takes `port` when given,
    else keeps a valid existing value, else a free port is picked (empty, `"0"` and `"auto"` count as unset).

    Args:
        addr: Address used when `MASTER_ADDR` is not already set.
        port: Port to use; overrides any existing `MASTER_PORT`.
    """
    os.environ["MASTER_ADDR"] = os.environ.get("MASTER_ADDR") or addr or "localhost"
    if port is not None:
        os.environ["MASTER_PORT"] = str(port)
        return
    existing = os.environ.get("MASTER_PORT", "").strip()
    if existing.lower() not in ("", "0", "auto"):
        try:
            if 0 < int(existing) < 65536:
                return
        except ValueError:
            pass
    os.environ["MASTER_PORT"] = str(_find_free_port())


def get_peft_config(model_args: Any):
    """Build a `peft.LoraConfig` from a [`ModelConfig`], or return None when `use_peft` is off.

    Args:
        model_args: Object with the LoRA fields of [`ModelConfig`] (`use_peft`, `lora_r`, `lora_alpha`, ...).

    Returns:
        `peft.LoraConfig | None`.
    """
    if not model_args.use_peft:
        return None
    if not is_peft_available():
        raise ValueError(
            "`use_peft=True` needs the PEFT library, which is not installed. Install it with `pip install trl[peft]`."
        )
    from peft import LoraConfig

    kwargs = dict(
        task_type=model_args.lora_task_type,
        r=model_args.lora_r,
        target_modules=model_args.lora_target_modules,
        lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout,
        bias="none",
        use_rslora=model_args.use_rslora,
        use_dora=model_args.use_dora,
        modules_to_save=model_args.lora_modules_to_save,
    )
    target_parameters = getattr(model_args, "lora_target_parameters", None)
    if target_parameters is not None:
        kwargs["target_parameters"] = target_parameters
    return LoraConfig(**kwargs)


def get_quantization_config(model_args: Any):
    """Build a `transformers.BitsAndBytesConfig` from a [`ModelConfig`], or None without 4/8-bit loading.

    Args:
        model_args: Object with `load_in_4bit`, `load_in_8bit`, `dtype`, `bnb_4bit_quant_type`,
            `use_bnb_nested_quant` and `bnb_4bit_quant_storage`.

    Returns:
        `BitsAndBytesConfig | None`.
    """
    from transformers import BitsAndBytesConfig

    if model_args.load_in_4bit:
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_compute_dtype=model_args.dtype,
            bnb_4bit_quant_type=model_args.bnb_4bit_quant_type,
            bnb_4bit_use_double_quant=model_args.use_bnb_nested_quant,
            bnb_4bit_quant_storage=model_args.bnb_4bit_quant_storage,
        )
    if model_args.load_in_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    return None


def get_kbit_device_map() -> dict[str, int] | None:
    """Device map that puts a quantized model entirely on this process's accelerator, or None without one."""
    cuda = torch.cuda.is_available()
    xpu = hasattr(torch, "xpu") and torch.xpu.is_available()
    if cuda or xpu:
        return {"": PartialState().local_process_index}
    return None


def _resolve_dtype(dtype: Any) -> Any:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        if dtype == "auto":
            return "auto"
        if dtype in _DTYPE_NAMES:
            return getattr(torch, dtype)
    raise ValueError(
        f"Invalid `dtype` {dtype!r}: expected a torch.dtype or one of the strings {list(_DTYPE_NAMES)}. Pass for "
        "example dtype='bfloat16' in `model_init_kwargs`."
    )


def create_model_from_path(model_id: str, architecture: Any = None, **kwargs) -> PreTrainedModel:
    """Load a pretrained model from a hub id or a local directory with the defaults the trainers use.

    The class is `architecture` when given, else the class named in `config.architectures[0]`; for custom code not in
    transformers, `AutoModelForImageTextToText` when the config's `auto_map` has it, else `AutoModelForCausalLM`.
    `dtype` defaults to float32 (the strings `"bfloat16"`, `"float16"`, `"float32"` and `"auto"` are accepted).
    `device_map` defaults to `"auto"` when a GPU is available and to None otherwise, and is forced to None in
    multi-GPU (DDP) and DeepSpeed runs, where accelerate places the model.

    Args:
        model_id: Hub id or local path.
        architecture: Model class (or auto class) to load with; inferred from the config when None.
        **kwargs: Passed to `from_pretrained` (for example `dtype`, `revision`, `attn_implementation`).

    Returns:
        The loaded model.
    """
    import transformers

    kwargs = dict(kwargs)
    if "torch_dtype" in kwargs and "dtype" not in kwargs:  # older spelling
        kwargs["dtype"] = kwargs.pop("torch_dtype")
    kwargs["dtype"] = _resolve_dtype(kwargs.get("dtype"))

    if "device_map" not in kwargs:
        kwargs["device_map"] = "auto" if torch.cuda.is_available() else None
    distributed_type = PartialState().distributed_type
    if distributed_type in (DistributedType.MULTI_GPU, DistributedType.DEEPSPEED):
        kwargs["device_map"] = None

    if architecture is None:
        config = AutoConfig.from_pretrained(
            model_id,
            revision=kwargs.get("revision"),
            trust_remote_code=kwargs.get("trust_remote_code", False),
        )
        names = getattr(config, "architectures", None) or []
        architecture = getattr(transformers, names[0], None) if names else None
        if architecture is None:
            auto_map = getattr(config, "auto_map", None) or {}
            if "AutoModelForImageTextToText" in auto_map:
                architecture = transformers.AutoModelForImageTextToText
            else:
                architecture = transformers.AutoModelForCausalLM
    return architecture.from_pretrained(model_id, **kwargs)


def get_config_model_id(config: PretrainedConfig) -> str:
    """Model id or path a config was loaded from (its `_name_or_path`)."""
    return getattr(config, "_name_or_path", "")


@contextmanager
def use_adapter(model: Any, adapter_name: str | None):
    """Temporarily switch the active adapter of a PEFT model.

    `adapter_name=None` disables all adapters inside the block (the base model is used, for example as a
    reference). The previous active adapter and the `requires_grad` flags of all parameters are restored on exit.

    Args:
        model: A `peft.PeftModel`.
        adapter_name: Adapter to activate, or None to disable adapters.
    """
    if adapter_name is None:
        with model.disable_adapter():
            yield model
        return
    previous = model.active_adapter
    flags = [(p, p.requires_grad) for p in model.parameters()]
    model.set_adapter(adapter_name)
    try:
        yield model
    finally:
        model.set_adapter(previous)
        for param, flag in flags:  # set_adapter makes the activated adapter trainable: undo that
            param.requires_grad_(flag)


def identity(x: Any) -> Any:
    """Return `x` unchanged."""
    return x


def remove_none_values(example: Any) -> Any:
    """Recursively drop dictionary entries whose value is None (lists are processed item by item)."""
    if isinstance(example, dict):
        return {k: remove_none_values(v) for k, v in example.items() if v is not None}
    if isinstance(example, list):
        return [remove_none_values(v) for v in example]
    return example


def hash_module(module: nn.Module) -> str:
    """SHA-256 hex digest of a module's parameters and buffers (names, dtypes, shapes and values)."""
    digest = hashlib.sha256()
    for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        digest.update(name.encode())
        digest.update(str(tensor.dtype).encode())
        digest.update(str(tuple(tensor.shape)).encode())
        data = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() > 0 else b"")
    return digest.hexdigest()


def _unwrap_partial(func: Any) -> Any:
    while isinstance(func, functools.partial):
        func = func.func
    return func


def get_callable_name(func: Callable) -> str:
    """Readable name of a function, method, `functools.partial` or callable object (its class name)."""
    func = _unwrap_partial(func)
    name = getattr(func, "__name__", None)
    if name is not None:
        return name
    return type(func).__name__


def is_async_callable(func: Callable) -> bool:
    """Whether calling `func` returns a coroutine (async function, partial of one, or object with async `__call__`)."""
    func = _unwrap_partial(func)
    if inspect.iscoroutinefunction(func):
        return True
    if inspect.isclass(func):  # calling a class builds an instance, never a coroutine
        return False
    call = getattr(func, "__call__", None)  # noqa: B004
    return call is not None and not inspect.isfunction(func) and inspect.iscoroutinefunction(call)


# ---------------------------------------------------------------------------------------------------------------------
# PEFT
# ---------------------------------------------------------------------------------------------------------------------


def _is_kbit_model(model: nn.Module) -> bool:
    return bool(getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False))


def _is_zero3() -> bool:
    try:
        from transformers.integrations import is_deepspeed_zero3_enabled
    except ImportError:
        return False
    return bool(is_deepspeed_zero3_enabled())


def enable_gradient_checkpointing(model: nn.Module, gradient_checkpointing_kwargs: dict | None = None) -> None:
    """Turn on gradient (activation) checkpointing and make the embedding outputs require grad.

    The latter is what lets gradients reach adapters placed after frozen layers when checkpointing is on.

    Args:
        model: A transformers model (or a wrapper forwarding the checkpointing methods).
        gradient_checkpointing_kwargs: Extra arguments for `torch.utils.checkpoint.checkpoint`.
    """
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=gradient_checkpointing_kwargs)
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gradient_checkpointing_kwargs)
    if hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()


def peft_module_casting_to_bf16(model: nn.Module) -> None:
    """Cast a PEFT model for bf16 training on a quantized base: adapters and fp32 embeddings/heads to bf16, norms
    to fp32 (in place)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in model.named_modules():
        if isinstance(module, BaseTunerLayer):
            module.to(torch.bfloat16)
        elif isinstance(module, nn.LayerNorm) or "norm" in name.split(".")[-1].lower():
            module.to(torch.float32)
        elif any(key in name for key in ("lm_head", "embed_tokens", "wte", "wpe")):
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.Tensor) and weight.dtype == torch.float32:
                module.to(torch.bfloat16)


def prepare_peft_model(model: PreTrainedModel, peft_config: Any, args: Any) -> nn.Module:
    """Wrap `model` with LoRA (or another PEFT method) the way every trainer does.

    Steps: validate inputs; quantized (bitsandbytes) models go through `peft.prepare_model_for_kbit_training`;
    otherwise, with `args.gradient_checkpointing`, checkpointing is enabled and the embedding outputs are made to
    require grad (needed for adapters + checkpointing to train); the model is wrapped with `peft.get_peft_model`
    (adapter dtype autocast disabled under ZeRO-3); finally 4-bit models trained in bf16 get their trainable modules
    cast to bf16.

    Args:
        model: Model to wrap.
        peft_config: A `peft.PeftConfig`; None returns `model` unchanged.
        args: Training arguments (`gradient_checkpointing`, `gradient_checkpointing_kwargs` and `bf16` are read).

    Returns:
        The `peft.PeftModel`.
    """
    if peft_config is None:
        return model
    if not is_peft_available():
        raise ImportError(
            "Training with a `peft_config` needs the PEFT library, which is not installed. Install it with "
            "`pip install trl[peft]`."
        )
    from peft import PeftConfig, PeftModel, get_peft_model, prepare_model_for_kbit_training

    if not isinstance(peft_config, PeftConfig):
        raise TypeError(
            f"`peft_config` must be a `peft.PeftConfig` (for example `peft.LoraConfig`), got "
            f"{type(peft_config).__name__}."
        )
    if isinstance(model, PeftModel):
        raise ValueError(
            "The model is already a `PeftModel` and a `peft_config` was also given. Pass either the base model with "
            "a `peft_config`, or the `PeftModel` without one."
        )

    gradient_checkpointing = bool(getattr(args, "gradient_checkpointing", False))
    gc_kwargs = dict(getattr(args, "gradient_checkpointing_kwargs", None) or {})
    zero3 = _is_zero3()
    if gradient_checkpointing and zero3:
        # Non-reentrant checkpointing does not see the parameters DeepSpeed gathers lazily.
        gc_kwargs["use_reentrant"] = True

    if _is_kbit_model(model):
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=gradient_checkpointing, gradient_checkpointing_kwargs=gc_kwargs or None
        )
        if gradient_checkpointing and hasattr(model, "enable_input_require_grads"):
            model.enable_input_require_grads()
    elif gradient_checkpointing:
        enable_gradient_checkpointing(model, gc_kwargs or None)

    with warnings.catch_warnings():
        # peft reads the attribute transformers renamed; the deprecation is not actionable for users.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        model = get_peft_model(model, peft_config, autocast_adapter_dtype=not zero3)

    if getattr(model, "is_loaded_in_4bit", False) and getattr(args, "bf16", False):
        peft_module_casting_to_bf16(model)
    return model


# ---------------------------------------------------------------------------------------------------------------------
# Experiment tracking and model cards
# ---------------------------------------------------------------------------------------------------------------------


def get_comet_experiment_url() -> str | None:
    """URL of the running Comet experiment, or None when Comet is not installed or no experiment is running."""
    if not is_comet_available():
        return None
    import comet_ml

    experiment = comet_ml.get_running_experiment()
    return experiment.url if experiment is not None else None


def get_trackio_space_url() -> str | None:
    """URL of the trackio dashboard (Space) of the current run, or None when unavailable."""
    if not is_trackio_available():
        return None
    try:
        import trackio

        context_vars = getattr(trackio, "context_vars", None)
        run = context_vars.current_run.get() if context_vars is not None else None
    except Exception:
        return None
    if run is None:
        return None
    space_id = getattr(run, "space_id", None) or os.environ.get("TRACKIO_SPACE_ID")
    if not space_id:
        return None
    return f"https://huggingface.co/spaces/{space_id}"


def log_table_to_comet_experiment(name: str, table: Any) -> None:
    """Log a table (e.g. a pandas DataFrame) to the running Comet experiment under the file name `name`."""
    if not is_comet_available():
        raise ModuleNotFoundError("`comet_ml` is not installed. Install it with `pip install comet_ml`.")
    import comet_ml

    experiment = comet_ml.get_running_experiment()
    if experiment is not None:
        experiment.log_table(tabular_data=table, filename=name)


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def generate_model_card(
    base_model: str | None,
    model_name: str,
    hub_model_id: str,
    dataset_name: str | None,
    tags: str | list[str] | None,
    wandb_url: str | None,
    trackio_url: str | None,
    trainer_name: str,
    trainer_citation: str | None = None,
    template_file: str | None = None,
    paper_title: str | None = None,
    paper_id: str | None = None,
    comet_url: str | None = None,
):
    """Render a `huggingface_hub.ModelCard` for a trained model from a Jinja template.

    Template variables: `base_model`, `model_name`, `hub_model_id`, `dataset_name`, `wandb_url`, `trackio_url`,
    `comet_url`, `trainer_name`, `trainer_citation`, `paper_title`, `paper_id`, and the versions `trl_version`,
    `transformers_version`, `pytorch_version`, `datasets_version`, `tokenizers_version`.

    Args:
        base_model: Model the training started from.
        model_name: Name of the trained model.
        hub_model_id: Hub repository id of the trained model.
        dataset_name: Training dataset.
        tags: Extra tags (`generated_from_trainer` is always added).
        wandb_url: Weights & Biases run URL.
        trackio_url: trackio dashboard URL.
        trainer_name: Name of the trainer (e.g. `"SFT"`).
        trainer_citation: BibTeX of the method.
        template_file: Template path; defaults to `trl/templates/lm_model_card.md`.
        paper_title: Title of the method's paper.
        paper_id: arXiv id of the paper.
        comet_url: Comet experiment URL.

    Returns:
        `huggingface_hub.ModelCard`.
    """
    from huggingface_hub import ModelCard, ModelCardData

    if tags is None:
        tags = []
    elif isinstance(tags, str):
        tags = [tags]
    card_data = ModelCardData(
        base_model=base_model,
        datasets=dataset_name,
        library_name="transformers",
        model_name=model_name,
        tags=["generated_from_trainer", *tags],
    )
    if template_file is None:
        template_file = str(Path(__file__).resolve().parent.parent / "templates" / "lm_model_card.md")
    return ModelCard.from_template(
        card_data,
        template_path=template_file,
        base_model=base_model,
        model_name=model_name,
        hub_model_id=hub_model_id,
        dataset_name=dataset_name,
        wandb_url=wandb_url,
        trackio_url=trackio_url,
        comet_url=comet_url,
        trainer_name=trainer_name,
        trainer_citation=trainer_citation,
        paper_title=paper_title,
        paper_id=paper_id,
        trl_version=_version("trl"),
        transformers_version=_version("transformers"),
        pytorch_version=_version("torch"),
        datasets_version=_version("datasets"),
        tokenizers_version=_version("tokenizers"),
    )


# ---------------------------------------------------------------------------------------------------------------------
# Throughput accounting
# ---------------------------------------------------------------------------------------------------------------------

# Dense bf16/fp16 tensor-core peak (FLOP/s) of common accelerators, matched by substring of the device name.
_PEAK_FLOPS_BF16 = {
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L40": 181e12,
    "L4": 121e12,
    "A10G": 125e12,
    "A10": 125e12,
    "A6000": 155e12,
    "V100": 125e12,
    "T4": 65e12,
    "4090": 165e12,
    "3090": 71e12,
    "MI300X": 1307e12,
    "MI250": 362e12,
}


def compute_flops_per_token(model: nn.Module | PretrainedConfig, seq_len: int, num_params: int | None = None) -> float:
    """Approximate training FLOPs per token (forward + backward) of a decoder: `6 * N + 12 * L * H * S`.

    Args:
        model: Model (or its config) providing `num_hidden_layers` and `hidden_size`.
        seq_len: Sequence length `S` (attention cost grows with it).
        num_params: Parameter count `N`; counted from `model` when it is a module and this is None.

    Returns:
        FLOPs per token.
    """
    config = model if isinstance(model, PretrainedConfig) else getattr(model, "config", None)
    text_config = getattr(config, "text_config", None) or config
    layers = getattr(text_config, "num_hidden_layers", 0) or 0
    hidden = getattr(text_config, "hidden_size", 0) or 0
    if num_params is None:
        if not isinstance(model, nn.Module):
            raise ValueError("`num_params` is required when a config (not a model) is given.")
        num_params = sum(p.numel() for p in model.parameters())
    return 6.0 * num_params + 12.0 * layers * hidden * seq_len


def get_peak_flops(device: torch.device | str | None = None) -> float | None:
    """Dense bf16 peak FLOP/s of a CUDA device from a table of known GPUs, or None when unknown (or on CPU)."""
    if not torch.cuda.is_available():
        return None
    device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).upper()
    for key in sorted(_PEAK_FLOPS_BF16, key=len, reverse=True):  # longest match first ("L40S" before "L40")
        if key in name:
            return _PEAK_FLOPS_BF16[key]
    return None


def compute_mfu(
    flops_per_token: float, tokens_per_second: float, peak_flops: float | None, num_devices: int = 1
) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s divided by the peak of `num_devices` devices (None without a peak)."""
    if not peak_flops:
        return None
    return flops_per_token * tokens_per_second / (peak_flops * num_devices)


__all__ = [
    "RepeatSampler",
    "compute_flops_per_token",
    "compute_mfu",
    "create_model_from_path",
    "disable_dropout_in_model",
    "enable_gradient_checkpointing",
    "ensure_master_addr_port",
    "entropy_from_logits",
    "flush_left",
    "flush_right",
    "generate_model_card",
    "get_callable_name",
    "get_comet_experiment_url",
    "get_config_model_id",
    "get_kbit_device_map",
    "get_peak_flops",
    "get_peft_config",
    "get_quantization_config",
    "get_trackio_space_url",
    "hash_module",
    "identity",
    "is_async_callable",
    "log_table_to_comet_experiment",
    "nanmax",
    "nanmin",
    "nanstd",
    "pad",
    "peft_module_casting_to_bf16",
    "prepare_peft_model",
    "print_prompt_completions_sample",
    "remove_none_values",
    "repeat_iterable_dataset",
    "selective_log_softmax",
    "selective_log_softmax_and_entropy",
    "shuffle_sequence_dict",
    "split_tensor_dict",
    "use_adapter",
]


# ---------------------------------------------------------------------------------------------------------------------
# Per-token log-probabilities of a causal LM (shared by DPO, KTO, GRPO, RLOO, Online DPO, ...)
# ---------------------------------------------------------------------------------------------------------------------
class TokenLogps(NamedTuple):
    """Result of [`compute_token_logps`].

    Attributes:
        logps: `(batch, seq_len - 1)` log-probability of each next token (`input_ids[:, t + 1]` given the prefix up to
            `t`); 0 where `target_mask` is False.
        entropy: Same shape, entropy of the predicted distribution (None unless requested).
        outputs: The model's raw outputs (for `aux_loss` of mixture-of-experts models, for example).
    """

    logps: torch.Tensor
    entropy: torch.Tensor | None
    outputs: Any


def model_accepts_argument(model: nn.Module, name: str) -> bool:
    """Whether the (possibly PEFT- or DDP-wrapped) model's `forward` takes an argument called `name`."""
    target = getattr(model, "module", model)
    # PeftModel.forward takes **kwargs and passes them to the wrapped transformers model.
    while hasattr(target, "peft_config") and hasattr(target, "base_model"):
        target = target.base_model
        target = getattr(target, "model", target)
    try:
        return name in inspect.signature(target.forward).parameters
    except (TypeError, ValueError):
        return False


def compute_token_logps(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    target_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    **forward_kwargs: Any,
) -> TokenLogps:
    """Log-probability of every next token under a causal LM, without a full-vocabulary log-softmax.

    Only positions where `target_mask` is True in some row go through the output projection when the model supports
    `logits_to_keep`, so prompts and padding cost no LM-head compute. Works for padded batches (`attention_mask`) and
    padding-free ones (`position_ids` restarting at each packed sequence, no attention mask).

    Args:
        model: Causal LM (plain, PEFT or accelerate-wrapped).
        input_ids: `(batch, seq_len)` token ids.
        attention_mask: Optional `(batch, seq_len)` mask.
        position_ids: Optional `(batch, seq_len)` positions (required for padding-free batches).
        target_mask: Optional `(batch, seq_len - 1)` bool mask of the next-token positions to score.
        temperature: Logits are divided by this value before the softmax.
        compute_entropy: Also return the per-position entropy.
        **forward_kwargs: Extra arguments for the model's forward (e.g. `pixel_values`).

    Returns:
        [`TokenLogps`] with `(batch, seq_len - 1)` tensors.
    """
    kwargs = dict(forward_kwargs)
    kwargs["input_ids"] = input_ids
    kwargs["use_cache"] = False
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    targets = input_ids[:, 1:]
    positions = None
    if target_mask is not None and model_accepts_argument(model, "logits_to_keep"):
        positions = target_mask.any(dim=0).nonzero().squeeze(-1)
        kwargs["logits_to_keep"] = positions
    outputs = model(**kwargs)
    logits = outputs.logits
    if positions is None:
        logits = logits[:, :-1]
    else:
        targets = targets[:, positions]
    if compute_entropy:
        logps, entropy = selective_log_softmax_and_entropy(logits, targets, temperature=temperature)
    else:
        logps, entropy = selective_log_softmax(logits, targets, temperature=temperature), None
    if positions is not None:
        full = logps.new_zeros(input_ids.shape[0], input_ids.shape[1] - 1)
        logps = full.index_copy(1, positions, logps)
        if entropy is not None:
            entropy = entropy.new_zeros(full.shape).index_copy(1, positions, entropy)
    if target_mask is not None:
        logps = logps.masked_fill(~target_mask, 0.0)
        if entropy is not None:
            entropy = entropy.masked_fill(~target_mask, 0.0)
    return TokenLogps(logps=logps, entropy=entropy, outputs=outputs)


# ---------------------------------------------------------------------------------------------------------------------
# Sequence-level log-probabilities for offline preference trainers (DPO, KTO, ...)
#
# These trainers score whole completions (chosen/rejected, desirable/undesirable) under the policy and a reference.
# The helpers below (1) run several sequences through the model in one forward pass without spending compute on
# padding ("packed" layouts with restarting `position_ids`), (2) return per-token values back in the ordinary padded
# `(num_sequences, seq_len - 1)` shape so that loss code never has to know the layout, and (3) precompute reference
# log-probabilities for a whole dataset once, storing them as dataset columns.
# ---------------------------------------------------------------------------------------------------------------------
# Attention implementations whose masks are built from `position_ids` when no attention mask is given (transformers'
# `masking_utils` detects the restarting positions and builds a block-diagonal causal mask) or that run variable-length
# kernels. "varlen" ones cost nothing extra for one long row; the others build a dense mask per row.
_VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3", "flex_attention")
_MASKED_ATTENTION = ("eager", "sdpa")
_PACKABLE_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def _base_transformers_model(model: nn.Module) -> nn.Module:
    """The underlying transformers model of a (DDP-, accelerate- or PEFT-) wrapped model."""
    target = getattr(model, "module", model)
    if is_peft_available():
        from peft import PeftModel

        if isinstance(target, PeftModel):
            target = target.get_base_model()
    return target


def packed_attention_kind(model: nn.Module) -> str | None:
    """How `model` can attend within several sequences packed into one row, or None when it cannot.

    Packing needs a decoder-only model whose forward takes `position_ids` and whose mask is derived from them when no
    attention mask is given (every model built on transformers' `masking_utils`), and no recurrent/linear-attention
    layer (their state would leak from one packed sequence into the next).

    Args:
        model: The (possibly wrapped) causal language model.

    Returns:
        `"varlen"` for variable-length kernels (FlashAttention, flex attention: one long row is free), `"masked"` for
        eager/SDPA attention (a dense block-diagonal mask per row: rows should stay short), or None.
    """
    import sys

    base = _base_transformers_model(model)
    config = getattr(base, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return None
    if not model_accepts_argument(model, "position_ids"):
        return None
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is not None and any(kind not in _PACKABLE_LAYER_TYPES for kind in layer_types):
        return None
    implementation = str(getattr(config, "_attn_implementation", None) or "eager")
    if implementation in _VARLEN_ATTENTION or "flash" in implementation:
        return "varlen"
    if implementation in _MASKED_ATTENTION:
        module = sys.modules.get(type(base).__module__)
        # Models that do not build their mask with `masking_utils` would ignore the restarting positions.
        if module is not None and hasattr(module, "create_causal_mask"):
            return "masked"
    return None


class PackedSequences(NamedTuple):
    """Sequences of a right- or left-padded batch packed into rows, as built by [`pack_padded_sequences`].

    Attributes:
        input_ids: `(rows, width)` packed token ids (trailing free slots hold the pad id).
        position_ids: `(rows, width)` positions restarting at 0 for every sequence (free slots form their own run).
        src_row: `(num_tokens,)` row of each real token in the padded batch.
        src_col: `(num_tokens,)` column of each real token in the padded batch.
        dst_row: `(num_tokens,)` row of that token in the packed layout.
        dst_col: `(num_tokens,)` column of that token in the packed layout.
        offset: `(num_tokens,)` index of the token inside its own sequence.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    src_row: torch.Tensor
    src_col: torch.Tensor
    dst_row: torch.Tensor
    dst_col: torch.Tensor
    offset: torch.Tensor

    def pack_next_token(self, values: torch.Tensor, fill: Any = 0) -> torch.Tensor:
        """Move a padded next-token tensor `(batch, seq_len - 1, ...)` into the packed `(rows, width - 1, ...)` layout.

        Entry `t` of a sequence refers to predicting its token `t + 1`, so only tokens with `offset >= 1` carry a
        value; the first token of every sequence is never a target (nothing precedes it in its own sequence).
        """
        rows, width = self.input_ids.shape
        out = values.new_full((rows, width - 1, *values.shape[2:]), fill)
        keep = self.offset >= 1
        out[self.dst_row[keep], self.dst_col[keep] - 1] = values[self.src_row[keep], self.src_col[keep] - 1]
        return out

    def unpack_next_token(self, packed: torch.Tensor, shape: tuple[int, int], fill: Any = 0) -> torch.Tensor:
        """Inverse of [`pack_next_token`]: a packed `(rows, width - 1, ...)` tensor back to the padded `shape`."""
        out = packed.new_full((*shape, *packed.shape[2:]), fill)
        keep = self.offset >= 1
        out[self.src_row[keep], self.src_col[keep] - 1] = packed[self.dst_row[keep], self.dst_col[keep] - 1]
        return out


def pack_padded_sequences(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    capacity: int | None = None,
    pad_token_id: int = 0,
    pad_to_multiple_of: int | None = None,
) -> PackedSequences:
    """Pack the sequences of a padded batch into as few rows as possible, without padding between them.

    With `capacity=None` every sequence goes into a single row (the best layout for variable-length attention
    kernels). With a capacity, sequences are placed first-fit-decreasing into rows of at most `capacity` tokens
    (`capacity` is raised to the longest sequence if needed), which bounds the size of dense attention masks. Each
    sequence must be contiguous in its padded row (right or left padding).

    Args:
        input_ids: `(batch, seq_len)` padded token ids.
        attention_mask: `(batch, seq_len)` mask of real tokens.
        capacity: Maximum row length, or None for a single row.
        pad_token_id: Id written into unused slots at the end of rows.
        pad_to_multiple_of: Round the packed width up to a multiple of this value.

    Returns:
        [`PackedSequences`].

    Example:
    ```python
    >>> ids = torch.tensor([[1, 2, 3], [4, 5, 0]])
    >>> packed = pack_padded_sequences(ids, ids != 0)
    >>> packed.input_ids, packed.position_ids
    (tensor([[1, 2, 3, 4, 5]]), tensor([[0, 1, 2, 0, 1]]))
    ```
    """
    mask = attention_mask.bool()
    lengths = mask.sum(dim=1)
    length_list = lengths.tolist()
    # Destination (row, start) of every sequence.
    if capacity is None:
        starts = [0] * len(length_list)
        total = 0
        for index, length in enumerate(length_list):
            starts[index] = total
            total += length
        seq_rows = [0] * len(length_list)
        fills = [max(total, 1)]
    else:
        capacity = max(int(capacity), max(length_list, default=1), 1)
        fills: list[int] = []
        seq_rows = [0] * len(length_list)
        starts = [0] * len(length_list)
        for index in sorted(range(len(length_list)), key=lambda i: -length_list[i]):
            length = length_list[index]
            for row, fill in enumerate(fills):
                if fill + length <= capacity:
                    seq_rows[index], starts[index] = row, fill
                    fills[row] = fill + length
                    break
            else:
                seq_rows[index], starts[index] = len(fills), 0
                fills.append(length)
        if not fills:
            fills = [1]
    width = max(max(fills), 2)  # at least two columns so that a next-token position exists
    if pad_to_multiple_of:
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    device = input_ids.device
    src_row, src_col = mask.nonzero(as_tuple=True)
    # Index of each token inside its sequence (works for left and right padding).
    offset = (mask.long().cumsum(dim=1) - 1)[src_row, src_col]
    seq_rows_t = torch.tensor(seq_rows, dtype=torch.long, device=device)
    starts_t = torch.tensor(starts, dtype=torch.long, device=device)
    dst_row = seq_rows_t[src_row]
    dst_col = starts_t[src_row] + offset
    rows = len(fills)
    packed_ids = input_ids.new_full((rows, width), pad_token_id)
    packed_ids[dst_row, dst_col] = input_ids[src_row, src_col]
    # Free slots count up from 0 after the last sequence of each row, forming a separate run nothing attends to.
    fill_t = torch.tensor(fills, dtype=torch.long, device=device).unsqueeze(1)
    columns = torch.arange(width, device=device).unsqueeze(0)
    position_ids = (columns - fill_t).clamp(min=0).expand(rows, width).clone()
    position_ids[dst_row, dst_col] = offset
    return PackedSequences(packed_ids, position_ids, src_row, src_col, dst_row, dst_col, offset)


class SequenceTokenLogps(NamedTuple):
    """Result of [`compute_sequence_token_logps`], always in the padded layout of the input.

    Attributes:
        logps: `(batch, seq_len - 1)` log-probability of each next token; 0 outside `target_mask`.
        entropy: Same shape, entropy of the predicted distribution (None unless requested).
        stats: Dict of extra `(batch, seq_len - 1)` per-token tensors from `logits_stats_fn` (empty when not given).
        outputs: The model's raw outputs (for `aux_loss` of mixture-of-experts models).
    """

    logps: torch.Tensor
    entropy: torch.Tensor | None
    stats: dict[str, torch.Tensor]
    outputs: Any


def compute_sequence_token_logps(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    target_mask: torch.Tensor,
    layout: str = "padded",
    pad_token_id: int = 0,
    pad_to_multiple_of: int | None = None,
    compute_entropy: bool = False,
    logits_stats_fn: Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]] | None = None,
    **forward_kwargs: Any,
) -> SequenceTokenLogps:
    """Per-token log-probs of a padded batch of sequences, computed in one forward pass in the chosen layout.

    Args:
        model: Causal LM.
        input_ids: `(batch, seq_len)` padded token ids.
        attention_mask: `(batch, seq_len)` mask of real tokens.
        target_mask: `(batch, seq_len - 1)` bool mask of the next-token positions to score.
        layout: `"padded"` (the batch as is), `"packed"` (sequences packed first-fit into rows no longer than the
            longest sequence: no padding compute, dense masks stay small) or `"padding_free"` (everything in one row;
            best with variable-length attention kernels). See [`packed_attention_kind`] for which models can pack.
        pad_token_id: Id used for free slots of packed rows.
        pad_to_multiple_of: Round packed row widths up to a multiple of this value.
        compute_entropy: Also return per-token entropies.
        logits_stats_fn: Optional `f(logits, targets) -> dict[str, Tensor]` evaluated without gradients on the logits
            the model returned (`(rows, positions, vocab)`) and their target ids (`(rows, positions)`); each returned
            tensor must have the shape of `targets` and is handed back in the padded layout. Use it for metrics that
            need the full distribution (mean logit, argmax accuracy, ...).
        **forward_kwargs: Extra arguments for the model's forward.

    Returns:
        [`SequenceTokenLogps`].
    """
    if layout not in ("padded", "packed", "padding_free"):
        raise ValueError(f"layout must be 'padded', 'packed' or 'padding_free'; got {layout!r}.")
    target_mask = target_mask.bool()
    packed = None
    if layout == "padded":
        ids, mask, positions_ids, targets_mask = input_ids, attention_mask, None, target_mask
    else:
        capacity = None if layout == "padding_free" else int(attention_mask.sum(dim=1).max().item())
        packed = pack_padded_sequences(input_ids, attention_mask, capacity, pad_token_id, pad_to_multiple_of)
        ids, mask, positions_ids = packed.input_ids, None, packed.position_ids
        targets_mask = packed.pack_next_token(target_mask, False)
    result = compute_token_logps(
        model,
        ids,
        attention_mask=mask,
        position_ids=positions_ids,
        target_mask=targets_mask,
        compute_entropy=compute_entropy,
        **forward_kwargs,
    )
    stats: dict[str, torch.Tensor] = {}
    if logits_stats_fn is not None:
        with torch.no_grad():
            logits = result.outputs.logits
            next_ids = ids[:, 1:]
            if logits.shape[1] == ids.shape[1]:
                logits, kept = logits[:, :-1], None
                kept_targets = next_ids
            else:
                kept = targets_mask.any(dim=0).nonzero().squeeze(-1)
                kept_targets = next_ids[:, kept]
            for name, value in logits_stats_fn(logits.detach(), kept_targets).items():
                full = value.new_zeros(next_ids.shape)
                full = full.index_copy(1, kept, value) if kept is not None else value
                stats[name] = full.masked_fill(~targets_mask, 0)
    logps, entropy = result.logps, result.entropy
    if packed is not None:
        shape = (input_ids.shape[0], input_ids.shape[1] - 1)
        logps = packed.unpack_next_token(logps, shape)
        entropy = packed.unpack_next_token(entropy, shape) if entropy is not None else None
        stats = {name: packed.unpack_next_token(value, shape) for name, value in stats.items()}
    return SequenceTokenLogps(logps=logps, entropy=entropy, stats=stats, outputs=result.outputs)


def precompute_reference_logps(
    dataset: Any,
    data_collator: Callable[[list[dict[str, Any]]], dict[str, Any]],
    compute_fn: Callable[[dict[str, Any]], dict[str, torch.Tensor]],
    batch_size: int,
    accelerator: Any = None,
    num_workers: int = 0,
    desc: str = "Computing reference log-probs",
) -> Any:
    """Evaluate `compute_fn` on every example of `dataset` once and store the results as new dataset columns.

    Used by trainers that can compute reference log-probabilities before training (`precompute_ref_log_probs=True`)
    so that the reference model is not needed afterwards. The dataset is read in order (no shuffling), split across
    processes when an accelerator is given, and the per-example values are gathered back in dataset order, so every
    process gets the same columns.

    Args:
        dataset: A map-style `datasets.Dataset` (streaming datasets cannot get new columns).
        data_collator: Turns a list of examples into the batch `compute_fn` expects.
        compute_fn: `f(batch) -> {column_name: (batch_size,) tensor}`; called under `torch.no_grad()`.
        batch_size: Examples per forward pass (per process).
        accelerator: Optional `accelerate.Accelerator` used to shard the work and move batches to the device.
        num_workers: DataLoader worker processes.
        desc: Progress-bar description.

    Returns:
        The dataset with one float column per key returned by `compute_fn` (existing columns of that name replaced).
    """
    from datasets import Dataset
    from torch.utils.data import DataLoader

    if not isinstance(dataset, Dataset):
        raise ValueError(
            f"Reference log-probs can only be precomputed for a map-style datasets.Dataset, got "
            f"{type(dataset).__name__}. Materialise the dataset (e.g. Dataset.from_list(list(streaming_dataset))) or "
            "set precompute_ref_log_probs=False."
        )
    loader = DataLoader(
        dataset, batch_size=batch_size, collate_fn=data_collator, shuffle=False, num_workers=num_workers
    )
    if accelerator is not None:
        loader = accelerator.prepare(loader)
    device = accelerator.device if accelerator is not None else None
    collected: dict[str, list[torch.Tensor]] = {}
    iterator: Iterable = loader
    if is_rich_available() and (accelerator is None or accelerator.is_main_process) and len(loader) > 1:
        try:
            from rich.progress import track

            iterator = track(loader, description=desc, transient=True)
        except Exception:  # progress display is optional
            iterator = loader
    with torch.no_grad():
        for batch in iterator:
            if device is not None:
                batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
            values = compute_fn(batch)
            if accelerator is not None:
                values = accelerator.gather_for_metrics(values)
            for name, value in values.items():
                collected.setdefault(name, []).append(value.detach().float().cpu())
    for name, chunks in collected.items():
        column = torch.cat(chunks).tolist()
        if len(column) != len(dataset):
            raise RuntimeError(
                f"Precomputing {name!r} produced {len(column)} values for {len(dataset)} examples; the dataloader "
                "must visit every example exactly once."
            )
        if name in dataset.column_names:
            dataset = dataset.remove_columns(name)
        dataset = dataset.add_column(name, column)
    return dataset


# ---------------------------------------------------------------------------------------------------------------------
# Tokenizing prompt/completion data for offline preference trainers (DPO, KTO, BCO, ...)
#
# These trainers tokenize a prompt together with one completion (KTO, BCO) or two (DPO), standard text or
# conversational messages rendered by the chat template, and split each sequence into its prompt part and its
# completion part. They also share a few bookkeeping helpers: the number of completion tokens that survive truncation,
# per-token statistics of the full output distribution for metrics, and `Dataset.map` keyword handling.
# ---------------------------------------------------------------------------------------------------------------------
def map_kwargs_with_desc(map_kwargs: dict[str, Any], text: str) -> dict[str, Any]:
    """`map_kwargs` plus a progress description (map-style datasets only: `IterableDataset.map` takes no `desc`)."""
    return {**map_kwargs, "desc": text} if "num_proc" in map_kwargs else dict(map_kwargs)


def as_token_list(value: Any) -> list[int]:
    """Token ids from a tokenizer or `apply_chat_template` as a flat list (a `[[...]]` batch of one is unwrapped)."""
    if torch.is_tensor(value):
        value = value.tolist()
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], list):
        return value[0]
    return list(value)


def parse_tools_column(tools: Any) -> Any:
    """Value of a `tools` dataset column: a list of JSON schemas, or a JSON string holding one."""
    import json

    if isinstance(tools, str):
        try:
            return json.loads(tools)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"The `tools` column must hold a list of JSON schemas or a JSON string; got {tools!r}."
            ) from error
    return tools


class PromptCompletionTokenizer:
    """Tokenize a prompt followed by one or more alternative completions, splitting each sequence at the prompt.

    Every `prompt + completion` sequence is tokenized in full and the prompt is taken as the shared token prefix of
    all of them and of the separately tokenized prompt, so a tokenizer that merges characters across the junction
    cannot make the prompt differ between the sequences. Standard (text) completions get the EOS token appended;
    conversational rows are rendered with the chat template (the prompt with the generation prompt, or as a
    continuation when it ends with an assistant message), with the row's optional `tools` and `chat_template_kwargs`.

    Args:
        processing_class: Tokenizer or processor (conversational data needs a chat template).
        conversational: Whether the rows hold message lists.

    Example:
    ```python
    >>> tokenize = PromptCompletionTokenizer(tokenizer, conversational=False)
    >>> prompt_ids, (completion_ids,) = tokenize({}, "The sky is", [" blue"])
    ```
    """

    def __init__(self, processing_class: Any, conversational: bool):
        self.processing_class = processing_class
        self.tokenizer = getattr(processing_class, "tokenizer", processing_class)
        self.conversational = conversational

    def _chat(self, messages: list[dict[str, Any]], example: dict[str, Any], **kwargs: Any) -> list[int]:
        template_kwargs = {k: v for k, v in (example.get("chat_template_kwargs") or {}).items() if v is not None}
        try:
            out = self.processing_class.apply_chat_template(
                messages,
                tools=parse_tools_column(example.get("tools")),
                tokenize=True,
                return_dict=True,
                **kwargs,
                **template_kwargs,
            )
        except Exception as error:  # surface template errors with the offending example
            raise ValueError(
                f"Applying the chat template failed on the example {str(messages)[:300]}: {error}"
            ) from error
        return as_token_list(out["input_ids"])

    def __call__(
        self,
        example: dict[str, Any],
        prompt: Any,
        completions: Sequence[Any],
        column_names: Sequence[str] = ("prompt", "completion"),
    ) -> tuple[list[int], list[list[int]]]:
        """Return `(prompt_ids, [completion_ids, ...])`, one completion list per entry of `completions`.

        Args:
            example: The dataset row (for its optional `tools` and `chat_template_kwargs`).
            prompt: Prompt text or messages (None or empty for no prompt).
            completions: Completion texts or message lists.
            column_names: Names of the prompt and completion columns, used in error messages.
        """
        if self.conversational:
            prompt = list(prompt or [])
            if prompt:
                last_role = prompt[-1].get("role")
                prompt_kwargs = (
                    {"continue_final_message": True} if last_role == "assistant" else {"add_generation_prompt": True}
                )
                prompt_ids = self._chat(prompt, example, **prompt_kwargs)
            else:
                prompt_ids = []
            full = [self._chat(prompt + list(completion), example) for completion in completions]
        else:
            prompt = prompt or ""
            if not all(isinstance(value, str) for value in (prompt, *completions)):
                found = ", ".join(type(value).__name__ for value in (prompt, *completions))
                raise ValueError(
                    f"Standard (text) data needs string values in the columns {list(column_names)}; got {found}. "
                    "Conversational data must be lists of {'role', 'content'} messages in every column."
                )
            eos = self.tokenizer.eos_token
            if eos:
                completions = [c if c.endswith(eos) else c + eos for c in completions]
            prompt_ids = as_token_list(self.tokenizer(prompt)["input_ids"]) if prompt else []
            full = [as_token_list(self.tokenizer(prompt + completion)["input_ids"]) for completion in completions]
        from ..data_utils import common_prefix_length

        split = min(common_prefix_length(prompt_ids, ids) for ids in full)
        return full[0][:split], [ids[split:] for ids in full]


def scored_completion_tokens(
    prompt_length: int, completion_length: int, max_length: int | None, truncation_mode: str = "keep_start"
) -> int:
    """Completion tokens of a `prompt + completion` sequence still scored after truncation to `max_length`.

    `keep_start` keeps the first `max_length` tokens, `keep_end` the last ones. The first token of a sequence has
    nothing before it, so it is never scored.
    """
    total = prompt_length + completion_length
    if max_length is None or total <= max_length:
        kept_prompt, kept_completion = prompt_length, completion_length
    elif truncation_mode == "keep_start":
        kept_prompt = min(prompt_length, max_length)
        kept_completion = max_length - kept_prompt
    else:
        kept_completion = min(completion_length, max_length)
        kept_prompt = max_length - kept_completion
    return kept_completion - (1 if kept_prompt == 0 and kept_completion > 0 else 0)


def collate_prompt_completions(
    prompts: list[list[int]],
    completions: list[list[int]],
    pad_token_id: int,
    max_length: int | None = None,
    truncation_mode: str = "keep_start",
    pad_to_multiple_of: int | None = None,
) -> dict[str, torch.Tensor]:
    """Right-padded batch of the token sequences `prompt + completion` (the core of the preference collators).

    Args:
        prompts: Prompt token ids, one list per sequence.
        completions: Completion token ids, aligned with `prompts`.
        pad_token_id: Token used to pad `input_ids`.
        max_length: Keep at most this many tokens of each sequence (`None`: no truncation).
        truncation_mode: `"keep_start"` keeps the first `max_length` tokens, `"keep_end"` the last ones.
        pad_to_multiple_of: Pad the sequence length to a multiple of this value.

    Returns:
        `input_ids`, `attention_mask` and `completion_mask` (1 on completion tokens), each `(n, T)`.

    Example:
    ```python
    >>> collate_prompt_completions([[1, 2], [1]], [[3], [4, 5]], pad_token_id=0)["completion_mask"]
    tensor([[0, 0, 1],
            [0, 1, 1]])
    ```
    """
    if truncation_mode not in ("keep_start", "keep_end"):
        raise ValueError(f"truncation_mode must be 'keep_start' or 'keep_end'; got {truncation_mode!r}.")
    sequences, masks = [], []
    for prompt, completion in zip(prompts, completions):
        ids = list(prompt) + list(completion)
        mask = [0] * len(prompt) + [1] * len(completion)
        if max_length is not None and len(ids) > max_length:
            kept = slice(None, max_length) if truncation_mode == "keep_start" else slice(-max_length, None)
            ids, mask = ids[kept], mask[kept]
        sequences.append(torch.tensor(ids, dtype=torch.long))
        masks.append(torch.tensor(mask, dtype=torch.long))
    return {
        "input_ids": pad(sequences, pad_token_id, "right", pad_to_multiple_of),
        "attention_mask": pad([torch.ones_like(s) for s in sequences], 0, "right", pad_to_multiple_of),
        "completion_mask": pad(masks, 0, "right", pad_to_multiple_of),
    }


# Bytes of float32 logits processed at once by `logits_statistics`.
_STATS_CHUNK_BYTES = 64 * 1024 * 1024


def logits_statistics(logits: torch.Tensor, targets: torch.Tensor, sharpness: bool = False) -> dict[str, torch.Tensor]:
    """Per-token statistics of the full output distribution, computed chunk by chunk (never a full log-softmax).

    Meant as the `logits_stats_fn` of [`compute_sequence_token_logps`] (metrics only, no gradient).

    Args:
        logits: `(rows, positions, vocab)` logits.
        targets: `(rows, positions)` target token ids.
        sharpness: Also return `log_sum_sq_probs = log sum_v p_v^2` (used by WPO weighting).

    Returns:
        `{"mean_logit", "correct"}` (and `"log_sum_sq_probs"`), each of the shape of `targets`: the mean logit over
        the vocabulary and whether the argmax is the target token.
    """
    vocab = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab)
    flat_targets = targets.reshape(-1)
    rows = max(1, _STATS_CHUNK_BYTES // (4 * vocab))
    mean_logit, correct, sharp = [], [], []
    for start in range(0, flat_logits.shape[0], rows):
        chunk = flat_logits[start : start + rows].float()
        mean_logit.append(chunk.mean(dim=-1))
        correct.append((chunk.argmax(dim=-1) == flat_targets[start : start + rows]).float())
        if sharpness:
            # log sum_v p_v^2 = logsumexp(2 z) - 2 logsumexp(z)
            sharp.append(torch.logsumexp(2 * chunk, dim=-1) - 2 * torch.logsumexp(chunk, dim=-1))
    stats = {
        "mean_logit": torch.cat(mean_logit).reshape(targets.shape),
        "correct": torch.cat(correct).reshape(targets.shape),
    }
    if sharp:
        stats["log_sum_sq_probs"] = torch.cat(sharp).reshape(targets.shape)
    return stats


def uses_sharding_engine(args: Any) -> bool:
    """Whether DeepSpeed or FSDP will wrap the model (the policy cannot then double as an unsharded reference).

    Both ways of asking count: the training arguments (`deepspeed=`, `fsdp=`) and an `accelerate launch` config,
    which reaches the process as `ACCELERATE_USE_DEEPSPEED` / `ACCELERATE_USE_FSDP` (and gives the arguments a
    `deepspeed_plugin`).
    """
    if getattr(args, "deepspeed", None) or getattr(args, "fsdp", None):
        return True
    if getattr(args, "deepspeed_plugin", None) is not None:
        return True
    flags = ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP")
    return any(os.environ.get(flag, "false").lower() == "true" for flag in flags)
