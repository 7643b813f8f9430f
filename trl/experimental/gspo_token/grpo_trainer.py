"""GSPO-token: GRPO, except that `importance_sampling_level="sequence_token"` is also accepted.

With `s_i = mean_t(log pi(y_t) - log pi_old(y_t))` over completion `i`, GSPO-token weights token `t` by
`exp(log pi(y_t) - sg(log pi(y_t)) + sg(s_i))`: the value is the sequence ratio `exp(s_i)` (so clipping and the loss
value equal sequence-level GSPO), while the gradient flows through each token's own log-probability. With one
advantage per sequence the gradient equals GSPO's too; the variant matters once advantages vary per token
(Zheng et al., 2025, https://huggingface.co/papers/2507.18071). The ratio itself is `importance_log_weights` in
`trl.trainer.grpo_trainer`.
"""

from ...trainer.grpo_trainer import GRPOTrainer as _StableGRPOTrainer


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

    def _build_liger_loss(self, args):
        if args.use_liger_kernel and args.importance_sampling_level == "sequence_token":
            raise ValueError(
                "importance_sampling_level='sequence_token' (GSPO-token) is not supported by liger's fused GRPO loss. "
                "Set use_liger_kernel=False."
            )
        return super()._build_liger_loss(args)
