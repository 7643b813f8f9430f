"""Generalized Jensen-Shannon divergence between a student's and a teacher's next-token distributions.

With `p_S = softmax(z_S / T)` and `p_T = softmax(z_T / T)` at each position, and `beta` in `[0, 1]`:

- `beta = 0`: forward KL, `KL(p_T || p_S)`;
- `beta = 1`: reverse KL, `KL(p_S || p_T)`;
- otherwise: `beta * KL(p_T || m) + (1 - beta) * KL(p_S || m)` with the mixture `m = (1 - beta) p_S + beta p_T`
  (at `beta = 0.5` the usual Jensen-Shannon divergence).

Everything is computed in log space (the mixture through `logaddexp`), in float32 (float64 for float64 inputs), one
chunk of positions at a time, forward and backward: a custom autograd function recomputes each chunk's log-softmaxes
in the backward pass and writes the gradient straight into a logits-shaped buffer, so no full-vocabulary float32
log-softmax of either model exists for the whole batch. The student side may also be given as hidden states plus
the LM head, in which case not even the student's logits are materialised for the whole batch.
"""

import math

import torch

from ...kernels.chunked_divergence import _chunk_divergence
from ...kernels.linear_log_softmax import _entropy
from ...kernels.log_softmax import _CHUNK_BYTES, _chunk_selection, _iter_row_chunks, _read, _write


# Float32 tensors of vocabulary size alive at once while one chunk is processed (both log-softmaxes, the mixture,
# probabilities and gradients); divides the kernels' per-chunk byte budget.
_WORK_TENSORS_PER_ROW = 6

_REDUCTIONS = ("batchmean", "sum", "mean", "none")


def _default_chunk_rows(vocab_size: int) -> int:
    return max(1, _CHUNK_BYTES // (max(vocab_size, 1) * 4 * _WORK_TENSORS_PER_ROW))


class _ChunkedJSD(torch.autograd.Function):
    """Per-position generalized JSD from student logits (or hidden states and an LM head) and teacher logits.

    Inputs: `student` is `(..., V)` logits, or `(..., H)` hidden states when `weight` (`(V, H)`) is given (with an
    optional `bias` `(V,)`); `teacher_logits` is `(..., V)`; `row_mask` (bool, `(...)`) or None. Output: `(...)` in
    float32/float64, 0 where the mask is False. Only the inputs are saved; the backward recomputes chunk by chunk.
    """

    @staticmethod
    def forward(ctx, student, weight, bias, teacher_logits, row_mask, beta, temperature, max_rows):
        lead_shape = teacher_logits.shape[:-1]
        compute_dtype = torch.promote_types(teacher_logits.dtype, torch.float32)
        out = torch.zeros(lead_shape, dtype=compute_dtype, device=teacher_logits.device)
        for key in _iter_row_chunks(lead_shape, max_rows):
            skip, sub_mask = _chunk_selection(row_mask, key)
            if skip:
                continue
            student_chunk = _read(student, key, sub_mask)
            if weight is not None:
                student_chunk = torch.nn.functional.linear(student_chunk, weight, bias)
            value, _, _ = _chunk_divergence(
                student_chunk, _read(teacher_logits, key, sub_mask), beta, temperature, False, False
            )
            _write(out, key, sub_mask, value)
        ctx.save_for_backward(student, weight, bias, teacher_logits, row_mask)
        ctx.beta, ctx.temperature, ctx.max_rows = beta, temperature, max_rows
        return out

    @staticmethod
    def backward(ctx, grad_out):
        student, weight, bias, teacher_logits, row_mask = ctx.saved_tensors
        from_hidden = weight is not None
        need_student = ctx.needs_input_grad[0]
        need_weight = from_hidden and ctx.needs_input_grad[1]
        need_bias = bias is not None and ctx.needs_input_grad[2]
        need_teacher = ctx.needs_input_grad[3]
        need_logit_grad = need_student or need_weight or need_bias
        grad_student = torch.zeros_like(student) if need_student else None
        grad_weight = (
            torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype, torch.float32)) if need_weight else None
        )
        grad_bias = (
            torch.zeros_like(bias, dtype=grad_weight.dtype if need_weight else torch.float32) if need_bias else None
        )
        grad_teacher = torch.zeros_like(teacher_logits) if need_teacher else None

        for key in _iter_row_chunks(teacher_logits.shape[:-1], ctx.max_rows):
            skip, sub_mask = _chunk_selection(row_mask, key)
            if skip:
                continue
            upstream = _read(grad_out, key, sub_mask).unsqueeze(-1)
            student_chunk = _read(student, key, sub_mask)
            logits_chunk = torch.nn.functional.linear(student_chunk, weight, bias) if from_hidden else student_chunk
            _, grad_s, grad_t = _chunk_divergence(
                logits_chunk,
                _read(teacher_logits, key, sub_mask),
                ctx.beta,
                ctx.temperature,
                need_logit_grad,
                need_teacher,
            )
            if need_teacher:
                _write(grad_teacher, key, sub_mask, (grad_t * upstream).to(grad_teacher.dtype))
            if not need_logit_grad:
                continue
            grad_logits = grad_s * upstream
            if not from_hidden:
                _write(grad_student, key, sub_mask, grad_logits.to(grad_student.dtype))
                continue
            if need_student:
                _write(grad_student, key, sub_mask, (grad_logits.to(weight.dtype) @ weight).to(grad_student.dtype))
            flat_grad = grad_logits.reshape(-1, grad_logits.shape[-1])
            if need_weight:
                flat_hidden = student_chunk.reshape(-1, student_chunk.shape[-1]).to(flat_grad.dtype)
                grad_weight += flat_grad.T @ flat_hidden
            if need_bias:
                grad_bias += flat_grad.sum(0).to(grad_bias.dtype)

        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_student, grad_weight, grad_bias, grad_teacher, None, None, None, None


class _FrozenHeadJSD(torch.autograd.Function):
    """Per-position generalized JSD and student entropy from the student's hidden states through a frozen LM head.

    Only the hidden states receive a gradient, and the divergence at row i depends on row i alone, so the gradient
    reaching row i is `g_i * u_i` with `u_i = (d JSD_i / d z_i) W` for any upstream `g`. The forward projects all rows
    at once (one pass over the head), turns that buffer into `d JSD / d z` chunk by chunk, and multiplies it by the
    head once: only `u` (hidden-sized) is saved, and no logits-sized tensor outlives the forward.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, teacher_logits, row_mask, beta, temperature, max_rows):
        lead_shape = teacher_logits.shape[:-1]
        compute_dtype = torch.promote_types(teacher_logits.dtype, torch.float32)
        out = torch.zeros(lead_shape, dtype=compute_dtype, device=teacher_logits.device)
        entropy = torch.zeros_like(out)
        buffer = torch.nn.functional.linear(hidden, weight, bias)  # becomes d JSD / d logits, chunk by chunk
        for key in _iter_row_chunks(lead_shape, max_rows):
            skip, sub_mask = _chunk_selection(row_mask, key)
            if skip:
                buffer[key] = 0
                continue
            logits = _read(buffer, key, sub_mask)
            value, grad, _ = _chunk_divergence(
                logits, _read(teacher_logits, key, sub_mask), beta, temperature, True, False
            )
            log_probs = torch.log_softmax(logits.to(compute_dtype) / temperature, dim=-1)
            probs = log_probs.exp()
            _write(entropy, key, sub_mask, _entropy(probs, log_probs, out=probs))
            del logits, log_probs, probs
            _write(out, key, sub_mask, value)
            if sub_mask is not None:
                buffer[key][~sub_mask] = 0
            _write(buffer, key, sub_mask, grad.to(buffer.dtype))
            del grad
        ctx.save_for_backward(buffer @ weight.to(buffer.dtype))
        ctx.hidden_dtype = hidden.dtype
        ctx.mark_non_differentiable(entropy)
        return out, entropy

    @staticmethod
    def backward(ctx, grad_out, _grad_entropy):
        (per_row,) = ctx.saved_tensors
        grad_hidden = (per_row.to(grad_out.dtype) * grad_out.unsqueeze(-1)).to(ctx.hidden_dtype)
        return grad_hidden, None, None, None, None, None, None, None


def head_is_frozen(head: torch.nn.Linear) -> bool:
    """Whether an LM head takes no gradient (weight and bias frozen, as under PEFT), so that
    [`frozen_head_generalized_jsd`] applies."""
    return not head.weight.requires_grad and (head.bias is None or not head.bias.requires_grad)


def frozen_head_generalized_jsd(
    hidden: torch.Tensor,
    head: torch.nn.Linear,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[`per_token_generalized_jsd`] of `head(hidden)` against `teacher_logits`, and the student's entropy, when the
    head is frozen ([`head_is_frozen`]).

    Same values as projecting the hidden states and calling [`per_token_generalized_jsd`] (the plain path), and the
    same gradient for `hidden` to float rounding, but the gradient is computed in the forward pass: the student's
    logits and the divergence's gradient never outlive it, where the plain path keeps the logits and allocates their
    gradient in the backward pass (three logits-sized tensors at its peak, one here).

    Args:
        hidden: `(..., H)` student hidden states (requires a gradient).
        head: The student's frozen LM head, `(V, H)` weight and optional bias.
        teacher_logits: `(..., V)` teacher logits (no gradient).
        mask: Optional boolean `(...)`; positions where it is False get 0.
        beta: See [`per_token_generalized_jsd`].
        temperature: Both sides' logits are divided by it before the softmax.

    Returns:
        `(per_token, entropy)`: the divergence `(...)` (differentiable with respect to `hidden`) and the entropy of
        `softmax(head(hidden) / temperature)` (`(...)`, without gradient, 0 where `mask` is False), in float32.
    """
    _check_beta_temperature(beta, temperature)
    if not head_is_frozen(head) or teacher_logits.requires_grad:
        bias_grad = head.bias is not None and head.bias.requires_grad
        raise ValueError(
            "`frozen_head_generalized_jsd` needs a frozen head and teacher logits without gradient, got "
            f"head.weight.requires_grad={head.weight.requires_grad}, head bias requires_grad={bias_grad}, "
            f"teacher_logits.requires_grad={teacher_logits.requires_grad}. For a trained head, project the hidden "
            "states and call `per_token_generalized_jsd`; compute the teacher's logits under `torch.no_grad()`."
        )
    if mask is not None:
        mask = mask.to(torch.bool)
    # Half the usual block: the student's logits are already held whole, next to the teacher's.
    rows = max(1, _default_chunk_rows(teacher_logits.shape[-1]) // 2)
    return _FrozenHeadJSD.apply(
        hidden, head.weight, head.bias, teacher_logits, mask, float(beta), float(temperature), rows
    )


def _check_beta_temperature(beta: float, temperature: float) -> None:
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"`beta` must be in [0, 1] (0: forward KL, 1: reverse KL), got {beta}.")
    if temperature <= 0:
        raise ValueError(f"`temperature` must be > 0, got {temperature}.")


def per_token_generalized_jsd(
    student: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    lm_head_weight: torch.Tensor | None = None,
    lm_head_bias: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Generalized JSD between student and teacher at every position, computed chunk by chunk.

    Args:
        student: Student logits `(..., V)`; or, when `lm_head_weight` is given, the student's final hidden states
            `(..., H)`, projected to logits one chunk at a time (the student's full logits never exist).
        teacher_logits: Teacher logits `(..., V)`, aligned position by position with `student`.
        mask: Optional boolean `(...)`; positions where it is False are skipped and get 0 (no gradient).
        beta: 0 gives `KL(teacher || student)`, 1 gives `KL(student || teacher)`, values in between the
            beta-weighted JSD through the mixture `(1 - beta) p_student + beta p_teacher`.
        temperature: Both sides' logits are divided by it before the softmax.
        lm_head_weight: LM head weight `(V, H)`; switches `student` to hidden states.
        lm_head_bias: Optional LM head bias `(V,)`.
        chunk_size: Positions processed together (default: from a fixed memory budget and the vocabulary size). The
            result does not depend on it.

    Returns:
        Tensor `(...)` in float32 (float64 for float64 inputs), differentiable with respect to `student`, the LM head
        and `teacher_logits`.
    """
    _check_beta_temperature(beta, temperature)
    lead_shape = teacher_logits.shape[:-1]
    if tuple(student.shape[:-1]) != tuple(lead_shape):
        raise ValueError(
            f"`student` and `teacher_logits` must share their leading (batch, position) shape, got "
            f"{tuple(student.shape)} and {tuple(teacher_logits.shape)}."
        )
    vocab_size = teacher_logits.shape[-1]
    if lm_head_weight is not None:
        if tuple(lm_head_weight.shape) != (vocab_size, student.shape[-1]):
            raise ValueError(
                f"`lm_head_weight` must have shape (vocab_size, hidden_size) = ({vocab_size}, {student.shape[-1]}), "
                f"got {tuple(lm_head_weight.shape)}."
            )
    elif lm_head_bias is not None:
        raise ValueError("`lm_head_bias` is only used together with `lm_head_weight`; pass both or neither.")
    elif student.shape[-1] != vocab_size:
        raise ValueError(
            f"Student and teacher logits must share the vocabulary, got sizes {student.shape[-1]} and {vocab_size}."
        )
    if mask is not None:
        if tuple(mask.shape) != tuple(lead_shape):
            raise ValueError(f"`mask` must have shape {tuple(lead_shape)}, got {tuple(mask.shape)}.")
        mask = mask.to(torch.bool)
    if chunk_size is None:
        chunk_size = _default_chunk_rows(vocab_size)
    elif chunk_size < 1:
        raise ValueError(f"`chunk_size` must be a positive integer, got {chunk_size}.")
    return _ChunkedJSD.apply(
        student, lm_head_weight, lm_head_bias, teacher_logits, mask, float(beta), float(temperature), int(chunk_size)
    )


def _elementwise_generalized_jsd(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float, temperature: float
) -> torch.Tensor:
    """The divergence's per-vocabulary-entry terms (reduction "none"), which by definition are full-vocabulary."""
    log_s = torch.log_softmax(student_logits / temperature, dim=-1)
    log_t = torch.log_softmax(teacher_logits / temperature, dim=-1)
    return generalized_jsd_from_log_probs(log_s, log_t, beta)


def generalized_jsd_from_log_probs(log_s: torch.Tensor, log_t: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-entry terms of the generalized JSD from log-probabilities (not renormalised: GOLD applies it to the
    sub-vector of a shared vocabulary); summing over the last dimension gives the divergence."""
    zero = torch.zeros((), dtype=log_s.dtype, device=log_s.device)
    if beta == 0.0:
        return torch.where(log_t.exp() > 0, log_t.exp() * (log_t - log_s), zero)
    if beta == 1.0:
        return torch.where(log_s.exp() > 0, log_s.exp() * (log_s - log_t), zero)
    log_m = torch.logaddexp(log_s + math.log(1.0 - beta), log_t + math.log(beta))
    term_t = torch.where(log_t.exp() > 0, log_t.exp() * (log_t - log_m), zero)
    term_s = torch.where(log_s.exp() > 0, log_s.exp() * (log_s - log_m), zero)
    return beta * term_t + (1.0 - beta) * term_s


def generalized_jsd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    reduction: str = "batchmean",
    num_items_in_batch: int | torch.Tensor | None = None,
    *,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Generalized Jensen-Shannon divergence loss of GKD (Agarwal et al., 2024), with TRL's reductions.

    Args:
        student_logits: `(batch, seq, V)` student logits, already aligned with `labels` (shifted by the caller).
        teacher_logits: `(batch, seq, V)` teacher logits, aligned the same way.
        labels: Optional `(batch, seq)`; positions labelled -100 (prompt, padding) are left out.
        beta: 0 forward KL `KL(teacher || student)`, 1 reverse KL `KL(student || teacher)`, in between the
            beta-weighted JSD through the mixture `(1 - beta) p_student + beta p_teacher`.
        temperature: Both sides' logits are divided by it before the softmax.
        reduction: `"batchmean"`: sum over kept positions divided by their number (by the batch size without
            `labels`); `"sum"`; `"mean"`: divided by the number of kept `(position, vocabulary)` entries; `"none"`:
            the per-entry terms `(batch, seq, V)`, or `(kept positions, V)` with `labels`.
        num_items_in_batch: When given, the loss is the sum divided by it, whatever `reduction` says (gradient
            accumulation normalises by the token count of the whole accumulated batch).
        chunk_size: Positions processed together by the chunked computation; the result does not depend on it.

    Returns:
        The loss, in float32 (float64 for float64 inputs).
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"`reduction` must be one of {_REDUCTIONS}, got {reduction!r}.")
    _check_beta_temperature(beta, temperature)
    mask = None if labels is None else labels != -100
    if reduction == "none" and num_items_in_batch is None:
        compute_dtype = torch.promote_types(student_logits.dtype, torch.float32)
        terms = _elementwise_generalized_jsd(
            student_logits.to(compute_dtype), teacher_logits.to(compute_dtype), beta, temperature
        )
        return terms if mask is None else terms[mask]

    per_token = per_token_generalized_jsd(
        student_logits, teacher_logits, mask, beta=beta, temperature=temperature, chunk_size=chunk_size
    )
    total = per_token.sum()
    if num_items_in_batch is not None:
        return total / num_items_in_batch
    if reduction == "sum":
        return total
    kept = math.prod(student_logits.shape[:-1]) if mask is None else int(mask.sum())
    if kept == 0:
        return total  # nothing to average over: the (zero) sum, keeping the graph
    if reduction == "batchmean":
        return total / (student_logits.shape[0] if mask is None else kept)
    return total / (kept * student_logits.shape[-1])
