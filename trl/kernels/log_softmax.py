"""Chunked log-softmax kernels: selected-token log-probabilities and entropies of `softmax(logits / T)` computed one
block of rows at a time, forward and backward, so no full-vocabulary float32 copy of the batch is ever built."""

import math
from collections.abc import Iterator, Sequence

import torch


# Working-set budget (bytes of float32) for one chunk of rows in the chunked log-softmax helpers. Bounds the extra
# memory to a few times this value whatever the batch size or sequence length.
_CHUNK_BYTES = 32 * 1024 * 1024


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
        index: Integer tensor of shape `(...)` with the token ids to score, or `(..., K)` to score `K` tokens at each
            position.
        temperature: Logits are divided by this value before the softmax.
        row_mask: Optional boolean tensor with the shape of `logits` without its last dimension (or a leading part of
            it, e.g. `(batch,)`). Rows where it is False are skipped entirely and get 0.

    Returns:
        Tensor with the shape of `index` and the dtype of `logits`.
    """
    if index.dim() == logits.dim() and tuple(index.shape[:-1]) == tuple(logits.shape[:-1]):
        return _selective_log_softmax_multi(logits, index, temperature, row_mask)
    logps, _ = _log_softmax_stats(logits, index, temperature, row_mask, None, want_logps=True, want_entropy=False)
    return logps


def _selective_log_softmax_multi(
    logits: torch.Tensor, index: torch.Tensor, temperature: float, row_mask: torch.Tensor | None
) -> torch.Tensor:
    """`K` tokens per position (`index` of shape `(..., K)`): the chunked pass yields each row's log-normaliser
    through the first token (`log Z = logit_0 / T - log p_0`), the other tokens are scored against it."""
    index = index.to(torch.long)
    first = index[..., 0]
    first_logps = _log_softmax_stats(logits, first, temperature, row_mask, None, want_logps=True, want_entropy=False)[
        0
    ]
    compute_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    scaled = logits.gather(-1, index).to(compute_dtype) / temperature
    log_normaliser = scaled[..., :1] - first_logps.to(compute_dtype).unsqueeze(-1)
    logps = scaled - log_normaliser
    if row_mask is not None:
        mask = _prepare_row_mask(row_mask, logits.shape[:-1])
        if mask is not None:
            logps = logps * mask.unsqueeze(-1).to(logps.dtype)
    return logps.to(logits.dtype)


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
