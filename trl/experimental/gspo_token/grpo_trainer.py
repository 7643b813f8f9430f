"""GSPO-token: GRPO, except that `importance_sampling_level="sequence_token"` is also accepted.

With `s_i = mean_t(log pi(y_t) - log pi_old(y_t))` over completion `i`, GSPO-token weights token `t` by
`exp(log pi(y_t) - sg(log pi(y_t)) + sg(s_i))`: the value is the sequence ratio `exp(s_i)` (so clipping and the loss
value equal sequence-level GSPO), while the gradient flows through each token's own log-probability. With one
advantage per sequence the gradient equals GSPO's too; the variant matters once advantages vary per token
(Zheng et al., 2025, https://huggingface.co/papers/2507.18071). The ratio is `sequence_token_log_weights`, plugged
into the stable trainer's `_importance_log_weights` hook.
"""

import torch

from ...trainer.grpo_trainer import GRPOTrainer as _StableGRPOTrainer
from ...trainer.grpo_trainer import importance_log_weights


def sequence_token_log_weights(
    per_token_logps: torch.Tensor, old_per_token_logps: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """`(B, T)` GSPO-token log-ratios: the value `s` (masked mean of the token log-ratios) at every token, with the
    gradient of the token's own log-probability: `logp - sg(logp) + sg(s)`."""
    sequence = importance_log_weights(per_token_logps, old_per_token_logps, mask, "sequence")
    return per_token_logps - per_token_logps.detach() + sequence.detach()


class GRPOTrainer(_StableGRPOTrainer):
    """[`GRPOTrainer`] that also trains with `GRPOConfig(importance_sampling_level="sequence_token")` (GSPO-token).

    Example:

    ```python
    from trl import GRPOConfig
    from trl.assets import get_model_path, load_test_dataset
    from trl.experimental.gspo_token import GRPOTrainer

    trainer = GRPOTrainer(
        model=get_model_path("tiny-Qwen2ForCausalLM"),
        reward_funcs=lambda completions, **kw: [-float(len(c)) for c in completions],
        args=GRPOConfig(output_dir="gspo-token-out", importance_sampling_level="sequence_token", loss_type="grpo"),
        train_dataset=load_test_dataset("standard_prompt_only", split="train"),
    )
    trainer.train()
    ```

    Constructor arguments are those of [`GRPOTrainer`]. Liger's fused loss has no GSPO-token level, so
    `use_liger_kernel=True` with `"sequence_token"` is rejected.
    """

    _importance_sampling_levels = ("token", "sequence", "sequence_token")

    def _importance_log_weights(self, per_token_logps, old_per_token_logps, mask):
        if self.args.importance_sampling_level == "sequence_token":
            return sequence_token_log_weights(per_token_logps, old_per_token_logps, mask)
        return super()._importance_log_weights(per_token_logps, old_per_token_logps, mask)

    def _build_liger_loss(self, args):
        if args.use_liger_kernel and args.importance_sampling_level == "sequence_token":
            raise ValueError(
                "importance_sampling_level='sequence_token' (GSPO-token) is not supported by liger's fused GRPO loss. "
                "Set use_liger_kernel=False."
            )
        return super()._build_liger_loss(args)
