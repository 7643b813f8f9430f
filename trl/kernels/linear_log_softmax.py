"""Fused, chunked LM head + selected-token log-softmax: the log-probability (and entropy) of target tokens under
`softmax((h W^T + b) / T)`, forward and backward, computed one block of rows at a time so that the logits of the whole
batch never exist (neither do their gradients)."""

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F


# Working-set budget (bytes of float32 logits) of one chunk of rows; the extra memory stays a few times this value.
# Every chunk reads the whole head once in the forward and three times in the backward, so a chunk must hold enough
# rows for those passes to pay: at Qwen2.5's 151 936-token vocabulary, 32 MiB held 55 rows, and an SFT step at that
# shape spent ~25 % more CPU time than with 128 MiB (220 rows), which left the peak memory of DPO unchanged.
_CHUNK_BYTES = 128 * 1024 * 1024


# Set while a backward pass runs whose graph is retained for a second one (`retain_graph=True`).
_RETAINING = False


@contextlib.contextmanager
def retaining_graph() -> Iterator[None]:
    """Within the block, backward passes hand back the head gradients taken in the forward without consuming them
    (scaled out of place, or as they are), so that a second backward over the same graph gets the same values instead
    of recomputing them; outside it, they are scaled in place and handed over, which saves a copy."""
    global _RETAINING
    previous, _RETAINING = _RETAINING, True
    try:
        yield
    finally:
        _RETAINING = previous


def fused_head_working_bytes() -> int:
    """An upper bound of the memory the fused head holds besides its gradients: two chunks of logits-sized work."""
    return 2 * _CHUNK_BYTES


# `f(logits, targets) -> {name: per-row tensor}`, called without gradients on each chunk's `(1, rows, vocab)` logits.
LogitsStatsFn = Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]]


def in_common_dtype(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A head's input, weight and bias in the wider of the input's and the weight's dtypes, as TRL computes a head kept
    in another dtype than its input (a bf16 `modules_to_save` copy on an fp32 base, an fp32 head on a bf16 model)."""
    if hidden.dtype == weight.dtype:
        return hidden, weight, bias
    dtype = torch.promote_types(hidden.dtype, weight.dtype)
    return hidden.to(dtype), weight.to(dtype), bias.to(dtype) if bias is not None else None


def _transform_logits(logits, compute_dtype, logit_scale=1.0, softcap=None):
    """The head's logits as the model's distribution reads them, in `compute_dtype`: times `logit_scale`, then
    soft-capped to `softcap * tanh(z / softcap)` (Gemma-style models); unchanged with the defaults."""
    z = logits.to(compute_dtype)
    if logit_scale != 1.0:
        z = z * logit_scale
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    return z


def _chunk_log_softmax(hidden, weight, bias, temperature, compute_dtype, logit_scale=1.0, softcap=None):
    """Logits of one chunk of rows (in the input dtype, as the model's head returns them) and the log-softmax of
    `transform(logits) / temperature` in `compute_dtype` (see `_transform_logits`)."""
    logits = F.linear(hidden, weight, bias)
    scaled = _transform_logits(logits, compute_dtype, logit_scale, softcap)
    if temperature != 1.0:
        scaled = scaled / temperature
    return logits, torch.log_softmax(scaled, dim=-1)


def _entropy(probs: torch.Tensor, log_probs: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`-sum_v p_v log p_v` of each row, the product written into `out` (`probs` or `log_probs`, overwritten).

    The elementwise product then the sum, as TRL reduces it: top-entropy masks compare these values, so they must round
    alike (a dot product per row sums in another order).
    """
    vanishing = probs == 0  # before the product: 0 * (-inf) is NaN there, and the contribution is exactly 0
    return torch.mul(probs, log_probs, out=out).masked_fill_(vanishing, 0.0).sum(dim=-1).neg_()


class _HeadGradients:
    """Accumulates the gradients of the hidden states, weight and bias of the head, one chunk of rows at a time, from
    the chunk's log-probabilities and the gradients of the per-row log-probability and entropy."""

    def __init__(self, hidden, weight, bias, needs, temperature, scale, compute_dtype):
        self.hidden, self.weight, self.bias, self.temperature, self.scale = hidden, weight, bias, temperature, scale
        self.compute_dtype = compute_dtype
        self.need_hidden, self.need_weight, self.need_bias = needs
        self.grad_hidden = torch.empty_like(hidden) if self.need_hidden else None
        # The weight's gradient is written by the first chunk's product and accumulated from the next ones: zeroing
        # a (vocab x hidden) buffer first would cost one more pass over it (545 MB at Qwen2.5's head).
        self.grad_weight = None
        self.grad_bias = torch.zeros_like(bias, dtype=compute_dtype) if self.need_bias else None

    def add(
        self, start, end, log_probs, capped, index, grad_logps, grad_entropy, entropy, log_probs_writable, probs=None
    ):
        """Add the chunk of rows `start:end`; `log_probs` is overwritten only when `log_probs_writable`, and `probs`
        (their exponential, when the caller has it) always."""
        compute_dtype = self.compute_dtype
        probs = log_probs.exp() if probs is None else probs
        if grad_entropy is None:
            # d log p_y / d z_j = 1[j == y] - p_j
            grad = probs.mul_(-grad_logps[start:end].to(compute_dtype).unsqueeze(-1))
        else:
            # dH / d z_j = -p_j (log p_j + H)
            g_h = grad_entropy[start:end].to(compute_dtype).unsqueeze(-1)
            vanishing = probs == 0
            shift = entropy[start:end].unsqueeze(-1)
            shifted = log_probs.add_(shift) if log_probs_writable else log_probs + shift
            grad = shifted.mul_(probs).masked_fill_(vanishing, 0.0)
            grad.mul_(-g_h)
            if grad_logps is not None:
                grad.sub_(probs.mul_(grad_logps[start:end].to(compute_dtype).unsqueeze(-1)))
        if grad_logps is not None:
            g_lp = grad_logps[start:end].to(compute_dtype).unsqueeze(-1)
            grad.scatter_add_(-1, index[start:end].unsqueeze(-1), g_lp)
        if self.temperature != 1.0:
            grad.div_(self.temperature)
        if capped is not None:  # d(c tanh(z / c)) / dz = 1 - tanh(z / c)^2
            grad.mul_(1 - capped.square())
        if self.scale != 1.0:
            grad.mul_(self.scale)
        hidden, h = self.hidden, self.hidden[start:end]
        grad = grad.to(hidden.dtype)
        if self.need_hidden:
            torch.mm(grad, self.weight.to(grad.dtype), out=self.grad_hidden[start:end])
        if self.need_weight:
            if self.grad_weight is None:
                self.grad_weight = torch.mm(grad.t().to(compute_dtype), h.to(compute_dtype))
            else:
                self.grad_weight.addmm_(grad.t().to(compute_dtype), h.to(compute_dtype))
        if self.need_bias:
            self.grad_bias.add_(grad.sum(dim=0).to(compute_dtype))

    def result(self):
        grad_weight, grad_bias = self.grad_weight, self.grad_bias
        if self.need_weight and grad_weight is None:  # no rows
            grad_weight = torch.zeros_like(self.weight, dtype=self.compute_dtype)
        grad_weight = grad_weight.to(self.weight.dtype) if grad_weight is not None else None
        grad_bias = grad_bias.to(self.bias.dtype) if grad_bias is not None else None
        return self.grad_hidden, grad_weight, grad_bias


def _proportion(actual: torch.Tensor, expected: torch.Tensor) -> float | None:
    """`c` with `actual == c * expected` (to float rounding), or None when the two are not proportional."""
    actual, expected = actual.to(expected.dtype), expected
    denominator = expected.square().sum()
    if not bool(denominator > 0):
        return None
    c = float((actual * expected).sum() / denominator)
    tolerance = 1e-5 * float(actual.abs().max()) + 1e-30
    return c if bool(((actual - c * expected).abs() <= tolerance).all()) else None


class _LinearLogSoftmax(torch.autograd.Function):
    """Rows of `hidden` `(N, H)` through the head `(weight, bias)`, then the log-probability of `index` `(N,)`.

    The forward saves the inputs, each row's log-normaliser and entropy (`N` floats each). The backward recomputes the
    logits chunk by chunk (unless all rows fit in one chunk: then the forward's log-probabilities are kept) and
    accumulates the gradients of the hidden states, weight and bias from each chunk (the weight's and bias' only when
    they require one: a frozen head under PEFT costs no extra matmul).

    With a frozen head (only `hidden` needs a gradient, as under PEFT) the forward also computes each row's gradient
    for a unit upstream gradient, `((onehot(y) - p) / T) W`, and the backward multiplies it by the upstream one: two
    head products in all, whatever the loss, and no logits kept. An entropy that receives a gradient takes the
    recomputing path.

    With `expected_grad` (`(N,)`) and a trainable head, the caller announces that the gradient of the
    log-probabilities will be proportional to it (and the entropy get none), as for a loss that is a weighted sum of
    them (SFT's): the forward then computes the gradients from the logits it has at hand, and the backward only scales
    them, so no logits are recomputed. A backward whose gradient is not proportional takes the recomputing path (same result, no saving).
    """

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        bias,
        index,
        temperature,
        want_entropy,
        stats_fn,
        stat_names,
        max_rows,
        scale=1.0,
        cap=None,
        expected_grad=None,
    ):
        rows = hidden.shape[0]
        compute_dtype = torch.promote_types(hidden.dtype, torch.float32)
        logps = hidden.new_empty(rows, dtype=compute_dtype)
        log_norm = hidden.new_empty(rows, dtype=compute_dtype)
        entropy = hidden.new_zeros(rows, dtype=compute_dtype)
        stats: dict[str, list[torch.Tensor]] = {}
        needs = tuple(ctx.needs_input_grad[:3])
        ahead, ahead_grad = None, expected_grad
        # A frozen head (only the hidden states need a gradient, as under PEFT): row i's gradient is
        # g_i * ((onehot(y_i) - p_i) / T) W for any upstream g, so the forward computes the bracket once per row and
        # the backward scales it, whatever the loss (no promise needed, nothing recomputed).
        ctx.per_row = needs == (True, False, False) and cap is None
        if ctx.per_row:
            ahead_grad = hidden.new_ones(rows, dtype=compute_dtype)
        if ahead_grad is not None and any(needs) and cap is None:
            ahead = _HeadGradients(hidden, weight, bias, needs, temperature, scale, compute_dtype)
        ctx.kept_log_probs = None
        for start in range(0, rows, max_rows):
            end = min(start + max_rows, rows)
            logits, log_probs = _chunk_log_softmax(
                hidden[start:end], weight, bias, temperature, compute_dtype, scale, cap
            )
            idx = index[start:end].unsqueeze(-1)
            logps[start:end] = log_probs.gather(-1, idx).squeeze(-1)
            # log Z = z_y / T - log p_y: what the backward needs to rebuild the probabilities from recomputed logits.
            target_logit = logits.gather(-1, idx).squeeze(-1)
            scaled_target = _transform_logits(target_logit, compute_dtype, scale, cap) / temperature
            log_norm[start:end] = scaled_target - logps[start:end]
            if stats_fn is not None:
                for name, value in stats_fn(logits.unsqueeze(0), index[start:end].unsqueeze(0)).items():
                    stats.setdefault(name, []).append(value.squeeze(0))
            del logits  # before the probabilities: at most two logits-sized buffers at a time from here on
            probs = log_probs.exp() if want_entropy or ahead is not None else None
            if want_entropy:
                # The gradients ahead need the probabilities and not the log-probabilities (no entropy gradient in
                # the forward); without them, the log-probabilities may be kept for the backward.
                entropy[start:end] = _entropy(probs, log_probs, out=log_probs if ahead is not None else probs)
            if ahead is not None:
                ahead.add(start, end, log_probs, None, index, ahead_grad, None, None, True, probs=probs)
            del probs
            # All rows in one chunk: the backward starts right after the head, so keeping the log-probabilities
            # costs no peak memory (the backward would allocate their like) and saves recomputing the logits.
            keep = ahead is None and end == rows and start == 0 and cap is None and any(needs)
            ctx.kept_log_probs = log_probs if keep else None
            del log_probs
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, bias, index, log_norm, entropy)
        ctx.temperature, ctx.max_rows, ctx.scale, ctx.cap = temperature, max_rows, scale, cap
        ctx.ahead, ctx.expected_grad = (ahead.result(), ahead_grad) if ahead is not None else (None, None)
        # The names go back through the caller's list: an autograd function returns tensors only.
        stat_names.extend(sorted(stats))
        stat_values = [torch.cat(stats[name]) for name in stat_names]
        ctx.mark_non_differentiable(*stat_values)
        if not want_entropy:
            ctx.mark_non_differentiable(entropy)
        return (logps, entropy, *stat_values)

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy, *_):
        hidden, weight, bias, index, log_norm, entropy = ctx.saved_tensors
        nothing = (None,) * 10
        if grad_logps is None and grad_entropy is None:
            return (None, None, None, *nothing)
        if ctx.ahead is not None and grad_entropy is None and grad_logps is not None and ctx.per_row:
            per_row = ctx.ahead[0]  # kept as is: a second backward (retain_graph) scales it again
            grad_hidden = (per_row.to(log_norm.dtype) * grad_logps.to(log_norm.dtype).unsqueeze(-1)).to(hidden.dtype)
            return (grad_hidden, None, None, *nothing)
        if ctx.ahead is not None and grad_entropy is None and grad_logps is not None:
            factor = _proportion(grad_logps, ctx.expected_grad)
            if factor is not None and _RETAINING:
                return (*(g if g is None or factor == 1.0 else g * factor for g in ctx.ahead), *nothing)
            if factor is not None:
                grads, ctx.ahead = ctx.ahead, None  # scaled in place: a second backward recomputes
                if factor != 1.0:
                    for grad in grads:
                        if grad is not None:
                            grad.mul_(factor)
                return (*grads, *nothing)
        temperature, compute_dtype, scale, cap = ctx.temperature, log_norm.dtype, ctx.scale, ctx.cap
        grads = _HeadGradients(hidden, weight, bias, ctx.needs_input_grad[:3], temperature, scale, compute_dtype)
        for start in range(0, hidden.shape[0], ctx.max_rows):
            end = min(start + ctx.max_rows, hidden.shape[0])
            capped, kept = None, ctx.kept_log_probs
            if kept is not None:
                log_probs = kept  # read only: a second backward (retain_graph) reads it again
            else:
                scaled = F.linear(hidden[start:end], weight, bias).to(compute_dtype)
                if scale != 1.0:
                    scaled = scaled * scale
                if cap is not None:
                    capped = torch.tanh(scaled / cap)
                    scaled = capped * cap
                if temperature != 1.0:
                    scaled = scaled / temperature
                log_probs = scaled.sub_(log_norm[start:end].unsqueeze(-1))
            grads.add(start, end, log_probs, capped, index, grad_logps, grad_entropy, entropy, kept is None)
            del log_probs, capped
        return (*grads.result(), *nothing)


def linear_selective_log_softmax(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    index: torch.Tensor,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    logits_stats_fn: LogitsStatsFn | None = None,
    max_rows: int | None = None,
    logit_scale: float = 1.0,
    final_logit_softcapping: float | None = None,
    expected_grad: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
    """Log-probability of `index` under `softmax(F.linear(hidden, weight, bias) / temperature)`, chunk by chunk.

    Equivalent to `selective_log_softmax(F.linear(hidden, weight, bias), index, temperature)` (values and gradients
    for `hidden`, `weight` and `bias`), without ever holding the `(..., vocab)` logits of all rows: each block of rows
    is projected, reduced and dropped, and the backward recomputes it. Trades one extra head matmul for the memory of
    the full logits and of their gradient. Under autocast it runs with autocast off, in the head's dtype (the hidden
    states cast to it), so that the recomputed logits are the forward's.

    Args:
        hidden: `(..., H)` inputs of the output projection (final hidden states).
        weight: `(V, H)` weight of the output projection.
        index: Integer tensor of shape `(...)`: the token to score at each row.
        bias: Optional `(V,)` bias of the output projection.
        temperature: Logits are divided by this value before the softmax.
        compute_entropy: Also return each row's entropy of `softmax(logits / temperature)` (differentiable).
        logits_stats_fn: Optional `f(logits, targets) -> {name: tensor}` called without gradients on every chunk's
            unscaled `(1, rows, V)` logits and `(1, rows)` targets; each value must have the shape of the targets.
        max_rows: Rows per chunk (default: about 32 MiB of float32 logits).
        logit_scale: The logits are multiplied by this value first (models whose config sets a logit scale).
        final_logit_softcapping: If set, the scaled logits `z` become `c * tanh(z / c)` before the temperature.
        expected_grad: Optional tensor of the shape of `index`: a promise that the gradient reaching the returned
            log-probabilities will be proportional to it (and none reach the entropy), as for a loss that is a
            weighted sum of them. The gradients are then computed in the forward from its logits, and the backward
            recomputes nothing; a gradient that breaks the promise is handled by the recomputing backward.

    Returns:
        `(logps, entropy, stats)`: `logps` and `entropy` (None unless requested) of shape `(...)` in float32 (float64
        for float64 inputs), and the `logits_stats_fn` values of shape `(...)`.
    """
    if temperature <= 0:
        raise ValueError(f"`temperature` must be > 0, got {temperature}.")
    lead_shape = hidden.shape[:-1]
    if tuple(index.shape) != tuple(lead_shape):
        raise ValueError(
            f"`index` must have the shape of `hidden` without its last dimension, {tuple(lead_shape)}, got "
            f"{tuple(index.shape)}."
        )
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        # The backward pass recomputes the logits with autocast off, so the forward runs with it off too: the head's
        # product in the head's own dtype (the hidden states are cast to it), the same in both passes.
        with torch.autocast(device_type, enabled=False):
            return linear_selective_log_softmax(
                hidden.to(weight.dtype),
                weight,
                index,
                bias,
                temperature,
                compute_entropy,
                logits_stats_fn,
                max_rows,
                logit_scale,
                final_logit_softcapping,
                expected_grad,
            )
    hidden, weight, bias = in_common_dtype(hidden, weight, bias)
    if max_rows is None:
        max_rows = max(1, _CHUNK_BYTES // (4 * max(weight.shape[0], 1)))
    max_rows = int(max_rows)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_index = index.reshape(-1).to(torch.long)
    names: list[str] = []
    logps, entropy, *values = _LinearLogSoftmax.apply(
        flat_hidden,
        weight,
        bias,
        flat_index,
        float(temperature),
        compute_entropy,
        logits_stats_fn,
        names,
        max_rows,
        float(logit_scale),
        None if final_logit_softcapping is None else float(final_logit_softcapping),
        None
        if expected_grad is None
        else expected_grad.reshape(-1).to(torch.promote_types(hidden.dtype, torch.float32)),
    )
    stats = {name: value.reshape(lead_shape) for name, value in zip(names, values, strict=True)}
    return logps.reshape(lead_shape), entropy.reshape(lead_shape) if compute_entropy else None, stats
