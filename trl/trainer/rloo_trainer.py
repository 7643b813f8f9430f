"""REINFORCE Leave-One-Out (RLOO) trainer.

Shares rollouts, rewards and logging with GRPO (see `online_base.py`). What differs: the KL divergence to the reference
model is subtracted from the reward (sequence level), the baseline of a completion is the mean reward of the other
completions of its prompt, and the policy loss uses one clipped importance ratio per sequence.
"""

from typing import Any

import torch
import torch.nn as nn
from datasets import Dataset, IterableDataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin, TrainerCallback

from ..models.peft import BF16_ADAPTERS
from .online_base import _OnlineTrainer
from .online_math import ADVANTAGE_EPS, aggregate_rewards, leave_one_out_advantages, masked_mean
from .online_rewards import RewardFunc
from .rloo_config import RLOOConfig
from .utils.forward_randomness import forward_is_deterministic


def rloo_sequence_loss(
    per_token_logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped REINFORCE loss with one importance ratio per sequence.

    `r = exp(sum_t logp - old_logps)` over the completion tokens, and the loss of a sequence is
    `-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)`. On-policy (`r = 1`) its gradient is the plain REINFORCE
    gradient `-A * sum_t grad logp`.

    Args:
        per_token_logps: `(B, T)` current log-probabilities (with gradient).
        old_logps: `(B,)` summed completion log-probabilities under the sampling policy (TRL's `old_logps`).
        advantages: `(B,)` advantages.
        mask: `(B, T)` completion mask.
        epsilon_low, epsilon_high: Clipping bounds.

    Returns:
        `(per_sequence_loss, ratio)`, both `(B,)`.
    """
    log_ratio = (per_token_logps * mask).sum(dim=1) - old_logps
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    return -torch.min(ratio * advantages, clipped * advantages), ratio


class RLOOTrainer(_OnlineTrainer):
    """Trainer for REINFORCE Leave-One-Out (RLOO).

    Example:

    ```python
    from trl import RLOOConfig, RLOOTrainer
    from trl.assets import get_model_path, load_test_dataset


    def reward_short(completions, **kwargs):
        return [-float(len(c)) for c in completions]


    trainer = RLOOTrainer(
        model=get_model_path("tiny-Qwen2ForCausalLM"),
        reward_funcs=reward_short,
        args=RLOOConfig(output_dir="rloo-out", per_device_train_batch_size=4, num_generations=4, max_steps=5),
        train_dataset=load_test_dataset("standard_prompt_only", split="train"),
    )
    trainer.train()
    ```

    Args:
        model (`str`, `PreTrainedModel` or `PeftModel`):
            Policy to train: a path or hub id (loaded with `args.model_init_kwargs`; float32 unless a dtype is given)
            or an instantiated causal language model.
        reward_funcs (`RewardFunc` or `list[RewardFunc]`):
            Reward functions and/or models, exactly as for [`GRPOTrainer`]: model paths/ids and sequence
            classification models are used as reward models; callables (sync or `async def`) receive `prompts`,
            `completions`, `completion_ids`, `trainer_state`, `log_extra`, `log_metric` and the other dataset columns
            as keyword arguments and return one float (or None) per completion.
        args (`RLOOConfig` or `None`, defaults to `None`):
            Training configuration. `None` builds `RLOOConfig(f"{model_name}-RLOO")`.
        train_dataset (`Dataset` or `IterableDataset`):
            Prompt-only data with a `prompt` column (text or chat messages); other columns go to the reward
            functions.
        eval_dataset (`Dataset`, `IterableDataset`, dict of them or `None`, defaults to `None`):
            Evaluation prompts.
        processing_class (`PreTrainedTokenizerBase` or `None`, defaults to `None`):
            Tokenizer; loaded from the model's path (left padding) when omitted.
        reward_processing_classes (`PreTrainedTokenizerBase`, a list of them or `None`, defaults to `None`):
            Tokenizers of the reward models, aligned with `reward_funcs`.
        callbacks (`list[TrainerCallback]` or `None`, defaults to `None`):
            Extra callbacks.
        optimizers (`tuple`, defaults to `(None, None)`):
            Optimizer and scheduler to use instead of the defaults.
        quantization_config (`BitsAndBytesConfig` or `None`, defaults to `None`):
            Quantization used when `model` is a string.
        peft_config (`PeftConfig` or `None`, defaults to `None`):
            Adapter configuration; the reference model is then the policy with adapters disabled.
    """

    _accepts_images = True

    _tag_names = ["trl", "rloo"]
    _name = "RLOO"
    _quantized_base = BF16_ADAPTERS
    _reference_copies_given_adapter = True
    _template_file = "lm_model_card.md"
    _paper = {
        "title": "Back to Basics: Revisiting REINFORCE-Style Optimization for Learning from Human Feedback in LLMs",
        "id": "2402.14740",
        "citation": (
            "@inproceedings{ahmadian2024back,\n"
            "    title        = {{Back to Basics: Revisiting REINFORCE-Style Optimization for Learning from Human "
            "Feedback in LLMs}},\n"
            "    author       = {Arash Ahmadian and Chris Cremer and Matthias Gall{\\'{e}} and Marzieh Fadaee and "
            'Julia Kreutzer and Olivier Pietquin and Ahmet {\\"{U}}st{\\"{u}}n and Sara Hooker},\n'
            "    year         = 2024,\n"
            "    booktitle    = {Proceedings of the 62nd Annual Meeting of the Association for Computational "
            "Linguistics (Volume 1: Long Papers)},\n"
            "}"
        ),
    }
    # As TRL: the Trainer divides RLOO's loss by the gradient accumulation steps (a `compute_loss` override inherits it).
    loss_is_scaled_for_ga = False
    # TRL's RLOO batch has no `num_items_in_batch` (its loss is a mean over sequences).
    _batch_counts_loss_tokens = False
    # Rewards after clipping and the KL penalty (what the leave-one-out baseline used), for `frac_reward_zero_std`.
    _shaped_rewards = None
    _config_class = RLOOConfig
    # As TRL: a metric undefined over the whole logging window (all-None rewards, no completion token) logs None.
    _undefined_metric_value = None

    def __init__(
        self,
        model: "str | PreTrainedModel | nn.Module",
        reward_funcs: RewardFunc | list[RewardFunc],
        args: RLOOConfig | None = None,
        train_dataset: Dataset | IterableDataset | None = None,
        eval_dataset: Dataset | IterableDataset | dict[str, Dataset | IterableDataset] | None = None,
        processing_class: PreTrainedTokenizerBase | ProcessorMixin | None = None,
        reward_processing_classes: PreTrainedTokenizerBase | list[PreTrainedTokenizerBase] | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
    ):
        super().__init__(
            model=model,
            reward_funcs=reward_funcs,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
        )
        self.beta = self.args.beta
        self.epsilon_low = self.args.epsilon
        self.epsilon_high = self.args.epsilon_high if self.args.epsilon_high is not None else self.args.epsilon

    # TRL's RLOO always scores the rollout with the policy (`old_logps` in the batch); on-policy without a KL penalty
    # this project skips that pass (the loss pass's detached values are the same), unless a subclass overrides a hook
    # that could see the difference, or the policy's forward draws random numbers (then the two passes differ).
    _hooks_seeing_rollout_logps = (
        "_generate_and_score_completions",
        "_get_per_token_logps_and_entropies",
        "compute_loss",
        "_compute_loss",
    )

    def _needs_rollout_logps(self) -> bool:
        # The KL penalty enters the reward, so the sampling policy's log-probabilities are needed right away.
        if self.args.beta != 0.0 or not self._is_on_policy() or not forward_is_deterministic(self.model):
            return True
        return self._overridden_since(RLOOTrainer, *self._hooks_seeing_rollout_logps)

    def _compute_rollout_logps(self, batch: dict[str, Any]) -> None:
        super()._compute_rollout_logps(batch)
        if "old_per_token_logps" in batch:  # TRL's key: each completion's summed log-probability at generation
            batch["old_logps"] = (batch["old_per_token_logps"] * batch["completion_mask"]).sum(dim=1)

    def _finish_rollout_batch(self, batch: dict[str, Any], rewards_per_func: torch.Tensor) -> dict[str, Any]:
        # The per-token values served the KL penalty in the advantages; the loss reads TRL's `old_logps` only.
        batch.pop("old_per_token_logps", None)
        batch.pop("ref_per_token_logps", None)
        return super()._finish_rollout_batch(batch, rewards_per_func)

    def _compute_advantages(self, rewards_per_func: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
        args = self.args
        rewards = aggregate_rewards(rewards_per_func, self.reward_weights.to(rewards_per_func.device))
        if args.reward_clip_range is not None:
            rewards = rewards.clamp(min=args.reward_clip_range[0], max=args.reward_clip_range[1])
        if args.beta != 0.0:
            mask = batch["completion_mask"].float()
            per_token_kl = batch["old_per_token_logps"] - batch["ref_per_token_logps"]
            sequence_kl = self.accelerator.gather((per_token_kl * mask).sum(dim=1))
            # Logged as TRL does: the mean per-token KL over all completion tokens (the reward uses sequence sums).
            num_tokens = self.accelerator.gather(mask.sum(dim=1)).sum()
            self._record_metric("kl", sequence_kl.sum() / num_tokens.clamp(min=1.0))
            rewards = rewards - args.beta * sequence_kl.to(rewards.device)
        self._shaped_rewards = rewards
        advantages = leave_one_out_advantages(rewards, self._group_size())
        if args.normalize_advantages:
            advantages = (advantages - advantages.mean()) / (advantages.std() + ADVANTAGE_EPS)
        return advantages

    def _rewards_for_zero_std(self, rewards: torch.Tensor) -> torch.Tensor:
        # As TRL: a group counts as zero-spread on the rewards the baseline uses (clipped, minus the KL penalty).
        shaped = self._shaped_rewards
        return shaped if shaped is not None and shaped.shape == rewards.shape else rewards

    def _compute_loss(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        logps, entropy, aux_loss = self._completion_logps(model, inputs, compute_entropy=True)
        mask = self._loss_mask(inputs).to(logps.dtype)
        advantages = inputs["advantages"].to(logps.dtype)
        old = inputs.get("old_logps")
        if old is None or (self._is_on_policy() and forward_is_deterministic(self.model)):
            # The data was sampled by exactly this policy: ratio 1, plain REINFORCE gradient.
            old = (logps.detach() * mask).sum(dim=1)
        per_sequence_loss, ratio = rloo_sequence_loss(
            logps, old, advantages, mask, self.epsilon_low, self.epsilon_high
        )
        loss = per_sequence_loss.mean() / self._gradient_accumulation_divisor()
        loss = self._add_aux_loss(loss, aux_loss)

        with torch.no_grad():
            self._record_metric("entropy", masked_mean(entropy.detach(), mask))
            low = (ratio < 1 - self.epsilon_low) & (advantages < 0)
            high = (ratio > 1 + self.epsilon_high) & (advantages > 0)
            # One ratio per completion, so each completion counts once (not weighted by its length), as in TRL.
            self._record_clip_metrics(low.unsqueeze(1), high.unsqueeze(1), torch.ones_like(mask[:, :1]))
        return loss
