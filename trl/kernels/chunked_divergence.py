"""`ChunkedDivergenceFunction`: TRL's per-token generalized Jensen-Shannon divergence between a student's and a
teacher's next-token distributions, computed from both models' final hidden states and LM heads, one block of tokens
at a time, so neither model's `(tokens, vocabulary)` logits exist for the whole batch.

With `p_S`, `p_T` the two softmaxes at the same temperature and `beta` in `[0, 1]`: `beta = 0` is the forward KL
`KL(p_T || p_S)`, `beta = 1` the reverse KL `KL(p_S || p_T)`, otherwise `beta * KL(p_T || m) + (1 - beta) *
KL(p_S || m)` with the mixture `m = (1 - beta) p_S + beta p_T`. The per-block maths (`_chunk_divergence`) is shared
with `trl.trainer.utils.divergence`, which computes the same divergence from logits.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .linear_log_softmax import _CHUNK_BYTES, _transform_logits


# TRL's tile sizes (token rows, vocabulary entries); here a block holds whole vocabulary rows, and the number of rows
# per block comes from a fixed memory budget (see `_rows_per_block`).
TOKEN_CHUNK_SIZE = 4096
VOCAB_CHUNK_SIZE = 32768
# Float32 vocabulary-sized tensors alive at once for one row of a block (both log-softmaxes, mixture, gradients).
_WORK_TENSORS_PER_ROW = 8


def _chunk_divergence(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    beta: float,
    temperature: float,
    want_student_grad: bool,
    want_teacher_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Per-row divergence of one chunk and, on request, its gradients with respect to each side's logits.

    Gradients follow from `d/dz_j f(log_softmax(z)) = g_j - p_j * sum_k g_k` with `g = df/d log p`; for the
    mixture terms `g = w * p * (log p - log m)` (the mixture's own dependence cancels), giving
    `w * p * (log p - log m - KL(p || m)) / T` for the side weighted by `w`.
    """
    compute_dtype = torch.promote_types(student_logits.dtype, torch.float32)
    log_s = torch.log_softmax(student_logits.to(compute_dtype) / temperature, dim=-1)
    log_t = torch.log_softmax(teacher_logits.to(compute_dtype) / temperature, dim=-1)
    p_s, p_t = log_s.exp(), log_t.exp()

    def kl(p: torch.Tensor, log_p: torch.Tensor, log_q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Terms with p == 0 contribute exactly 0 (avoids 0 * inf when a logit is -inf).
        terms = torch.where(p > 0, log_p - log_q, torch.zeros((), dtype=p.dtype, device=p.device))
        return terms, (p * terms).sum(-1, keepdim=True)

    grad_s = grad_t = None
    if beta == 0.0:
        terms_t, value = kl(p_t, log_t, log_s)
        if want_student_grad:
            grad_s = (p_s - p_t) / temperature
        if want_teacher_grad:
            grad_t = p_t * (terms_t - value) / temperature
    elif beta == 1.0:
        terms_s, value = kl(p_s, log_s, log_t)
        if want_student_grad:
            grad_s = p_s * (terms_s - value) / temperature
        if want_teacher_grad:
            grad_t = (p_t - p_s) / temperature
    else:
        log_m = torch.logaddexp(log_s + math.log(1.0 - beta), log_t + math.log(beta))
        terms_s, kl_s = kl(p_s, log_s, log_m)
        terms_t, kl_t = kl(p_t, log_t, log_m)
        value = beta * kl_t + (1.0 - beta) * kl_s
        if want_student_grad:
            grad_s = (1.0 - beta) * p_s * (terms_s - kl_s) / temperature
        if want_teacher_grad:
            grad_t = beta * p_t * (terms_t - kl_t) / temperature
    return value.squeeze(-1), grad_s, grad_t


def _rows_per_block(vocab_size: int) -> int:
    return max(1, min(TOKEN_CHUNK_SIZE, _CHUNK_BYTES // (max(vocab_size, 1) * 4 * _WORK_TENSORS_PER_ROW)))


def _project(hidden, weight, bias, logit_scale, softcap):
    """Logits of a block in float32 after the model's scale and soft cap (the temperature is applied later)."""
    return _transform_logits(F.linear(hidden, weight, bias), torch.float32, logit_scale, softcap)


def _transform_derivative(raw_logits, logit_scale, softcap):
    """d(transformed logit)/d(raw logit): `logit_scale`, times `1 - tanh^2` of the capped value with a soft cap."""
    if softcap is None:
        return None if logit_scale == 1.0 else logit_scale
    capped = torch.tanh(raw_logits.float() * logit_scale / softcap)
    return logit_scale * (1 - capped * capped)


class ChunkedDivergenceFunction(torch.autograd.Function):
    """Per-token divergence and student entropy from the student's and teacher's hidden states and LM heads.

    Use it through `apply`:

    ```python
    divergence, student_entropy = ChunkedDivergenceFunction.apply(
        student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, beta
    )
    ```

    Args (of `apply`):
        student_hidden: `(N, H_s)` student final hidden states.
        student_weight: `(V, H_s)` student LM-head weight.
        student_bias: `(V,)` student LM-head bias or `None`.
        teacher_hidden: `(N, H_t)` teacher final hidden states (the hidden sizes may differ; the vocabulary may not).
        teacher_weight: `(V, H_t)` teacher LM-head weight.
        teacher_bias: `(V,)` teacher LM-head bias or `None`.
        beta: 0 forward KL, 1 reverse KL, in between the beta-mixture JSD.
        temperature: Both sides' transformed logits are divided by it.
        student_logit_scale, student_final_logit_softcapping: The student head's logit transform (scale, then soft
            cap `c * tanh(z / c)`).
        teacher_logit_scale, teacher_final_logit_softcapping: The same for the teacher.

    Returns:
        `(divergence, student_entropy)`, each `(N,)` float32. Gradients flow to the student's hidden states, weight
        and bias through the divergence only; the entropy and the teacher get none.
    """

    @staticmethod
    def forward(
        ctx,
        student_hidden: torch.Tensor,
        student_weight: torch.Tensor,
        student_bias: torch.Tensor | None,
        teacher_hidden: torch.Tensor,
        teacher_weight: torch.Tensor,
        teacher_bias: torch.Tensor | None,
        beta: float,
        temperature: float = 1.0,
        student_logit_scale: float = 1.0,
        student_final_logit_softcapping: float | None = None,
        teacher_logit_scale: float = 1.0,
        teacher_final_logit_softcapping: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta must be in [0, 1] (0: forward KL, 1: reverse KL); got {beta}.")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0; got {temperature}.")
        if student_weight.shape[0] != teacher_weight.shape[0]:
            raise ValueError(
                f"Student and teacher must share the vocabulary; got {student_weight.shape[0]} and "
                f"{teacher_weight.shape[0]} rows in their LM heads."
            )
        rows = student_hidden.shape[0]
        student_transform = (float(student_logit_scale), student_final_logit_softcapping)
        teacher_transform = (float(teacher_logit_scale), teacher_final_logit_softcapping)
        block = _rows_per_block(student_weight.shape[0])
        divergence = student_hidden.new_zeros(rows, dtype=torch.float32)
        entropy = student_hidden.new_zeros(rows, dtype=torch.float32)
        with torch.no_grad():
            for start in range(0, rows, block):
                end = min(start + block, rows)
                student = _project(student_hidden[start:end], student_weight, student_bias, *student_transform)
                teacher = _project(teacher_hidden[start:end], teacher_weight, teacher_bias, *teacher_transform)
                divergence[start:end], _, _ = _chunk_divergence(student, teacher, beta, temperature, False, False)
                log_s = torch.log_softmax(student / temperature, dim=-1)
                entropy[start:end] = -(log_s.exp() * log_s).nan_to_num(0.0).sum(-1)
        ctx.save_for_backward(
            student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias
        )
        ctx.settings = (float(beta), float(temperature), student_transform, teacher_transform, block)
        ctx.mark_non_differentiable(entropy)
        ctx.set_materialize_grads(False)
        return divergence, entropy

    @staticmethod
    def backward(ctx, grad_divergence: torch.Tensor | None, _):
        student_hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias = ctx.saved_tensors
        beta, temperature, student_transform, teacher_transform, block = ctx.settings
        grads = [None] * 12
        if grad_divergence is None:
            return tuple(grads)
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(student_hidden, dtype=torch.float32) if need_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if need_bias and bias is not None else None
        for start in range(0, student_hidden.shape[0], block):
            end = min(start + block, student_hidden.shape[0])
            hidden = student_hidden[start:end]
            raw = F.linear(hidden, weight, bias)
            student = _transform_logits(raw, torch.float32, *student_transform)
            with torch.no_grad():
                teacher = _project(teacher_hidden[start:end], teacher_weight, teacher_bias, *teacher_transform)
            _, grad_logits, _ = _chunk_divergence(student, teacher, beta, temperature, True, False)
            grad_logits = grad_logits * grad_divergence[start:end, None].float()
            derivative = _transform_derivative(raw, *student_transform)
            if derivative is not None:
                grad_logits = grad_logits * derivative
            if grad_hidden is not None:
                grad_hidden[start:end] = grad_logits @ weight.float()
            if grad_weight is not None:
                grad_weight += grad_logits.T @ hidden.float()
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0)
        grads[0] = grad_hidden.to(student_hidden.dtype) if grad_hidden is not None else None
        grads[1] = grad_weight.to(weight.dtype) if grad_weight is not None else None
        grads[2] = grad_bias.to(bias.dtype) if grad_bias is not None else None
        return tuple(grads)
