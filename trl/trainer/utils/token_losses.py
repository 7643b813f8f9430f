"""Token-level language-modelling losses as standalone functions, under the names TRL's `sft_trainer` module exports
(`dft_loss`, `_chunked_cross_entropy_loss`; re-exported from `trl.trainer.sft_trainer`).

[`SFTTrainer`] computes the same losses inside `compute_loss` on its fused LM head; the per-token DFT weighting is
[`dft_token_weights`] in both places.
"""

from typing import Any

import torch

from ...kernels.linear_log_softmax import linear_selective_log_softmax
from ...kernels.log_softmax import selective_log_softmax


def dft_token_weights(token_logps: torch.Tensor) -> torch.Tensor:
    """Dynamic Fine-Tuning's weight of each token's negative log-likelihood: its probability, without gradient."""
    return token_logps.detach().exp()


def _next_token_targets(labels: torch.Tensor) -> torch.Tensor:
    """`labels` moved one position left (position t is scored against token t + 1), -100 at the end."""
    return torch.nn.functional.pad(labels[..., 1:], (0, 1), value=-100)


def dft_loss(outputs: Any, labels: torch.Tensor, num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
    """Dynamic Fine-Tuning loss: each target token's negative log-likelihood weighted by its detached probability.

    Usable as a `compute_loss_func` of a transformers `Trainer`. Position `t` of the logits is scored against
    `labels[:, t + 1]`; labels of -100 are ignored.

    Args:
        outputs: The model's outputs (an object or dict with `logits` of shape `(batch, seq_len, vocab)`).
        labels: `(batch, seq_len)` token ids, -100 where no loss is taken.
        num_items_in_batch: Divide the summed loss by this count (the target tokens of the whole accumulated batch);
            by default, by the number of target tokens in `labels` (NaN when there is none, as in TRL).

    Returns:
        The scalar loss.
    """
    logits = outputs["logits"] if isinstance(outputs, dict) else outputs.logits
    targets = _next_token_targets(labels)
    mask = targets != -100
    token_logps = selective_log_softmax(logits, targets.clamp(min=0))
    loss_sum = -(token_logps * dft_token_weights(token_logps))[mask].sum()
    count = num_items_in_batch if num_items_in_batch is not None else mask.sum()
    return loss_sum / count


def _chunked_cross_entropy_loss(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    chunk_size: int,
    labels: torch.Tensor | None = None,
    shift_labels: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    logit_scale: float = 1.0,
    final_logit_softcapping: float | None = None,
    lm_head_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cross-entropy of the target tokens computed from the final hidden states, the LM head applied chunk by chunk.

    The `(tokens, vocab)` logits are never held in full (see `linear_selective_log_softmax`). The logits read are
    `logit_scale * (hidden @ weight.T + bias)`, soft-capped to `c * tanh(z / c)` when `final_logit_softcapping = c`.

    Args:
        hidden_states: `(batch, seq_len, hidden)` final hidden states.
        lm_head_weight: `(vocab, hidden)` output projection.
        chunk_size: Token positions per chunk of the LM head.
        labels: `(batch, seq_len)` token ids, -100 where ignored; position `t` is scored against `labels[:, t + 1]`.
        shift_labels: Already shifted targets `(batch, seq_len)` (position `t` against `shift_labels[:, t]`); used
            instead of `labels` when given.
        num_items_in_batch: Divide the summed loss by this count; by default by the number of targets (at least 1).
        logit_scale: Factor applied to the logits.
        final_logit_softcapping: Soft cap of the logits, or `None`.
        lm_head_bias: `(vocab,)` bias of the output projection, or `None`.

    Returns:
        `(loss, num_correct, entropy_sum, num_targets)`: the mean negative log-likelihood, the number of targets that
        are the argmax of their logits (float), the summed entropy of the predicted distributions at the targets
        (differentiable) and the number of targets (int64).

    Raises:
        ValueError: When neither `labels` nor `shift_labels` is given.
    """
    if shift_labels is None:
        if labels is None:
            raise ValueError("At least one of `labels` or `shift_labels` must be provided.")
        shift_labels = _next_token_targets(labels)
    mask = shift_labels != -100
    hidden = hidden_states[mask]
    targets = shift_labels[mask]

    def correct(logits: torch.Tensor, index: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"correct": (logits.argmax(dim=-1) == index).float()}

    token_logps, entropy, stats = linear_selective_log_softmax(
        hidden,
        lm_head_weight,
        targets,
        bias=lm_head_bias,
        compute_entropy=True,
        logits_stats_fn=correct,
        max_rows=chunk_size,
        logit_scale=logit_scale,
        final_logit_softcapping=final_logit_softcapping,
    )
    num_targets = mask.sum()
    loss_sum = -token_logps.sum()  # float32, float64 for float64 inputs
    count = num_items_in_batch if num_items_in_batch is not None else num_targets.clamp(min=1)
    num_correct = stats["correct"].sum() if "correct" in stats else token_logps.new_zeros(())  # no target: no chunk
    return loss_sum / count, num_correct.float(), entropy.sum(), num_targets
