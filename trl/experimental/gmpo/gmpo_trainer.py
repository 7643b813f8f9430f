"""GMPO: GRPO, except that each completion's objective uses the geometric mean of its clipped token ratios.

With `r_t = log pi(y_t) - log pi_old(y_t)`, each token's log-ratio is clipped to `[-eps_low, eps_high]` pessimistically
(the smaller of clipped and unclipped for a positive advantage, the larger otherwise), and the sequence ratio is
`rho_i = exp(mean_t r~_t)`, the geometric mean of the clipped ratios. The loss is `mean_i(-rho_i A_i + beta KL_i)`.
A geometric mean is less swayed by a few extreme tokens than GRPO's arithmetic mean, which allows a wider clipping
range (Zhao et al., 2025, https://huggingface.co/papers/2507.20673). Only `_compute_loss` differs from GRPO.
"""

from typing import Any

import torch
import torch.nn as nn

from ...trainer.grpo_trainer import GRPOTrainer
from ...trainer.online_math import k3_kl, masked_mean
from .gmpo_config import GMPOConfig


def gmpo_sequence_ratio(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Geometric mean of the pessimistically clipped token ratios of each sequence.

    `c_t = clamp(r_t, -epsilon_low, epsilon_high)`; `r~_t = min(r_t, c_t)` when `A > 0`, else `max(r_t, c_t)`;
    `rho = exp(sum_t mask * r~_t / max(sum_t mask, 1))`.

    Args:
        per_token_logps: `(B, T)` log-probabilities under the current policy (with gradient).
        old_per_token_logps: `(B, T)` log-probabilities under the sampling policy.
        advantages: `(B,)` advantages.
        mask: `(B, T)` tokens taken into the mean.
        epsilon_low, epsilon_high: Log-space clipping bounds.

    Returns:
        `(rho, stats)`: the `(B,)` sequence ratios, and `(B, T)` booleans `low_clipped` (`r_t < -epsilon_low` with
        `A < 0`) and `high_clipped` (`r_t > epsilon_high` with `A > 0`).
    """
    log_ratio = per_token_logps - old_per_token_logps
    adv = advantages.unsqueeze(1)
    clipped = log_ratio.clamp(-epsilon_low, epsilon_high)
    pessimistic = torch.where(adv > 0, torch.minimum(log_ratio, clipped), torch.maximum(log_ratio, clipped))
    mask = mask.to(log_ratio.dtype)
    mean_log = (pessimistic * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
    stats = {
        "low_clipped": (log_ratio < -epsilon_low) & (adv < 0),
        "high_clipped": (log_ratio > epsilon_high) & (adv > 0),
    }
    return torch.exp(mean_log), stats


class GMPOTrainer(GRPOTrainer):
    """GRPO trained with the GMPO objective (geometric mean of clipped token ratios per completion).

    Example:

    ```python
    from trl.assets import get_model_path, load_test_dataset
    from trl.experimental.gmpo import GMPOConfig, GMPOTrainer

    trainer = GMPOTrainer(
        model=get_model_path("tiny-Qwen2ForCausalLM"),
        reward_funcs=lambda completions, **kw: [float(len(set(c))) for c in completions],
        args=GMPOConfig(output_dir="gmpo-out", num_generations=8, max_steps=5),
        train_dataset=load_test_dataset("standard_prompt_only", split="train"),
    )
    trainer.train()
    ```

    Args:
        model: The policy, as for [`GRPOTrainer`].
        reward_funcs: Reward functions or models, as for [`GRPOTrainer`].
        args: A [`GMPOConfig`] (a [`GRPOConfig`] is accepted too); None gives `GMPOConfig("<model name>-GMPO")`.
        **kwargs: Every other [`GRPOTrainer`] argument (datasets, processing class, callbacks, PEFT, tools, ...).
    """

    _tag_names = ["trl", "gmpo"]
    _output_dir_suffix = "GMPO"  # the model card keeps GRPO's `_name` and paper, as TRL's

    @classmethod
    def _default_args(cls, config_class: type, model: Any) -> GMPOConfig:
        # `args=None` gives a GMPOConfig; a plain GRPOConfig is accepted too (its epsilon, 0.2, then applies).
        return super()._default_args(GMPOConfig, model)

    def __init__(self, model: Any, reward_funcs: Any, args: GMPOConfig | None = None, **kwargs: Any):
        super().__init__(model=model, reward_funcs=reward_funcs, args=args, **kwargs)

    def _compute_loss(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        if self.liger_grpo_loss is not None:
            return super()._compute_loss(model, inputs)
        logps, entropy, aux_loss, mask, advantages, old = self._policy_loss_inputs(model, inputs)
        token_mask = mask
        if self.args.top_entropy_quantile < 1.0:
            token_mask = mask * self._high_entropy_mask(entropy, mask)
        rho, stats = gmpo_sequence_ratio(logps, old, advantages, token_mask, self.epsilon_low, self.epsilon_high)
        per_sequence_loss = -rho * advantages
        per_token_kl = None
        if self.beta != 0.0:
            per_token_kl = k3_kl(logps, inputs["ref_per_token_logps"])
            per_sequence_loss = per_sequence_loss + self.beta * masked_mean(per_token_kl, mask, dim=1)
        loss = per_sequence_loss.mean() / self._gradient_accumulation_divisor()
        loss = self._add_aux_loss(loss, aux_loss)
        with torch.no_grad():
            if per_token_kl is not None:
                self._record_metric("kl", masked_mean(per_token_kl.detach(), mask))
            self._record_metric("entropy", masked_mean(entropy.detach(), mask))
            self._record_clip_metrics(stats["low_clipped"], stats["high_clipped"], mask)
        return loss
