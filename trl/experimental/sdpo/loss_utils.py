"""Self-distillation losses (shared with SDFT; see `trl.experimental._self_distillation.loss_utils`)."""

from .._self_distillation.loss_utils import (
    add_tail_bucket,
    apply_importance_sampling_clipping,
    compute_divergence,
    compute_full_logit_self_distillation_loss,
    compute_sampled_token_self_distillation_loss,
    compute_topk_self_distillation_loss,
)


__all__ = [
    "add_tail_bucket",
    "apply_importance_sampling_clipping",
    "compute_divergence",
    "compute_full_logit_self_distillation_loss",
    "compute_sampled_token_self_distillation_loss",
    "compute_topk_self_distillation_loss",
]
