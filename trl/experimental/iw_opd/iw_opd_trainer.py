"""IW-OPD building blocks: the importance-weighted on-policy distillation loss and the teacher request helper.

The trainer itself (`IWOPDTrainer`) is not built yet; see `docs/iw_opd.md`.
"""

import torch

from ...trainer.utils.sparse_divergence import build_teacher_request_inputs


__all__ = ["build_teacher_request_inputs", "iw_opd_loss"]


def iw_opd_loss(
    student_log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    sampler_log_probs: torch.Tensor | None,
    mask: torch.Tensor,
    gamma: float = 0.5,
    epsilon: float = 1e-8,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """IW-OPD loss on the sampled tokens of a batch, and its metrics.

    Per valid position `t` of a row: the advantage `a_t = sg(log pi_T(y_t) - log mu(y_t))` (`mu` the sampler, or the
    detached student when no sampler log-probs are given); the prefix weight `w_t = sg(1 + gamma (1 - P_t / S))` with
    `P_t` the sum of `|a_s|` over the row's earlier valid positions and `S = max(sum_s |a_s|, epsilon)`. The loss is
    `-sum_t w_t a_t log pi_theta(y_t) / N`, `N` being `num_items_in_batch` when given, else the number of valid
    positions.

    Args:
        student_log_probs: `(B, T)` student log-probabilities of the sampled tokens (differentiable).
        teacher_log_probs: `(B, T)` teacher log-probabilities of the same tokens.
        sampler_log_probs: `(B, T)` log-probabilities under the sampler (vLLM), or `None`.
        mask: `(B, T)` 1 on completion tokens in the loss.
        gamma: Prefix re-weighting strength (>= 0).
        epsilon: Floor of `S` (> 0).
        num_items_in_batch: Normaliser of the sum (the optimizer step's token count), or `None`.

    Returns:
        `(loss, metrics)`; metrics `mean_advantage`, `mean_abs_advantage`, `mean_weight`, `min_weight`, `max_weight`
        over the valid positions.

    Raises:
        ValueError: When the teacher log-probability of a valid position is missing (not finite).
    """
    valid = mask.bool()
    if (valid & ~torch.isfinite(teacher_log_probs)).any():
        raise ValueError(
            "The teacher log-probability of a sampled completion token is missing (not finite); IW-OPD needs one for "
            "every token in the loss."
        )
    behaviour = student_log_probs.detach() if sampler_log_probs is None else sampler_log_probs
    zeros = torch.zeros_like(student_log_probs)
    advantage = torch.where(valid, (teacher_log_probs - behaviour).detach(), zeros)
    magnitude = advantage.abs()
    prefix = magnitude.cumsum(dim=-1) - magnitude  # sum over the earlier positions only
    total = magnitude.sum(dim=-1, keepdim=True).clamp(min=epsilon)
    weight = (1.0 + gamma * (1.0 - prefix / total)).detach()
    terms = torch.where(valid, -weight * advantage * student_log_probs, zeros)
    count = valid.sum()
    normaliser = num_items_in_batch if num_items_in_batch is not None else count.clamp(min=1)
    loss = terms.sum() / normaliser
    n = count.clamp(min=1)
    kept_weight = weight[valid]
    metrics = {
        "mean_advantage": advantage.sum() / n,
        "mean_abs_advantage": magnitude.sum() / n,
        "mean_weight": kept_weight.sum() / n,
        "min_weight": kept_weight.min() if kept_weight.numel() else weight.new_tensor(float("nan")),
        "max_weight": kept_weight.max() if kept_weight.numel() else weight.new_tensor(float("nan")),
    }
    return loss, metrics
