"""Parity cases: every DPO loss type under every f-divergence it accepts, with a reference that differs from the policy.

The plain `dpo/loss_type=*` cases start from a reference equal to the policy, where every log-ratio is 0: the loss
formulas are then only seen at one point (and, after one small step, close to it). Here the reference is the same
tiny model with its weights perturbed by a fixed seed, so log-ratios are a few nats from the first evaluation on;
`evaluate()` runs over two batches (batch statistics and any state carried between batches show), one train step
records the gradients, and `evaluate()` runs again. Each combination runs with the reference model scoring every batch
(`/ref_model`) and with its log-probabilities precomputed once (`/precompute`).
"""

from __future__ import annotations

from . import COMMON_ARGS, QWEN, register, run_trainer
from .offline import _DPO_LABEL_SMOOTHING, DPO_LOSS_TYPES


# The loss types that accept a non-default f_divergence_type (the others raise on it).
F_DIVERGENCE_LOSSES = {"sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft"}
F_DIVERGENCES = {
    "reverse_kl": {},
    "forward_kl": {},
    "js_divergence": {},
    # away from the default 0.5, where a coefficient read as alpha or as 1 - alpha gives the same loss
    "alpha_divergence": {"f_alpha_divergence_coef": 0.3},
}


def perturbed_reference(ctx, scale: float = 0.05):
    """The tiny policy model with every weight moved by `scale` times a fixed-seed Gaussian draw."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ctx.model(QWEN), dtype=torch.float32)
    generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            param.add_(torch.randn(param.shape, generator=generator) * scale)
    return model


def dpo_reference_case(ctx, loss_type, f_divergence_type: str, precompute: bool, **config) -> dict:
    """Evaluate, one train step, evaluate, with the perturbed reference (scoring each batch or precomputed)."""
    import trl

    options = dict(loss_type=loss_type, f_divergence_type=f_divergence_type, precompute_ref_log_probs=precompute)
    options.update(F_DIVERGENCES[f_divergence_type])
    args = trl.DPOConfig(output_dir=ctx.tmpdir(), **{**COMMON_ARGS, **options, **config})
    trainer = trl.DPOTrainer(
        model=ctx.model(QWEN),
        ref_model=perturbed_reference(ctx),
        args=args,
        train_dataset=ctx.dataset("standard_preference", "train", 8),
        eval_dataset=ctx.dataset("standard_preference", "test", 8),
    )
    return run_trainer(trainer)


for _loss in DPO_LOSS_TYPES:
    _extra = {"label_smoothing": _DPO_LABEL_SMOOTHING[_loss]} if _loss in _DPO_LABEL_SMOOTHING else {}
    for _f in F_DIVERGENCES if _loss in F_DIVERGENCE_LOSSES else ["reverse_kl"]:
        for _precompute, _how in ((False, "ref_model"), (True, "precompute")):
            register(
                f"dpo/reference/{_loss}/{_f}/{_how}",
                lambda ctx, loss=_loss, f=_f, pre=_precompute, extra=_extra: dpo_reference_case(
                    ctx, loss, f, pre, **extra
                ),
            )
# MPO (the combination the DPO docs show), where the bco_pair term's gradient is a fifth of the step's.
for _precompute, _how in ((False, "ref_model"), (True, "precompute")):
    register(
        f"dpo/reference/sigmoid+bco_pair+sft/reverse_kl/{_how}",
        lambda ctx, pre=_precompute: dpo_reference_case(
            ctx, ["sigmoid", "bco_pair", "sft"], "reverse_kl", pre, loss_weights=[0.8, 0.2, 1.0]
        ),
    )
# The reference pass in batches of another size than training's. (With the policy as its own reference, the rewards
# are 0 up to the float noise of each batch's padding, and `rewards/accuracies` counts that noise.)
register(
    "dpo/reference/sigmoid/reverse_kl/precompute/precompute_ref_batch_size=2",
    lambda ctx: dpo_reference_case(ctx, "sigmoid", "reverse_kl", True, precompute_ref_batch_size=2),
)
