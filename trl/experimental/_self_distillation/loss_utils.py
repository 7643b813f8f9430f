"""Per-token self-distillation losses shared by SDFT and SDPO.

`alpha` picks the divergence between the student `p_S` and the teacher `p_T` at a completion position: 0 is the
forward KL `KL(p_T || p_S)`, 1 the reverse KL `KL(p_S || p_T)`, and values in between the generalized Jensen-Shannon
divergence `alpha * KL(p_T || m) + (1 - alpha) * KL(p_S || m)` with the mixture `m = (1 - alpha) p_S + alpha p_T`.
"""

import torch
import torch.nn.functional as F

from ...trainer.utils.divergence import generalized_jsd_from_log_probs
from ...trainer.utils.sparse_divergence import add_tail_bucket


__all__ = [
    "add_tail_bucket",
    "apply_importance_sampling_clipping",
    "compute_divergence",
    "compute_full_logit_self_distillation_loss",
    "compute_sampled_token_self_distillation_loss",
    "compute_topk_self_distillation_loss",
    "token_log_probs",
]


def compute_divergence(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, alpha: float) -> torch.Tensor:
    """Divergence of two (log-)distributions over the last dimension, summed over it.

    Args:
        student_log_probs: `(..., V)` student log-probabilities.
        teacher_log_probs: `(..., V)` teacher log-probabilities (same support).
        alpha: 0 forward KL, 1 reverse KL, otherwise the generalized JSD (see the module docstring).

    Returns:
        `(...)` divergences.
    """
    if alpha in (0.0, 1.0):
        return generalized_jsd_from_log_probs(student_log_probs, teacher_log_probs, alpha).sum(dim=-1)
    # The mixture and the interpolation of the two KL terms are computed in this order (float32 log-weights,
    # log-sum-exp of the stacked weighted log-probabilities, per-entry `lerp`) because it rounds exactly as TRL does.
    log_weights = torch.tensor([1.0 - alpha, alpha], device=student_log_probs.device).log()
    weighted = torch.stack([student_log_probs + log_weights[0], teacher_log_probs + log_weights[1]])
    log_mixture = torch.logsumexp(weighted, dim=0)
    kl_teacher = F.kl_div(log_mixture, teacher_log_probs, reduction="none", log_target=True)
    kl_student = F.kl_div(log_mixture, student_log_probs, reduction="none", log_target=True)
    return torch.lerp(kl_student, kl_teacher, alpha).sum(dim=-1)


def apply_importance_sampling_clipping(
    per_token_loss: torch.Tensor, student_log_probs: torch.Tensor, old_log_probs: torch.Tensor, clip_coeff: float
) -> torch.Tensor:
    """Weight a per-token loss by the detached ratio `pi_S / pi_old`, capped at `clip_coeff`.

    `loss * min(exp(clamp(sg(log pi_S - log pi_old), -20, 20)), clip_coeff)`.
    """
    log_ratio = (student_log_probs.detach() - old_log_probs).clamp(-20.0, 20.0)
    return per_token_loss * torch.exp(log_ratio).clamp(max=clip_coeff)


class _GatheredLogProbs(torch.autograd.Function):
    """`logits.gather(-1, index) - logsumexp(logits)` with autograd's values and gradients, in one logits-sized
    buffer.

    The forward runs the plain expression's operations. Autograd's backward of it allocates the difference `logits -
    logsumexp`, its exponential, their product with the gradient and the gather's scattered gradient (four
    logits-sized tensors at once); this backward computes the same products in place in one buffer (bit for bit when
    `index` holds distinct entries per row, as a top-k support or a single token does).
    """

    @staticmethod
    def forward(ctx, logits, index):
        log_norm = torch.logsumexp(logits, dim=-1, keepdim=True)
        ctx.save_for_backward(logits, index, log_norm)
        return logits.gather(-1, index) - log_norm

    @staticmethod
    def backward(ctx, grad):
        logits, index, log_norm = ctx.saved_tensors
        # As autograd: the log-sum-exp's gradient -sum(grad) * exp(logits - logsumexp), plus grad at the gathered
        # entries.
        grad_logits = (logits - log_norm).exp_().mul_(grad.sum(dim=-1, keepdim=True).neg_())
        return grad_logits.scatter_add_(-1, index, grad), None


def gathered_log_probs(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`log softmax(logits)` at `index` (`(..., K)`), as the gathered logits minus the log-sum-exp of their row.

    Computed in this order (not as a full log-softmax followed by a gather) so that the float rounding is TRL's; with
    gradients the backward holds one logits-sized buffer ([`_GatheredLogProbs`]).
    """
    if torch.is_grad_enabled() and logits.requires_grad:
        return _GatheredLogProbs.apply(logits, index)
    return logits.gather(-1, index) - torch.logsumexp(logits, dim=-1, keepdim=True)


def token_log_probs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """`log softmax(logits)[token]` per position, as the token's logit minus the log-sum-exp of its row
    ([`gathered_log_probs`]); the sampled-token loss subtracts two such values, which magnifies any rounding
    difference from TRL's order."""
    return gathered_log_probs(logits, token_ids.unsqueeze(-1)).squeeze(-1)


def _support_log_probs(
    student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, add_tail: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two distributions restricted to a support: with a tail bucket for the rest, or renormalised on it."""
    if add_tail:
        return add_tail_bucket(student_log_probs), add_tail_bucket(teacher_log_probs)
    return _renormalised(student_log_probs), _renormalised(teacher_log_probs)


def _renormalised(log_probs: torch.Tensor) -> torch.Tensor:
    """Log-probabilities renormalised over the last dimension, as `x - logsumexp(x)` (TRL's rounding)."""
    return log_probs - torch.logsumexp(log_probs, dim=-1, keepdim=True)


def compute_topk_self_distillation_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    *,
    distillation_topk: int,
    distillation_alpha: float,
    distillation_add_tail: bool,
) -> torch.Tensor:
    """Divergence on the student's `distillation_topk` most likely tokens of each position.

    Both models' true log-probabilities are gathered there, then either a tail bucket is added for the remaining mass
    or they are renormalised over the support, and [`compute_divergence`] is taken.

    Args:
        student_logits: `(B, T, V)` student logits (already divided by the temperature).
        teacher_logits: `(B, T, V)` teacher logits (same).
        distillation_topk: Support size per position.
        distillation_alpha: See [`compute_divergence`].
        distillation_add_tail: Keep the mass outside the support as one bucket instead of renormalising.

    Returns:
        `(B, T)` per-token losses.
    """
    support = student_logits.detach().topk(distillation_topk, dim=-1).indices
    # A gathered logit minus its row's log-sum-exp (not a gathered log-softmax): TRL's rounding.
    student_on, teacher_on = _support_log_probs(
        gathered_log_probs(student_logits, support), gathered_log_probs(teacher_logits, support), distillation_add_tail
    )
    return compute_divergence(student_on, teacher_on, distillation_alpha)


def compute_full_logit_self_distillation_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, *, distillation_alpha: float
) -> torch.Tensor:
    """[`compute_divergence`] over the whole vocabulary; `(B, T)` per-token losses."""
    return compute_divergence(
        student_logits.log_softmax(dim=-1), teacher_logits.log_softmax(dim=-1), distillation_alpha
    )


def compute_sampled_token_self_distillation_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    completion_ids: torch.Tensor,
    *,
    distillation_alpha: float,
) -> torch.Tensor:
    """Reverse KL estimated on the sampled tokens: `sg(log p_S(y) - log p_T(y)) * log p_S(y)` per token.

    Its gradient is the sampled reverse-KL policy gradient; only `distillation_alpha == 1` (reverse KL) is defined.

    Raises:
        ValueError: When `distillation_alpha` is not 1.
    """
    if distillation_alpha != 1.0:
        raise ValueError(
            "Only reverse KL (alpha=1.0) is supported for token-level distillation when "
            f"`distillation_mode='sampled_token'`, got alpha={distillation_alpha}"
        )
    student = token_log_probs(student_logits, completion_ids)
    teacher = token_log_probs(teacher_logits, completion_ids)
    return (student - teacher).detach() * student
