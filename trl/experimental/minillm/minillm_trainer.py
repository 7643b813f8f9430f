"""MiniLLM: GRPO, except that the teacher's reverse KL shapes the advantages and adds a single-step KL term.

With `r_t = log p_teacher(y_t) - log p_student(y_t)` on the sampled tokens, the per-token advantage is the reward
advantage plus `S_t = sum_{t' >= t} gamma^t' m_t' r_t'` (divided by `sum_{t' >= t} gamma^t' w_t'`, `w = m` with
1e-4 for masked positions, under `length_normalization`; `gamma = 0` gives `m_t r_t`). The single-step
decomposition adds `mean_{b,t} KL(student_t || teacher_t)` over the vocabulary (Gu et al., 2023,
https://huggingface.co/papers/2306.08543).
"""

from typing import Any

import torch
import torch.nn as nn
from transformers import AutoModelForCausalLM

from ...trainer.grpo_trainer import GRPOTrainer, normalize_per_token_loss
from ...trainer.utils import disable_dropout_in_model
from .minillm_config import MiniLLMConfig


# Weight of a masked position in the length normaliser of the accumulated advantage (keeps it away from zero).
MASKED_WEIGHT = 1e-4


def dummy_reward_func(completions: list, **kwargs: Any) -> list[float]:
    """The reward when none is given: 1 for every completion (the teacher alone drives training)."""
    return [1.0] * len(completions)


def reverse_kl_advantage(
    student_logps: torch.Tensor,
    teacher_logps: torch.Tensor,
    mask: torch.Tensor | None,
    gamma: float,
    length_normalization: bool,
) -> torch.Tensor:
    """`(B, T)` accumulated reverse-KL advantage of each token.

    `r_t = m_t (teacher_t - student_t)`; with `gamma = 0` the advantage is `r_t`; otherwise
    `S_t = sum_{t' >= t} gamma^t' r_t'`, divided by `sum_{t' >= t} gamma^t' w_t'` (`w = m`, masked positions
    `MASKED_WEIGHT`) under `length_normalization`.
    """
    mask = torch.ones_like(student_logps) if mask is None else mask.to(student_logps.dtype)
    rewards = (teacher_logps - student_logps) * mask
    if gamma == 0:
        return rewards
    powers = gamma ** torch.arange(rewards.shape[1], device=rewards.device, dtype=rewards.dtype)
    returns = (rewards * powers).flip(1).cumsum(1).flip(1)
    if not length_normalization:
        return returns
    weights = torch.where(mask > 0, mask, torch.full_like(mask, MASKED_WEIGHT))
    return returns / (weights * powers).flip(1).cumsum(1).flip(1)


def token_clipped_loss(
    logps: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, epsilon_low: float, epsilon_high: float
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped per-token loss `-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)` with `(B, T)` advantages."""
    ratio = torch.exp(logps - old)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    per_token = -torch.min(ratio * advantages, clipped * advantages)
    stats = {
        "low_clipped": (ratio < 1 - epsilon_low) & (advantages < 0),
        "high_clipped": (ratio > 1 + epsilon_high) & (advantages > 0),
    }
    return per_token, ratio, stats


class MiniLLMTrainer(GRPOTrainer):
    """Distil `teacher_model` into `model` with GRPO's rollouts and the MiniLLM objective.

    Args:
        model: The student, as for [`GRPOTrainer`].
        teacher_model: The teacher: a model or a path / hub id (loaded with `args.teacher_model_init_kwargs`); it must
            share the student's vocabulary.
        reward_funcs: Optional reward functions or models; `None` uses a constant reward of 1.
        args: A [`MiniLLMConfig`]; `None` gives `MiniLLMConfig("<model name>-MiniLLM")`.
        **kwargs: Every other [`GRPOTrainer`] argument (datasets, processing class, callbacks, PEFT, rollout_func).
    """

    _tag_names = ["trl", "minillm"]
    _name = "MiniLLM"
    _paper = {
        "title": "MiniLLM: Knowledge Distillation of Large Language Models",
        "id": "2306.08543",
        "citation": """\
@inproceedings{gu2024minillm,
    title        = {{MiniLLM: Knowledge Distillation of Large Language Models}},
    author       = {Yuxian Gu and Li Dong and Furu Wei and Minlie Huang},
    year         = 2024,
    booktitle    = {The Twelfth International Conference on Learning Representations, {ICLR} 2024},
}""",
    }
    _config_class = MiniLLMConfig

    def __init__(self, model: Any, teacher_model: Any, reward_funcs: Any = None, args=None, **kwargs: Any):
        if args is None:
            args = self._default_args(MiniLLMConfig, model)
        elif not isinstance(args, MiniLLMConfig):
            raise TypeError(
                f"MiniLLMTrainer expects `args` to be a MiniLLMConfig; got {type(args).__name__}. Build one with "
                "MiniLLMConfig(output_dir=..., ...)."
            )
        if isinstance(teacher_model, str):
            teacher_model = AutoModelForCausalLM.from_pretrained(
                teacher_model, **dict(args.teacher_model_init_kwargs or {})
            )
        if args.disable_dropout:
            disable_dropout_in_model(teacher_model)
        super().__init__(model=model, reward_funcs=reward_funcs or dummy_reward_func, args=args, **kwargs)
        self.teacher_model = self._prepare_ref_model(self._freeze(teacher_model))

    def _compute_advantage(self, student_log_probs_on_labels, teacher_log_probs_on_labels, mask=None):
        return reverse_kl_advantage(
            student_log_probs_on_labels,
            teacher_log_probs_on_labels,
            mask,
            self.args.gamma,
            self.args.length_normalization,
        )

    @staticmethod
    def _completion_logits(model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        """`(B, C, V)` logits of `model` predicting each completion token."""
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        width = inputs["completion_ids"].shape[1]
        logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=width + 1).logits
        return logits[:, -(width + 1) : -1].float()

    def _compute_loss(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        args = self.args
        logps, entropy, aux_loss, mask, advantages, old = self._policy_loss_inputs(model, inputs)
        token_advantages = advantages.unsqueeze(1).expand_as(logps)
        student = teacher = None
        if args.rkl_advantage or args.single_step_decomposition:
            # The distillation terms read both models at `kd_temperature` (the policy ratio stays at `temperature`).
            student = torch.log_softmax(self._completion_logits(model, inputs) / args.kd_temperature, dim=-1)
            with torch.no_grad():
                teacher_logits = self._completion_logits(self.teacher_model, inputs)
            teacher = torch.log_softmax(teacher_logits / args.kd_temperature, dim=-1)
        if args.rkl_advantage:
            labels = inputs["completion_ids"].unsqueeze(-1)
            # Not detached (as in TRL): the gradient also flows through the student's log-probs in the advantage.
            rkl = self._compute_advantage(
                student.gather(-1, labels).squeeze(-1), teacher.gather(-1, labels).squeeze(-1), mask
            )
            token_advantages = token_advantages + rkl.to(logps.dtype)
        per_token_loss, ratio, stats = token_clipped_loss(
            logps, old, token_advantages, self.epsilon_low, self.epsilon_high
        )
        loss = normalize_per_token_loss(
            per_token_loss,
            mask,
            loss_type=args.loss_type,
            gradient_accumulation_steps=self._gradient_accumulation_divisor(),
            num_items_in_batch=self._step_token_count(inputs),
            num_processes=self.accelerator.num_processes,
            max_completion_length=args.max_completion_length,
        )
        if args.single_step_decomposition:
            # Mean over every completion position (padding included) and not divided by gradient accumulation, as TRL.
            loss = loss + (student.exp() * (student - teacher)).sum(-1).mean()
        loss = self._add_aux_loss(loss, aux_loss)
        with torch.no_grad():
            self._record_loss_metrics(entropy, mask, None, stats, per_token_loss.shape, None)
        return loss
