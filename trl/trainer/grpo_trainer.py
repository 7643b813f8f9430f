"""Group Relative Policy Optimization (GRPO) trainer.

The rollout, reward and logging machinery is shared with RLOO (see `online_base.py`); this module adds the
group-relative advantages and the GRPO family of clipped policy losses (GRPO, DAPO, Dr. GRPO, BNPO, CISPO, SAPO,
LUSPO, VESPO), the k3 KL penalty, GSPO sequence-level ratios, entropy-based token selection and the entropy bonus.
"""

import json
import math
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from datasets import Dataset, IterableDataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin, TrainerCallback

from ..models.peft import BF16_ADAPTERS
from .grpo_config import GRPOConfig
from .online_base import _OnlineTrainer
from .online_math import ADVANTAGE_EPS, aggregate_rewards, group_advantages, k3_kl, masked_mean
from .online_rewards import RewardFunc
from .tool_calling import _ToolCallingMixin
from .utils import nanstd


ENTROPY_STATE_FILE = "entropy_ctrl_state.json"


# ---------------------------------------------------------------------------------------------------------------------
# Pure functions (the loss, tested against hand-written formulas)
# ---------------------------------------------------------------------------------------------------------------------
def normalize_then_sum_advantages(
    rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int, eps: float = ADVANTAGE_EPS
) -> torch.Tensor:
    """GDPO-style advantages: normalise each reward within its group, sum with weights, standardise over the batch.

    NaN rewards (a function that did not apply) contribute 0 after the per-group normalisation.

    Args:
        rewards_per_func: `(N, F)` rewards.
        weights: `(F,)` reward weights.
        num_generations: Group size G.
        eps: Added to every standard deviation.

    Returns:
        `(N,)` advantages.
    """
    num, funcs = rewards_per_func.shape
    grouped = rewards_per_func.view(-1, num_generations, funcs)
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    std = nanstd(grouped, dim=1, keepdim=True)
    normalised = torch.nan_to_num((grouped - mean) / (std + eps), nan=0.0).view(num, funcs)
    summed = (normalised * weights.to(normalised).unsqueeze(0)).sum(dim=1)
    return (summed - summed.mean()) / (summed.std() + eps)


def importance_log_weights(
    per_token_logps: torch.Tensor, old_per_token_logps: torch.Tensor, mask: torch.Tensor, level: str = "token"
) -> torch.Tensor:
    """Log importance ratios: per token `(B, T)`, or per sequence `(B, 1)` as the masked mean of the token log-ratios
    (GSPO). Other levels are a subclass's (`GRPOTrainer._importance_log_weights`)."""
    log_ratio = per_token_logps - old_per_token_logps
    if level == "token":
        return log_ratio
    if level == "sequence":
        return masked_mean(log_ratio, mask, dim=1).unsqueeze(1)
    raise ValueError(f"importance_sampling_level must be 'token' or 'sequence'; got {level!r}.")


@torch.no_grad()
def vespo_gamma_weights(
    advantages: torch.Tensor,
    log_ratio_per_token: torch.Tensor,
    mask: torch.Tensor,
    importance_sampling_ratio: torch.Tensor | None,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
) -> torch.Tensor:
    """VESPO weight of each sequence: the gamma-shaped `phi(w) = w^k * exp(lambda * (1 - w))` of its importance ratio.

    The sequence log-ratio is `l = sum_t mask * clamp(log_ratio, -20, 20)`, plus `sum_t clamp(log rho_t, log 1e-8, 20)`
    when a per-token sampler correction `rho` is given (masked positions carry `rho = 1`), so the correction is folded
    into the weight instead of multiplying the loss. Then `log w = clamp(l, log 1e-8, 20)` and
    `phi = exp(lambda + k * log w - lambda * w)`, which is 1 on-policy (`w = 1`) and decays smoothly for far off-policy
    sequences. `(k, lambda)` is `(k_pos, lambda_pos)` for a non-negative advantage, else `(k_neg, lambda_neg)`;
    `lambda` is floored at 1e-4. Non-finite weights become 0. No gradient flows through the result.

    Args:
        advantages: `(B, 1)` (or `(B,)`) advantages.
        log_ratio_per_token: `(B, T)` log-ratios of the current to the sampling policy.
        mask: `(B, T)` completion mask.
        importance_sampling_ratio: Optional `(B, T)` sampler (vLLM) correction ratios.
        k_pos, lambda_pos: Exponent and decay for non-negative advantages.
        k_neg, lambda_neg: Exponent and decay for negative advantages.

    Returns:
        `(B, 1)` weights.
    """
    log_floor = math.log(1e-8)
    seq_log_ratio = (mask * log_ratio_per_token.clamp(-20.0, 20.0)).sum(dim=-1, keepdim=True)
    if importance_sampling_ratio is not None:
        log_rho = torch.log(importance_sampling_ratio).clamp(log_floor, 20.0)
        seq_log_ratio = seq_log_ratio + log_rho.sum(dim=-1, keepdim=True)
    log_w = seq_log_ratio.clamp(log_floor, 20.0)
    adv = advantages.reshape(-1, 1)
    non_negative = adv >= 0
    k = torch.where(non_negative, torch.full_like(log_w, k_pos), torch.full_like(log_w, k_neg))
    lam = torch.where(non_negative, torch.full_like(log_w, lambda_pos), torch.full_like(log_w, lambda_neg))
    lam = lam.clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)


def grpo_per_token_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    delta: float | None = None,
    importance_sampling_level: str = "token",
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_params: tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0),
    log_weights: torch.Tensor | None = None,
    importance_sampling_ratio: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token policy loss of the GRPO family, before masking/normalisation (KL and entropy terms excluded).

    With `r` the importance ratio (per token or per sequence) and `A` the advantage:

    - grpo, dapo, dr_grpo, bnpo, luspo: `-min(r' A, clip(r, 1 - eps_low, 1 + eps_high) A)`, where `r' = min(r, delta)`
      when `delta` is set and `r' = r` otherwise;
    - cispo: `-sg(min(r, eps_high)) * A * logp` (REINFORCE with a clipped, detached importance weight; here
      `eps_high` is the cap itself, epsilon_max);
    - sapo: `-sigmoid(tau (r - 1)) * 4 / tau * A`, `tau` chosen by the sign of `A` (a soft trust region whose
      gradient at `r = 1` is the plain policy gradient);
    - vespo: `-sg(phi(w)) * A * logp` with `phi` from [`vespo_gamma_weights`] of the sequence ratio `w` (the
      sampler correction `importance_sampling_ratio`, when given, is folded into `w`).

    Args:
        per_token_logps: `(B, T)` log-probabilities under the current policy (with gradient).
        old_per_token_logps: `(B, T)` log-probabilities under the policy that sampled the data.
        advantages: `(B,)` advantages.
        mask: `(B, T)` completion mask.
        loss_type: One of grpo, dapo, dr_grpo, bnpo, cispo, sapo, luspo, vespo.
        epsilon_low, epsilon_high: Clipping bounds.
        delta: Optional cap of the unclipped ratio.
        importance_sampling_level: `"token"` or `"sequence"`.
        sapo_temperature_pos, sapo_temperature_neg: SAPO gate temperatures.
        vespo_params: `(k_pos, lambda_pos, k_neg, lambda_neg)`.
        log_weights: The log importance ratios, when the caller computed them (another level); by default
            [`importance_log_weights`] at `importance_sampling_level`.
        importance_sampling_ratio: `(B, T)` sampler correction, used by vespo only (the caller multiplies the other
            losses by it).

    Returns:
        `(per_token_loss, ratio, stats)`: the `(B, T)` loss, the ratio `r` (`(B, T)` or `(B, 1)`), and boolean/float
        tensors for metrics (`low_clipped`, `high_clipped`, and `cispo_clipped` / `vespo_phi` when relevant).
    """
    adv = advantages.unsqueeze(1)
    if log_weights is None:
        log_weights = importance_log_weights(per_token_logps, old_per_token_logps, mask, importance_sampling_level)
    ratio = torch.exp(log_weights)
    clipped_objective = loss_type in ("grpo", "dapo", "dr_grpo", "bnpo", "luspo")
    # TRL counts clipping on the delta-capped ratio (the same as on the ratio itself unless delta < 1 + epsilon_high).
    capped = torch.clamp(ratio, max=delta) if delta is not None and clipped_objective else ratio
    stats = {
        "low_clipped": (capped < 1 - epsilon_low) & (adv < 0),
        "high_clipped": (capped > 1 + epsilon_high) & (adv > 0),
    }
    if clipped_objective:
        clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
        per_token_loss = -torch.min(capped * adv, clipped * adv)
    elif loss_type == "cispo":
        weight = torch.clamp(ratio, max=epsilon_high).detach()
        # Counted where the cap binds on a positive advantage (TRL's `cispo_clip_ratio`).
        stats["cispo_clipped"] = (ratio > epsilon_high) & (adv > 0)
        per_token_loss = -weight * adv * per_token_logps
    elif loss_type == "sapo":
        tau = torch.where(
            adv > 0, torch.full_like(adv, sapo_temperature_pos), torch.full_like(adv, sapo_temperature_neg)
        )
        gate = torch.sigmoid(tau * (ratio - 1)) * 4.0 / tau
        per_token_loss = -gate * adv
    elif loss_type == "vespo":
        log_ratio = per_token_logps.detach() - old_per_token_logps
        phi = vespo_gamma_weights(adv, log_ratio, mask, importance_sampling_ratio, *vespo_params)
        stats["vespo_phi"] = phi
        # REINFORCE form: the detached weight times the advantage times the log-probability (its value is that of
        # the weighted log-likelihood, as TRL logs it; on-policy its gradient equals the clipped objectives').
        per_token_loss = -phi * adv * per_token_logps
    else:
        raise ValueError(f"Unknown loss_type {loss_type!r}.")
    per_token_loss = per_token_loss.expand_as(per_token_logps)
    return per_token_loss, ratio, stats


def normalize_per_token_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    gradient_accumulation_steps: float = 1.0,
    num_items_in_batch: float | torch.Tensor | None = None,
    num_processes: int = 1,
    max_completion_length: int | None = None,
) -> torch.Tensor:
    """Reduce a `(B, T)` per-token loss to a scalar with the normalisation of `loss_type`.

    - grpo, sapo: mean over sequences of each sequence's token mean, divided by `gradient_accumulation_steps`;
    - bnpo: sum over tokens / tokens of this micro-batch, divided by `gradient_accumulation_steps`;
    - dr_grpo: sum over tokens / (`B * max_completion_length`), divided by `gradient_accumulation_steps`;
    - luspo: mean over sequences of each sequence's token sum, divided by `gradient_accumulation_steps`;
    - dapo, cispo, vespo: sum over tokens / (`num_items_in_batch / num_processes`), where `num_items_in_batch` counts
      the completion tokens of the whole optimizer step on all processes (exactly gradient-accumulation invariant).
    """
    mask = mask.to(per_token_loss.dtype)
    masked = per_token_loss * mask
    if loss_type in ("grpo", "sapo"):
        loss = (masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).mean()
        return loss / gradient_accumulation_steps
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0) / gradient_accumulation_steps
    if loss_type == "dr_grpo":
        length = max_completion_length if max_completion_length is not None else per_token_loss.shape[1]
        return masked.sum() / (per_token_loss.shape[0] * length) / gradient_accumulation_steps
    if loss_type == "luspo":
        return masked.sum(dim=1).mean() / gradient_accumulation_steps
    if loss_type in ("dapo", "cispo", "vespo"):
        if num_items_in_batch is None:
            return masked.sum() / mask.sum().clamp(min=1.0) / gradient_accumulation_steps
        normaliser = torch.as_tensor(num_items_in_batch, dtype=per_token_loss.dtype, device=per_token_loss.device)
        return masked.sum() / (normaliser / num_processes).clamp(min=1.0)
    raise ValueError(f"Unknown loss_type {loss_type!r}.")


def importance_sampling_correction(
    old_per_token_logps: torch.Tensor,
    sampling_per_token_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> torch.Tensor:
    """Weights correcting for a sampler whose probabilities differ from the trainer's (e.g. vLLM).

    The ratio `pi_trainer / pi_sampler` is taken per token (`token_*`) or per sequence (`sequence_*`, product over
    the completion), then clipped to `[clip_min, clip_max]` (`*_truncate`) or zeroed outside it (`*_mask`).

    Returns:
        `(B, T)` or `(B, 1)` weights.
    """
    log_diff = (old_per_token_logps - sampling_per_token_logps) * mask
    if mode.startswith("token"):
        ratio = torch.exp(log_diff)
    else:
        ratio = torch.exp(log_diff.sum(dim=1, keepdim=True))
    if mode.endswith("truncate"):
        return ratio.clamp(min=clip_min, max=clip_max)
    keep = torch.ones_like(ratio, dtype=torch.bool)
    if clip_min is not None:
        keep &= ratio >= clip_min
    if clip_max is not None:
        keep &= ratio <= clip_max
    return ratio * keep


# ---------------------------------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------------------------------
class GRPOTrainer(_ToolCallingMixin, _OnlineTrainer):
    """Trainer for Group Relative Policy Optimization (GRPO) and its variants (DAPO, Dr. GRPO, GSPO, CISPO, ...).

    Example:

    ```python
    from trl import GRPOConfig, GRPOTrainer
    from trl.assets import get_model_path, load_test_dataset


    def reward_short(completions, **kwargs):
        return [-float(len(c)) for c in completions]


    trainer = GRPOTrainer(
        model=get_model_path("tiny-Qwen2ForCausalLM"),
        reward_funcs=reward_short,
        args=GRPOConfig(output_dir="grpo-out", per_device_train_batch_size=4, num_generations=4, max_steps=5),
        train_dataset=load_test_dataset("standard_prompt_only", split="train"),
    )
    trainer.train()
    ```

    Args:
        model (`str`, `PreTrainedModel` or `PeftModel`):
            Policy to train: a path or hub id (loaded with `args.model_init_kwargs`; float32 unless a dtype is given)
            or an instantiated causal language model.
        reward_funcs (`RewardFunc` or `list[RewardFunc]`):
            Reward functions and/or models. A string is loaded as `AutoModelForSequenceClassification` with
            `num_labels=1`; a model instance is used as a reward model (its first logit is the reward); a callable
            (sync or `async def`) is called with keyword arguments `prompts`, `completions`, `completion_ids`,
            `trainer_state`, `log_extra`, `log_metric` and every other dataset column, and returns one float (or None
            when it does not apply) per completion. Rewards are combined with `args.reward_weights`.
        args (`GRPOConfig` or `None`, defaults to `None`):
            Training configuration. `None` builds `GRPOConfig(f"{model_name}-GRPO")`.
        train_dataset (`Dataset` or `IterableDataset`):
            Prompt-only data: a `prompt` column (text, or a list of chat messages rendered with the chat template).
            Other columns are passed to the reward functions.
        eval_dataset (`Dataset`, `IterableDataset`, dict of them or `None`, defaults to `None`):
            Evaluation prompts.
        processing_class (`PreTrainedTokenizerBase` or `None`, defaults to `None`):
            Tokenizer; loaded from the model's path (left padding) when omitted.
        reward_processing_classes (`PreTrainedTokenizerBase`, a list of them or `None`, defaults to `None`):
            Tokenizers of the reward models, aligned with `reward_funcs` (ignored for callables). Loaded from each
            reward model's path when omitted.
        callbacks (`list[TrainerCallback]` or `None`, defaults to `None`):
            Extra callbacks.
        optimizers (`tuple`, defaults to `(None, None)`):
            Optimizer and scheduler to use instead of the defaults.
        quantization_config (`BitsAndBytesConfig` or `None`, defaults to `None`):
            Quantization used when `model` is a string.
        peft_config (`PeftConfig` or `None`, defaults to `None`):
            Adapter configuration; the reference model is then the policy with adapters disabled.
        tools (`list[Callable]` or `None`, defaults to `None`):
            Functions the model may call (sync or `async def`), each with type hints and a Google-style docstring;
            their schemas are rendered by the chat template. Tool calls are parsed from every finished turn, executed,
            and their results appended as `tool` messages before the row is generated again, up to
            `args.max_tool_calling_iterations` rounds. Tool-result tokens are excluded from the loss. Needs
            conversational prompts and a chat template that supports tool calling; not combinable with
            `rollout_func`.
        rollout_func (`Callable` or `None`, defaults to `None`):
            Replaces generation: `rollout_func(prompts, trainer)` receives the (repeated) prompts and returns a dict
            with `prompt_ids`, `completion_ids` and optionally `logprobs` (per-token sampling log-probabilities, used
            for importance-sampling correction); other keys are passed to the reward functions.
        environment_factory (`Callable`, `dict[str, Callable]` or `None`, defaults to `None`):
            Builds an environment per generated row (a dict maps names to factories, chosen by the dataset column
            `environment`). Before each rollout `env.reset(**row)` is called (keyword arguments it accepts, from the
            row's columns); a non-None return value is appended to the last user message. The environment's public
            methods (other than `reset` and `get_reward`) become that row's tools. If it defines `get_reward()`, a
            reward function named after the environment class is added. Reward functions also receive
            `environments` (one instance per completion). Without `train_dataset`, every prompt comes from `reset()`
            and `args.max_steps` must be set.
    """

    _accepts_images = True

    _tag_names = ["trl", "grpo"]
    _name = "GRPO"
    _quantized_base = BF16_ADAPTERS
    _reference_copies_given_adapter = True
    _template_file = "lm_model_card.md"
    _paper = {
        "title": "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models",
        "id": "2402.03300",
        "citation": (
            "@article{shao2024deepseekmath,\n"
            "    title        = {{DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models}},\n"
            "    author       = {Zhihong Shao and Peiyi Wang and Qihao Zhu and Runxin Xu and Junxiao Song and "
            "Mingchuan Zhang and Y. K. Li and Y. Wu and Daya Guo},\n"
            "    year         = 2024,\n"
            "    eprint       = {arXiv:2402.03300},\n"
            "}"
        ),
    }
    _config_class = GRPOConfig
    # As TRL: a metric undefined over the whole logging window (all-None rewards, no completion token) logs None.
    _undefined_metric_value = None
    # Ratio levels this trainer trains with (the GSPO-token subclass adds "sequence_token").
    _importance_sampling_levels = ("token", "sequence")
    _single_turn_takes_num_generations = True
    liger_grpo_loss = None
    _uncalled_trl_hooks = {
        "_tool_call_loop": "from _generate for each tool-calling rollout",
        "_get_tool_suffix_ids": "from _tool_call_loop to tokenize the text around tool results",
    }
    _last_world_entropy: float | None = None
    _generate_outputs = (
        "prompt_ids",
        "completion_ids",
        "tool_mask",
        "completions",
        "sampling_logps",
        "extra_fields",
        "images",
        "tool_images",
    )

    def __init__(
        self,
        model: "str | PreTrainedModel | nn.Module",
        reward_funcs: RewardFunc | list[RewardFunc] | None = None,
        args: GRPOConfig | None = None,
        train_dataset: Dataset | IterableDataset | None = None,
        eval_dataset: Dataset | IterableDataset | dict[str, Dataset | IterableDataset] | None = None,
        processing_class: PreTrainedTokenizerBase | ProcessorMixin | None = None,
        reward_processing_classes: PreTrainedTokenizerBase | list[PreTrainedTokenizerBase] | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
        tools: list[Callable] | None = None,
        rollout_func: Callable[[list[str], "GRPOTrainer"], dict[str, Any]] | None = None,
        environment_factory: Callable | dict[str, Callable] | None = None,
    ):
        if args is not None and isinstance(args, GRPOConfig):
            if args.importance_sampling_level not in self._importance_sampling_levels:
                raise ValueError(
                    f"Unknown importance sampling level: {args.importance_sampling_level}. Possible values are "
                    f"{' and '.join(repr(v) for v in self._importance_sampling_levels)}; for GSPO-token use "
                    "trl.experimental.gspo_token.GRPOTrainer."
                )
            self._warn_loss_setup(args)
        # Tools and environments: validated (and the environments' rewards added) before anything is loaded.
        tool_setup = self._prepare_tool_setup(
            tools, environment_factory, reward_funcs, args, train_dataset, rollout_func
        )
        super().__init__(
            model=model,
            reward_funcs=tool_setup["reward_funcs"],
            args=args,
            train_dataset=tool_setup["train_dataset"],
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
            rollout_func=rollout_func,
        )
        self._init_tools(tool_setup)
        self.beta = self.args.beta
        self.epsilon_low = self.args.epsilon
        self.epsilon_high = self.args.epsilon_high if self.args.epsilon_high is not None else self.args.epsilon
        self.entropy_coef = self.args.entropy_coef
        # Fixed here, as in TRL: whether the loss subtracts `entropy_coef` times the mean token entropy.
        self._entropy_bonus_enabled = self.args.entropy_coef != 0.0 or self.args.use_adaptive_entropy
        self._entropy_sum = 0.0
        self._entropy_count = 0.0
        self.liger_grpo_loss = self._build_liger_loss(self.args)

    def _build_liger_loss(self, args: GRPOConfig) -> Any:
        """Liger's chunked GRPO loss when `use_liger_kernel=True`: the LM head and the loss run chunk by chunk on the
        last hidden states, so the completion logits are never materialised.

        Without liger-kernel, training stops before its first step with transformers' ImportError saying how to
        install it (as in TRL); options the chunked loss does not implement are rejected here rather than ignored.
        """
        if not args.use_liger_kernel:
            return None
        from ..import_utils import is_liger_kernel_available

        if not is_liger_kernel_available():
            return None  # transformers raises at the start of train(): "... Please install it with `pip install ...`"
        unsupported = {
            "top_entropy_quantile < 1.0": args.top_entropy_quantile < 1.0,
            "off_policy_mask_threshold": args.off_policy_mask_threshold is not None,
            "an entropy bonus (entropy_coef / use_adaptive_entropy)": args.entropy_coef != 0.0
            or args.use_adaptive_entropy,
        }
        chosen = [name for name, used in unsupported.items() if used]
        if chosen:
            raise ValueError(
                f"use_liger_kernel=True computes the GRPO loss with liger's chunked kernel, which does not support "
                f"{', '.join(chosen)}. Set use_liger_kernel=False to use them."
            )
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        return LigerFusedLinearGRPOLoss(
            beta=args.beta,
            compiled=self.accelerator.device.type == "cuda",
            use_ref_model=args.beta != 0.0,
            epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            loss_type=args.loss_type,
            max_completion_length=args.max_completion_length,
            importance_sampling_level=args.importance_sampling_level,
            sapo_temperature_pos=args.sapo_temperature_pos,
            sapo_temperature_neg=args.sapo_temperature_neg,
            temperature=args.temperature,
            delta=args.delta,
            use_bias_correction_kl=args.use_bias_correction_kl,
            vespo_k_pos=args.vespo_k_pos,
            vespo_lambda_pos=args.vespo_lambda_pos,
            vespo_k_neg=args.vespo_k_neg,
            vespo_lambda_neg=args.vespo_lambda_neg,
        )

    def _needs_rollout_logps(self) -> bool:
        # The chunked loss cannot compare the sampler's log-probs with its own on the fly: store the old ones.
        needs_old = self.liger_grpo_loss is not None and self._uses_sampling_logps()
        return super()._needs_rollout_logps() or needs_old

    def _compute_liger_loss(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        """The GRPO loss through liger's fused LM head + loss (same normalisation as `normalize_per_token_loss`)."""
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        completion_mask = self._loss_mask(inputs)
        input_ids, attention_mask, position_ids = self._sequence_inputs(inputs)
        outputs = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            output_hidden_states=True,
            logits_to_keep=1,
            use_cache=False,
        )
        prompt_length = prompt_ids.shape[1]
        hidden = outputs.hidden_states[-1][:, prompt_length - 1 : -1, :]
        head = self.accelerator.unwrap_model(model).get_output_embeddings()
        mask = completion_mask.to(hidden.dtype)
        loss, metrics = self.liger_grpo_loss(
            _input=hidden,
            lin_weight=head.weight,
            selected_token_ids=completion_ids,
            attention_mask=mask,
            advantages=inputs["advantages"].to(hidden.dtype),
            bias=head.bias,
            old_per_token_logps=inputs.get("old_per_token_logps"),
            ref_per_token_logps=inputs.get("ref_per_token_logps"),
            vllm_is_ratio=inputs.get("importance_sampling_ratio"),
            num_items_in_batch=(
                self._step_token_count(inputs) if self.args.loss_type in ("dapo", "cispo", "vespo") else None
            ),
        )
        if self.args.loss_type not in ("dapo", "cispo", "vespo") or inputs.get("num_items_in_batch") is None:
            loss = loss / self._gradient_accumulation_divisor()
        loss = self._add_aux_loss(loss, getattr(outputs, "aux_loss", None))
        with torch.no_grad():
            if self.beta != 0.0:
                self._record_metric("kl", metrics[0])
            self._record_metric("clip_ratio/region_mean", metrics[-1])
        return loss

    @staticmethod
    def _warn_loss_setup(args: GRPOConfig) -> None:
        if args.loss_type == "luspo" and args.importance_sampling_level != "sequence":
            warnings.warn(
                "loss_type='luspo' is designed for importance_sampling_level='sequence' (it weights the GSPO "
                "sequence objective by length); you use 'token'.",
                UserWarning,
                stacklevel=3,
            )
        if args.loss_type == "vespo" and args.importance_sampling_level != "token":
            warnings.warn(
                "loss_type='vespo' is designed for importance_sampling_level='token'; you use 'sequence'.",
                UserWarning,
                stacklevel=3,
            )
        if args.importance_sampling_level == "sequence" and args.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
            warnings.warn(
                f"importance_sampling_level='sequence' (GSPO) with loss_type={args.loss_type!r}: the GSPO paper uses "
                "loss_type='grpo' (per-sequence averaging).",
                UserWarning,
                stacklevel=3,
            )
        if args.loss_type == "cispo" and (args.epsilon_high is None or args.epsilon_high < 1.0):
            cap = args.epsilon_high if args.epsilon_high is not None else args.epsilon
            warnings.warn(
                f"loss_type='cispo' uses epsilon_high as the cap of the importance weight (epsilon_max); with "
                f"{cap} every weight is at most {cap}, which shrinks the gradient. Values around 5.0 are typical.",
                UserWarning,
                stacklevel=3,
            )
        if (
            args.loss_type == "vespo"
            and args.use_vllm
            and args.vllm_importance_sampling_correction
            and not args.vllm_importance_sampling_mode.startswith("token")
        ):
            raise ValueError(
                "loss_type='vespo' with vLLM importance-sampling correction needs a per-token correction; set "
                "vllm_importance_sampling_mode to 'token_truncate' or 'token_mask'."
            )

    # ------------------------------------------------------------------------------------------------------------
    # Generation hook (TRL's signature)
    # ------------------------------------------------------------------------------------------------------------
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """TRL's hook: one completion per row of `prompt_ids` (unpadded ids; rows come in consecutive groups of
        `num_generations` copies of a prompt, except in later tool turns, where `num_generations` is 1).

        Returns:
            `(completion_ids, logprobs)`: token id lists cut after the first end-of-sequence token (included), and the
            sampled tokens' log-probabilities from vLLM (None from transformers).
        """
        return self._sample_completions(prompt_ids, images, multimodal_fields)

    # ------------------------------------------------------------------------------------------------------------
    # Advantages
    # ------------------------------------------------------------------------------------------------------------
    def _compute_advantages(self, rewards_per_func: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
        group = self._group_size()
        weights = self.reward_weights.to(rewards_per_func.device)
        if self.args.multi_objective_aggregation == "normalize_then_sum":
            return normalize_then_sum_advantages(rewards_per_func, weights, group)
        rewards = aggregate_rewards(rewards_per_func, weights)
        advantages, _ = group_advantages(rewards, group, self.args.scale_rewards)
        return advantages

    # ------------------------------------------------------------------------------------------------------------
    # Rollout extras: importance-sampling correction for external samplers
    # ------------------------------------------------------------------------------------------------------------
    def _compute_rollout_logps(self, batch: dict[str, Any]) -> None:
        super()._compute_rollout_logps(batch)
        # Off-policy data has its old log-probs now; on-policy, the loss pass compares its own detached ones.
        if "sampling_per_token_logps" in batch and "old_per_token_logps" in batch:
            weights = self._sampling_correction(batch["old_per_token_logps"], batch)
            if weights is not None:
                batch["importance_sampling_ratio"] = weights

    def _sampling_correction(self, old: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor | None:
        """Compare the trainer's log-probs of the sampled tokens with the sampler's (vLLM) and log the gap; returns
        the `(B, T)` truncated/masked importance weights when `vllm_importance_sampling_correction` is on."""
        args = self.args
        mask = self._loss_mask(batch).float()
        sampling = batch["sampling_per_token_logps"]
        difference = (old - sampling).abs()
        self._record_reduced("sampling/sampling_logp_difference/mean", masked_mean(difference, mask), "mean")
        self._record_reduced(
            "sampling/sampling_logp_difference/max",
            difference.masked_fill(mask == 0, float("nan")).nan_to_num(-1).max(),
            "max",
        )
        if not args.vllm_importance_sampling_correction:
            return None
        weights = importance_sampling_correction(
            old,
            sampling,
            mask,
            args.vllm_importance_sampling_mode,
            args.vllm_importance_sampling_clip_min,
            args.vllm_importance_sampling_clip_max,
        )
        full = weights.expand_as(mask)
        valid = mask > 0
        values = full[valid] if bool(valid.any()) else full.new_zeros(1)
        self._record_reduced("sampling/importance_sampling_ratio/min", values.min(), "min")
        self._record_reduced("sampling/importance_sampling_ratio/mean", values.mean(), "mean")
        self._record_reduced("sampling/importance_sampling_ratio/max", values.max(), "max")
        return full

    # ------------------------------------------------------------------------------------------------------------
    # Loss
    # ------------------------------------------------------------------------------------------------------------
    # TRL's VESPO helper: the `(B, 1)` detached sequence weights (see `vespo_gamma_weights`).
    get_gamma_weights = staticmethod(vespo_gamma_weights)

    def get_high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
        """Boolean `(B, T)` mask of the tokens whose entropy is at least the `threshold` quantile of the entropies of
        all unmasked tokens on all processes (TRL's helper; training passes `1 - top_entropy_quantile`). No unmasked
        token gives an all-False mask."""
        values = entropies.detach()[mask.bool()].float()
        padded = self.accelerator.pad_across_processes(values, dim=0, pad_index=float("nan"))
        gathered = self.accelerator.gather(padded)
        gathered = gathered[~torch.isnan(gathered)]
        if gathered.numel() == 0:
            return torch.zeros_like(mask, dtype=torch.bool)
        cutoff = torch.quantile(gathered, threshold)
        return (entropies.detach() >= cutoff.to(entropies.dtype)) & mask.bool()

    @staticmethod
    def get_off_policy_mask(
        advantages: torch.Tensor,
        per_token_logps: torch.Tensor,
        sampling_per_token_logps: torch.Tensor,
        mask: torch.Tensor,
        off_policy_threshold: float,
    ) -> torch.Tensor:
        """Off-policy sequence mask (TRL's helper): 0 for a sequence with a negative advantage whose mean per-token
        KL from the sampler, `mean_t(sampling_logp - logp)` over its unmasked tokens, exceeds `off_policy_threshold`,
        1 otherwise. `advantages` is `(B, 1)`; the result is `(B, 1)` in `mask`'s dtype."""
        mask_f = mask.to(per_token_logps.dtype)
        difference = (sampling_per_token_logps - per_token_logps) * mask_f
        kl = difference.sum(dim=1, keepdim=True) / mask_f.sum(dim=1, keepdim=True).clamp(min=1.0)
        dropped = (advantages < 0) & (kl > off_policy_threshold)
        return (~dropped).to(mask.dtype)

    def _importance_log_weights(
        self, per_token_logps: torch.Tensor, old_per_token_logps: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Hook: the log importance ratios of the loss at `args.importance_sampling_level` (GSPO-token adds a level)."""
        return importance_log_weights(per_token_logps, old_per_token_logps, mask, self.args.importance_sampling_level)

    def _high_entropy_mask(self, entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Tokens whose entropy is at or above the `1 - top_entropy_quantile` quantile (over all processes)."""
        return self.get_high_entropy_mask(entropy, mask, 1.0 - self.args.top_entropy_quantile).to(mask.dtype)

    def _policy_loss_inputs(self, model: nn.Module, inputs: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        """What a policy loss on one micro-batch starts from: `(logps, entropy, aux_loss, mask, advantages, old)`,
        the current `(B, T)` log-probabilities and entropies, the router loss (or None), the loss mask and advantages
        in the log-probabilities' dtype, and the sampling policy's log-probabilities (the stored ones, or on-policy
        the current ones detached, so that the ratio is exactly 1 with its gradient)."""
        logps, entropy, aux_loss = self._completion_logps(model, inputs, compute_entropy=True)
        mask = self._loss_mask(inputs).to(logps.dtype)
        advantages = inputs["advantages"].to(logps.dtype)
        old = inputs.get("old_per_token_logps")
        old = logps.detach() if old is None else old
        return logps, entropy, aux_loss, mask, advantages, old

    def _compute_loss(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        if self.liger_grpo_loss is not None:
            return self._compute_liger_loss(model, inputs)
        args = self.args
        logps, entropy, aux_loss, mask, advantages, old = self._policy_loss_inputs(model, inputs)
        is_ratio = inputs.get("importance_sampling_ratio")
        if is_ratio is None and "sampling_per_token_logps" in inputs and "old_per_token_logps" not in inputs:
            # On-policy: this pass's detached log-probs are the old policy's, so no separate rollout pass is needed.
            is_ratio = self._sampling_correction(old, inputs)
        if is_ratio is not None:
            is_ratio = is_ratio.to(logps.dtype)
        vespo = args.loss_type == "vespo"
        per_token_loss, ratio, stats = grpo_per_token_loss(
            logps,
            old,
            advantages,
            mask,
            loss_type=args.loss_type,
            epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            delta=args.delta,
            importance_sampling_level=args.importance_sampling_level,
            sapo_temperature_pos=args.sapo_temperature_pos,
            sapo_temperature_neg=args.sapo_temperature_neg,
            vespo_params=(args.vespo_k_pos, args.vespo_lambda_pos, args.vespo_k_neg, args.vespo_lambda_neg),
            log_weights=self._importance_log_weights(logps, old, mask),
            importance_sampling_ratio=is_ratio if vespo else None,
        )
        if is_ratio is not None and not vespo:  # VESPO folds the correction into its sequence weight
            per_token_loss = per_token_loss * is_ratio
        if args.off_policy_mask_threshold is not None:
            reference = inputs.get("sampling_per_token_logps", old)
            keep = self.get_off_policy_mask(
                advantages.unsqueeze(1), logps.detach(), reference, mask, args.off_policy_mask_threshold
            )
            per_token_loss = per_token_loss * keep.to(per_token_loss.dtype)
        if args.top_entropy_quantile < 1.0:
            per_token_loss = per_token_loss * self._high_entropy_mask(entropy, mask)

        kl_term = None
        if self.beta != 0.0:
            per_token_kl = k3_kl(logps, inputs["ref_per_token_logps"])
            kl_term = per_token_kl * ratio if args.use_bias_correction_kl else per_token_kl
            per_token_loss = per_token_loss + self.beta * kl_term

        normalise = dict(
            loss_type=args.loss_type,
            gradient_accumulation_steps=self._gradient_accumulation_divisor(),
            num_items_in_batch=self._step_token_count(inputs),
            num_processes=self.accelerator.num_processes,
            max_completion_length=args.max_completion_length,
        )
        loss = normalize_per_token_loss(per_token_loss, mask, **normalise)
        use_entropy_bonus = self._entropy_bonus_enabled
        if use_entropy_bonus:
            policy_loss = loss
            if self._entropy_bonus_active():
                loss = loss - self.entropy_coef * normalize_per_token_loss(entropy, mask, **normalise)
        loss = self._add_aux_loss(loss, aux_loss)
        with torch.no_grad():
            self._record_loss_metrics(
                entropy,
                mask,
                kl_term,
                stats,
                per_token_loss.shape,
                policy_loss if use_entropy_bonus else None,
            )
        return loss

    def _record_loss_metrics(
        self,
        entropy: torch.Tensor,
        mask: torch.Tensor,
        kl_term: torch.Tensor | None,
        stats: dict[str, torch.Tensor],
        loss_shape: torch.Size,
        policy_loss: torch.Tensor | None,
    ) -> None:
        """TRL's metrics of a loss computation: entropy, KL, the clip statistics of the loss type, and the policy
        loss and entropy coefficient when an entropy bonus is on (`policy_loss` given)."""
        mode = self._mode
        self._record_metric("entropy", masked_mean(entropy.detach(), mask))
        if mode == "train":
            self._entropy_sum += float((entropy.detach() * mask).sum())
            self._entropy_count += float(mask.sum())
        if kl_term is not None:
            # The KL as the loss weighs it: by the importance ratio (1 on-policy) under use_bias_correction_kl (TRL).
            self._record_metric("kl", masked_mean(kl_term.detach(), mask))
        full_mask = mask.expand(loss_shape)
        if self.args.loss_type not in ("cispo", "sapo", "vespo"):  # their trust regions are not a clip (TRL)
            self._record_clip_metrics(stats["low_clipped"], stats["high_clipped"], full_mask)
        if "cispo_clipped" in stats:
            self._record_metric(
                "cispo_clip_ratio", masked_mean(stats["cispo_clipped"].expand_as(full_mask).float(), full_mask)
            )
        if "vespo_phi" in stats:
            self._record_metric("vespo/phi_seq_mean", stats["vespo_phi"].mean())
        if policy_loss is not None:
            self._record_metric("policy_loss", policy_loss.detach() * self._gradient_accumulation_divisor())
            if not (self.args.use_adaptive_entropy and mode == "train"):  # adaptive: logged once updated (TRL)
                self._metrics[mode]["entropy_coef"].append(float(self.entropy_coef))

    # ------------------------------------------------------------------------------------------------------------
    # Adaptive entropy coefficient
    # ------------------------------------------------------------------------------------------------------------
    def _entropy_bonus_active(self) -> bool:
        """Whether this step's loss subtracts the entropy bonus. A fixed `entropy_coef` always does; the adaptive
        one (Skywork-OR1's control) only after a step whose mean entropy fell below `entropy_target`, so never on the
        first step (TRL 1.16's schedule)."""
        if not self.args.use_adaptive_entropy:
            return True
        return self._last_world_entropy is not None and self._last_world_entropy < self.args.entropy_target

    def _on_optimizer_step(self) -> None:
        if not self.args.use_adaptive_entropy:
            self._entropy_sum, self._entropy_count = 0.0, 0.0
            return
        totals = torch.tensor([self._entropy_sum, self._entropy_count], device=self.accelerator.device)
        totals = self.accelerator.gather(totals.unsqueeze(0)).sum(dim=0)
        self._entropy_sum, self._entropy_count = 0.0, 0.0
        if totals[1] <= 0:
            return
        mean_entropy = (totals[0] / totals[1]).item()
        args = self.args
        # Raise the bonus when entropy falls below the target, lower it when above; each move is bounded on its own
        # side only (TRL's schedule: a coefficient that starts outside the bounds walks back in, one delta a step).
        if mean_entropy < args.entropy_target:
            self.entropy_coef = min(self.entropy_coef + args.entropy_coef_delta, args.entropy_coef_max)
        else:
            self.entropy_coef = max(self.entropy_coef - args.entropy_coef_delta, args.entropy_coef_min)
        self._last_world_entropy = mean_entropy
        self._metrics["train"]["entropy_coef"].append(float(self.entropy_coef))

    def _save_checkpoint_extras(self, folder):
        super()._save_checkpoint_extras(folder)
        if self.args.use_adaptive_entropy and self.is_world_process_zero():
            state = {
                "entropy_coef": self.entropy_coef,
                "last_world_entropy": self._last_world_entropy,
            }
            with open(os.path.join(folder, ENTROPY_STATE_FILE), "w") as f:
                json.dump(state, f)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        path = os.path.join(resume_from_checkpoint, ENTROPY_STATE_FILE)
        if self.args.use_adaptive_entropy and os.path.isfile(path):
            with open(path) as f:
                state = json.load(f)
            self.entropy_coef = float(state["entropy_coef"])
            self._last_world_entropy = state.get("last_world_entropy")
