"""Divergences restricted to a small support of tokens, for teachers that only report a few log-probabilities.

A teacher behind a vLLM server returns, per completion position, its top-k log-probabilities (and the log-probability
of the token actually in the sequence) instead of a full distribution. The losses of ServerDistillation, IW-OPD and
AsyncDistillation compare the student with such a teacher on a support `S` of a few token ids:

- the two distributions restricted to `S` either get one extra "tail" slot holding the mass outside `S`
  ([`add_tail_bucket`]) or are renormalised over `S` ([`renormalize_on_support`]);
- slots of `S` may be invalid (a padded top-k entry, a duplicate id); they contribute nothing
  ([`masked_sparse_divergence`]);
- with `beta > 0` and a server teacher the support is "top-1 sparse": the teacher's most likely token plus a reverse
  token (the realised completion token, or the student's argmax), see [`top1_sparse_support`].

`beta` follows the convention of [`~trl.trainer.utils.divergence.generalized_jsd_loss`]: 0 forward KL
`KL(p_T || p_S)`, 1 reverse KL `KL(p_S || p_T)`, in between the generalized JSD through the mixture
`m = (1 - beta) p_S + beta p_T`.
"""

import torch


__all__ = [
    "add_tail_bucket",
    "build_teacher_request_inputs",
    "masked_sparse_divergence",
    "pad_teacher_rows",
    "renormalize_on_support",
    "server_teacher_support",
    "sparse_support_divergence",
    "top1_sparse_support",
]

# The log of the support's mass never exceeds this, so the tail slot stays finite when the support holds all the mass.
_MAX_SUPPORT_LOG_MASS = -1e-7


def add_tail_bucket(log_probs: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Append the log of the probability mass outside a support: `log(1 - sum_v p_v)` as one more last-dim slot.

    Args:
        log_probs: `(..., K)` true log-probabilities on a support (their probabilities sum to at most 1).
        valid: Optional `(..., K)` bool mask; invalid slots do not count towards the support's mass.

    Returns:
        `(..., K + 1)` log-probabilities; the last slot is the tail (always valid). The log of the support's mass is
        clamped at `-1e-7` before the tail is taken.
    """
    masked = log_probs if valid is None else log_probs.masked_fill(~valid, float("-inf"))
    log_mass = torch.logsumexp(masked, dim=-1, keepdim=True).clamp(max=_MAX_SUPPORT_LOG_MASS)
    return torch.cat([log_probs, torch.log(-torch.expm1(log_mass))], dim=-1)


def renormalize_on_support(log_probs: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Log-softmax of the selected log-probabilities over the valid slots of the support (invalid slots -> -inf)."""
    masked = log_probs if valid is None else log_probs.masked_fill(~valid, float("-inf"))
    out = masked - torch.logsumexp(masked, dim=-1, keepdim=True)
    return out if valid is None else out.masked_fill(~valid, float("-inf"))


def masked_sparse_divergence(
    student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, valid: torch.Tensor, beta: float
) -> torch.Tensor:
    """Divergence of two distributions given on a support, summed over the valid slots.

    Args:
        student_log_probs: `(..., K)` student log-probabilities on the support.
        teacher_log_probs: `(..., K)` teacher log-probabilities on the same slots.
        valid: `(..., K)` bool mask; invalid slots (and any NaN term) contribute 0.
        beta: 0 forward KL, 1 reverse KL, otherwise the generalized JSD; `log m` is clamped at the dtype's smallest
            positive normal number.

    Returns:
        `(...)` divergences.
    """
    log_s, log_t = student_log_probs, teacher_log_probs
    if beta == 0.0:
        terms = log_t.exp() * (log_t - log_s)
    elif beta == 1.0:
        terms = log_s.exp() * (log_s - log_t)
    else:
        tiny = torch.finfo(log_s.dtype).tiny
        mixture = (1.0 - beta) * log_s.exp() + beta * log_t.exp()
        log_m = mixture.clamp(min=tiny).log()
        terms = beta * log_t.exp() * (log_t - log_m) + (1.0 - beta) * log_s.exp() * (log_s - log_m)
    terms = torch.where(valid, terms, torch.zeros_like(terms))
    return torch.nan_to_num(terms, nan=0.0).sum(dim=-1)


def top1_sparse_support(
    teacher_top1_ids: torch.Tensor,
    teacher_top1_log_probs: torch.Tensor,
    reverse_ids: torch.Tensor,
    reverse_teacher_log_probs: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The top-1 sparse support of one position: the teacher's top-1 token and a reverse token.

    The reverse token is the realised completion token (or the student's argmax). At `beta == 1` the support is the
    reverse token alone; otherwise it is `{top-1, reverse}` with the second slot invalid when both ids are equal.

    Args:
        teacher_top1_ids: `(...)` the teacher's most likely token per position.
        teacher_top1_log_probs: `(...)` the teacher's log-probability of it.
        reverse_ids: `(...)` the reverse token per position.
        reverse_teacher_log_probs: `(...)` the teacher's log-probability of the reverse token.
        beta: Divergence interpolation (see the module docstring).

    Returns:
        `(ids, teacher_log_probs, valid)`, each `(..., S)` with `S` 1 (at `beta == 1`) or 2.
    """
    if beta == 1.0:
        ids = reverse_ids.unsqueeze(-1)
        return ids, reverse_teacher_log_probs.unsqueeze(-1), torch.ones_like(ids, dtype=torch.bool)
    ids = torch.stack([teacher_top1_ids, reverse_ids], dim=-1)
    log_probs = torch.stack([teacher_top1_log_probs, reverse_teacher_log_probs], dim=-1)
    valid = torch.stack([torch.ones_like(reverse_ids, dtype=torch.bool), reverse_ids != teacher_top1_ids], dim=-1)
    return ids, log_probs, valid


def sparse_support_divergence(
    student_log_probs: torch.Tensor,
    support_ids: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    valid: torch.Tensor,
    beta: float,
    add_tail: bool = True,
) -> torch.Tensor:
    """Per-position divergence between the student's full distribution and a teacher known on a support.

    The student's log-probabilities are gathered on the support; both sides then get a tail bucket (`add_tail`) or
    are renormalised over the valid slots, and [`masked_sparse_divergence`] is taken.

    Args:
        student_log_probs: `(..., V)` student log-probabilities (log-softmax at the loss temperature).
        support_ids: `(..., K)` token ids of the support (any id in invalid slots).
        teacher_log_probs: `(..., K)` teacher log-probabilities on the support (true probabilities, not renormalised).
        valid: `(..., K)` bool mask of the usable slots.
        beta: Divergence interpolation (see the module docstring).
        add_tail: Keep the mass outside the support as one bucket instead of renormalising over it.

    Returns:
        `(...)` per-position divergences, differentiable with respect to `student_log_probs`.
    """
    vocab_size = student_log_probs.shape[-1]
    ids = support_ids.clamp(0, vocab_size - 1).long()
    student_on = student_log_probs.gather(-1, ids)
    teacher_on = teacher_log_probs.to(student_on.dtype)
    # Invalid slots hold -inf on both sides so that they carry no mass in the tail or the renormalisation.
    student_on = student_on.masked_fill(~valid, float("-inf"))
    teacher_on = teacher_on.masked_fill(~valid, float("-inf"))
    if add_tail:
        student_on, teacher_on = add_tail_bucket(student_on, valid), add_tail_bucket(teacher_on, valid)
        valid = torch.cat([valid, torch.ones_like(valid[..., :1])], dim=-1)
    else:
        student_on, teacher_on = renormalize_on_support(student_on, valid), renormalize_on_support(teacher_on, valid)
    return masked_sparse_divergence(student_on, teacher_on, valid, beta)


def build_teacher_request_inputs(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_attention_mask: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
) -> tuple[list[list[int]], list[int], list[int]]:
    """Unpadded token lists and prompt/completion lengths of a padded batch, for a teacher scoring request.

    Args:
        input_ids: `(B, L)` prompt + completion ids, padded on either side.
        attention_mask: `(B, L)` 1 on real tokens.
        prompt_attention_mask: Optional `(B, P)` mask of the prompts; a row's prompt length is its sum.
        labels: `(B, L)` labels, -100 outside the completion; used for the prompt length (real tokens minus labelled
            ones) when no `prompt_attention_mask` is given.

    Returns:
        `(sequences, prompt_lengths, completion_lengths)`, one entry per row.

    Raises:
        ValueError: On mismatched shapes, missing labels, or a prompt length outside `[0, sequence length]`.
    """
    if input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids and attention_mask must have the same shape, got {input_ids.shape} and {attention_mask.shape}."
        )
    if prompt_attention_mask is not None:
        if prompt_attention_mask.shape[0] != input_ids.shape[0]:
            raise ValueError(
                f"prompt_attention_mask has {prompt_attention_mask.shape[0]} rows but input_ids has "
                f"{input_ids.shape[0]}."
            )
        prompt_lengths = prompt_attention_mask.sum(dim=-1).tolist()
    else:
        if labels is None:
            raise ValueError(
                "labels are required when prompt_attention_mask is not provided. Pass labels (-100 outside the "
                "completion) or prompt_attention_mask to locate the prompts."
            )
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels must match input_ids shape, got {labels.shape} and {input_ids.shape}.")
        prompt_lengths = (attention_mask.sum(dim=-1) - (labels != -100).sum(dim=-1)).tolist()
    sequences, completion_lengths = [], []
    for row, (ids, mask) in enumerate(zip(input_ids.tolist(), attention_mask.bool().tolist(), strict=True)):
        tokens = [token for token, keep in zip(ids, mask, strict=True) if keep]
        prompt_length = int(prompt_lengths[row])
        if not 0 <= prompt_length <= len(tokens):
            raise ValueError(
                f"Invalid prompt length {prompt_length} for trimmed sequence of length {len(tokens)}. (Row {row}: a "
                "prompt cannot be longer than the row's real tokens; check the prompt mask or labels.)"
            )
        sequences.append(tokens)
        completion_lengths.append(len(tokens) - prompt_length)
    return sequences, [int(length) for length in prompt_lengths], completion_lengths


def pad_teacher_rows(rows: list[list], width: int, fill: float, dtype: torch.dtype, device=None) -> torch.Tensor:
    """Stack per-row sequences of per-position values (scalars or top-k lists, lists or arrays) into a tensor padded
    to `width` positions with `fill`."""
    tensors = [torch.as_tensor(row, dtype=dtype, device=device) for row in rows]
    tail_shape = next((tuple(t.shape[1:]) for t in tensors if t.numel()), ())
    out = torch.full((len(rows), width, *tail_shape), fill, dtype=dtype, device=device)
    for i, values in enumerate(tensors):
        length = min(values.shape[0] if values.dim() else 0, width)
        if length:
            out[i, :length] = values[:length]
    return out


def server_teacher_support(
    result: dict[str, list], completion_ids: torch.Tensor, mask: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The support a teacher server's scores define, in completion coordinates.

    Args:
        result: Output of `VLLMClient.get_sequence_logprobs` for the rows of `completion_ids` (per row, per completion
            position: `logprobs` / `logprob_token_ids` top-k lists and `actual_logprobs` of the realised token).
        completion_ids: `(B, T)` realised completion tokens (position 0 is each row's first completion token).
        mask: `(B, T)` bool, the positions the loss uses.
        beta: Divergence interpolation: 0 uses the teacher's top-k; otherwise the top-1 sparse support
            ([`top1_sparse_support`]) with the realised token as reverse token.

    Returns:
        `(support_ids, teacher_log_probs, valid)`, each `(B, T, S)`.

    Raises:
        ValueError: When `beta > 0` and the teacher's top-1 or realised-token log-probability is missing on a position
            of `mask`.
    """
    width, device = completion_ids.shape[1], completion_ids.device
    top_log_probs = pad_teacher_rows(result["logprobs"], width, float("-inf"), torch.float32, device)
    top_ids = pad_teacher_rows(result["logprob_token_ids"], width, 0, torch.long, device)
    if top_log_probs.dim() == 2:  # no position had a top-k list (empty completions)
        top_log_probs, top_ids = top_log_probs.unsqueeze(-1), top_ids.unsqueeze(-1)
    if beta == 0.0:
        return _neutralise_masked(top_ids, top_log_probs, torch.isfinite(top_log_probs), mask)
    actual = server_realised_log_probs(result, width, device)
    missing = mask & ~(torch.isfinite(actual) & torch.isfinite(top_log_probs[..., 0]))
    if missing.any():
        row, position = (int(i) for i in missing.nonzero()[0])
        raise ValueError(
            f"The teacher server returned no log-probability for completion token {position} of row {row} (its "
            "top-1 or the sampled token's). Check that the teacher serves the student's tokenizer and that its "
            "max_model_len covers prompt + completion."
        )
    return _neutralise_masked(
        *top1_sparse_support(top_ids[..., 0], top_log_probs[..., 0], completion_ids, actual, beta), mask
    )


def _neutralise_masked(
    ids: torch.Tensor, log_probs: torch.Tensor, valid: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Positions outside `mask` (padding, rows without completion) get a support of one valid slot of log-prob 0, so
    that the divergence there is finite and its (discarded) gradient is not NaN."""
    first = torch.zeros_like(valid)
    first[..., 0] = True
    keep = mask.unsqueeze(-1)
    log_probs = torch.where(keep, log_probs, torch.where(first, 0.0, float("-inf")).to(log_probs.dtype))
    return ids, log_probs, torch.where(keep, valid, first)


def server_realised_log_probs(result: dict[str, list], width: int, device=None) -> torch.Tensor:
    """`(B, width)` teacher log-probabilities of the realised completion tokens from a scoring result (-inf where the
    server reported none)."""
    actual = pad_teacher_rows(result["actual_logprobs"], width, float("-inf"), torch.float32, device)
    return actual[..., 0] if actual.dim() == 3 else actual  # one `[log-prob]` list per position
