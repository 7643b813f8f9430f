"""SDPO: self-distillation policy optimization.

Completions are sampled and scored by reward functions as in GRPO. The teacher of a completion is the model itself
(or an EMA copy) re-prompted with a successful completion of the same prompt and/or the environment's feedback; the
student learns to match it on its own completion, optionally mixed with a PPO-clipped policy loss
(SDPO, https://huggingface.co/papers/2601.20802). The teacher and the distillation losses are shared with SDFT.
"""

import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from accelerate.utils import gather_object
from datasets import Dataset, IterableDataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin, TrainerCallback
from transformers.utils import logging

from ...trainer.online_math import ADVANTAGE_EPS, aggregate_rewards, group_advantages
from .._self_distillation.loss_utils import token_log_probs
from .._self_distillation.prompts import last_user_text, with_teacher_text
from .._self_distillation.teacher_server import build_teacher_request_inputs  # noqa: F401 (TRL module name)
from .._self_distillation.trainer import _SelfDistillationTrainer
from .sdpo_config import _LOSS_TYPES, SDPOConfig


logger = logging.get_logger(__name__)

_THINKING = re.compile(r"<think>.*?</think>", flags=re.DOTALL)
_FLAT_MESSAGE = (
    "SDPO: every group of completions got the same reward, so the policy advantages are all zero. Check the reward "
    "functions' density and scale, or `success_reward_threshold`."
)
_INACTIVE_MESSAGE = (
    "SDPO: self-distillation is inactive, no completion got a teacher context (no successful sibling completion "
    "reached `success_reward_threshold`, and no usable environment feedback)."
)
_NO_SUCCESS_MESSAGE = (
    "SDPO: no completion reached `success_reward_threshold` in this batch. Make the task easier, shape the rewards, or "
    "lower `success_reward_threshold`."
)


@dataclass
class DistillationLogits:
    """The tensors of one self-distillation loss: `(B, C)` completion ids and masks (`loss_mask` = completion mask
    times the per-sample self-distillation mask) and the student's and teacher's `(B, C, V)` logits."""

    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    loss_mask: torch.Tensor
    student_logits: torch.Tensor
    teacher_logits: torch.Tensor | None


def _is_blank(feedback: Any) -> bool:
    return not isinstance(feedback, str) or not feedback.strip()


class SuccessfulRolloutTeacherContextBuilder:
    """Builds each completion's teacher prompt from its group's successful completions and the environment feedback.

    For completion `i`, the demonstration is the first completion `j` of its group whose total reward reaches
    `success_reward_threshold` (`j != i` when `dont_reprompt_on_self_success`), when `use_successful_as_teacher`. The
    feedback (the row's `privileged_context`) is used when `include_environment_feedback`, it is non-blank text, and
    not (`environment_feedback_only_without_solution` and a demonstration exists). A completion with neither keeps its
    own prompt and is left out of the distillation loss (`self_distillation_mask = 0`).

    Args:
        trainer: The [`SDPOTrainer`] (its config, tokenizer and group size are read).
    """

    def __init__(self, trainer: "SDPOTrainer"):
        self.trainer = trainer
        self.last_metrics: dict[str, float] = {}
        self._warned_unused_feedback = False

    def _demonstration_text(self, completion_ids: list[int]) -> str:
        trainer = self.trainer
        ids = [token for token in completion_ids if token != trainer.pad_token_id]
        text = trainer._tokenizer.decode(ids, skip_special_tokens=True)
        if trainer.args.remove_thinking_from_demonstration:
            text = _THINKING.sub("", text).strip()
        return text

    def _build_reprompt_text(self, prompt_text: str, solution_text: str, feedback_text: str) -> str:
        """`reprompt_template` filled with the prompt and the (already templated) solution and feedback texts."""
        return self.trainer.args.reprompt_template.format(
            prompt=prompt_text, solution=solution_text, feedback=feedback_text
        )

    def build(
        self,
        output: dict[str, Any],
        prompts: list[Any],
        rewards: torch.Tensor,
        feedbacks: list[Any] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Teacher prompts of this process's completions.

        Args:
            output: The rollout batch of this process (`completion_ids`).
            prompts: This process's prompts, one per completion.
            rewards: `(N_global,)` total rewards of all processes' completions, in order.
            feedbacks: This process's environment feedback per completion (or None).

        Returns:
            `teacher_prompt_ids` / `teacher_prompt_mask` (left-padded) and `self_distillation_mask` `(B,)`, for this
            process's completions; `last_metrics` holds the batch's fractions.
        """
        trainer, args = self.trainer, self.trainer.args
        local = len(prompts)
        feedbacks = feedbacks if feedbacks is not None else [None] * local
        all_ids = gather_object([row.tolist() for row in output["completion_ids"]])
        all_feedbacks = gather_object(list(feedbacks))
        all_prompts = gather_object(list(prompts))
        rewards = rewards.detach().float().cpu()
        group = trainer._group_size()
        success = rewards >= args.success_reward_threshold
        if not self._warned_unused_feedback and not args.include_environment_feedback:
            if any(not _is_blank(f) for f in all_feedbacks):
                self._warned_unused_feedback = True
                logger.warning(
                    "SDPO: the dataset has environment feedback (`privileged_context`), but "
                    "`include_environment_feedback=False`, so the teacher does not see it."
                )

        teacher_prompts, mask, used_feedback, has_peer = [], [], [], []
        for i, prompt in enumerate(all_prompts):
            start = (i // group) * group
            peers = [
                j
                for j in range(start, start + group)
                if success[j] and not (args.dont_reprompt_on_self_success and j == i)
            ]
            demo = self._demonstration_text(all_ids[peers[0]]) if peers and args.use_successful_as_teacher else None
            has_peer.append(demo is not None)
            feedback = all_feedbacks[i]
            use_feedback = (
                args.include_environment_feedback
                and not _is_blank(feedback)
                and not (args.environment_feedback_only_without_solution and demo is not None)
            )
            used_feedback.append(use_feedback)
            if demo is None and not use_feedback:
                teacher_prompts.append(prompt)
                mask.append(0.0)
                continue
            solution = args.solution_template.format(successful_previous_attempt=demo) if demo is not None else ""
            feedback_text = args.feedback_template.format(feedback_raw=feedback) if use_feedback else ""
            text = self._build_reprompt_text(last_user_text(prompt), solution, feedback_text)
            teacher_prompts.append(with_teacher_text(prompt, text))
            mask.append(1.0)

        groups = success.view(-1, group)
        self.last_metrics = {
            "self_distillation/success_group_fraction": groups.any(dim=1).float().mean().item(),
            # Completions given a successful sibling as demonstration (themselves too unless excluded).
            "self_distillation/success_sample_fraction": sum(has_peer) / len(has_peer),
            "self_distillation/feedback_available_fraction": sum(not _is_blank(f) for f in all_feedbacks)
            / len(all_feedbacks),
            "self_distillation/feedback_used_fraction": sum(used_feedback) / len(used_feedback),
            "self_distillation/reprompt_sample_fraction": sum(mask) / len(mask),
        }
        offset = trainer.accelerator.process_index * local
        ids, prompt_mask = trainer._padded_prompts(teacher_prompts[offset : offset + local], args.max_reprompt_len)
        device = trainer.accelerator.device
        return {
            "teacher_prompt_ids": ids,
            "teacher_prompt_mask": prompt_mask,
            "self_distillation_mask": torch.tensor(mask[offset : offset + local], device=device),
        }


class SDPOTrainer(_SelfDistillationTrainer):
    """Self-distillation policy optimization: successful completions (and feedback) teach the failing ones.

    Example:

    ```python
    from datasets import Dataset

    from trl.assets import get_model_path
    from trl.experimental.sdpo import SDPOConfig, SDPOTrainer


    def starts_with_space(completions, **kwargs):
        return [float(c.startswith(" ")) for c in completions]


    dataset = Dataset.from_dict({"prompt": ["The capital of France is", "Two plus two is"]})
    trainer = SDPOTrainer(
        model=get_model_path("tiny-Qwen2ForCausalLM"),
        reward_funcs=starts_with_space,
        args=SDPOConfig(output_dir="sdpo-out", num_generations=2, per_device_train_batch_size=2, max_steps=2),
        train_dataset=dataset,
    )
    trainer.train()
    ```

    Args:
        model: The policy: a path or an instantiated causal LM.
        reward_funcs: One reward function or a list (callables, reward-model paths or models), as in GRPO. Required.
        args: An [`SDPOConfig`].
        train_dataset: Rows with `prompt`, optionally `privileged_context` (environment feedback text) and the
            reward functions' columns. IterableDatasets are not supported.
        eval_dataset: Same columns, for `evaluate()`.
        processing_class: Tokenizer; loaded from the model's path when omitted.
        reward_processing_classes: Tokenizers of reward models given as models.
        callbacks: Extra callbacks.
        optimizers: Optimizer and scheduler to use instead of the defaults.
        peft_config: Adapter configuration.
    """

    _tag_names = ["trl", "sdpo"]
    _name = "SDPO"
    _paper = {
        "title": "Reinforcement Learning via Self-Distillation",
        "id": "2601.20802",
        "citation": "@article{sdpo2026,\n    title = {{Reinforcement Learning via Self-Distillation}},\n"
        "    year = 2026,\n    eprint = {arXiv:2601.20802}\n}",
    }
    _config_class = SDPOConfig
    _loss_name = "sdpo"
    _log_copies_logs = False

    def __init__(
        self,
        model: "str | PreTrainedModel | nn.Module",
        reward_funcs: Any | list[Any] | None = None,
        args: SDPOConfig | None = None,
        train_dataset: Dataset | IterableDataset | None = None,
        eval_dataset: Dataset | IterableDataset | dict[str, Dataset | IterableDataset] | None = None,
        processing_class: PreTrainedTokenizerBase | ProcessorMixin | None = None,
        reward_processing_classes: PreTrainedTokenizerBase | list[PreTrainedTokenizerBase] | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (None, None),
        peft_config: Any = None,
    ):
        if reward_funcs is None or (isinstance(reward_funcs, list) and not reward_funcs):
            raise ValueError(
                "SDPOTrainer needs `reward_funcs`: one or more reward functions (or reward models) that score the "
                "completions; successful completions become the teacher's demonstrations."
            )
        if args is not None and getattr(args, "loss_type", "dapo") not in _LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {list(_LOSS_TYPES)}; got {args.loss_type!r}.")
        super().__init__(
            model,
            args,
            train_dataset,
            eval_dataset,
            peft_config,
            reward_funcs=reward_funcs,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        self.teacher_context_builder = SuccessfulRolloutTeacherContextBuilder(self)
        self._degenerate_counts: dict[str, int] = defaultdict(int)

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = ["prompt", "privileged_context"]

    # ------------------------------------------------------------------------------------------------------------
    # Rewards, advantages and the teacher context
    # ------------------------------------------------------------------------------------------------------------
    def _compute_advantages(self, rewards_per_func: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
        rewards = aggregate_rewards(rewards_per_func, self.reward_weights)
        group = self._group_size()
        scale = self.args.scale_rewards if self.args.scale_rewards in ("group", "batch") else "none"
        advantages, group_std = group_advantages(rewards, group, scale, eps=ADVANTAGE_EPS)
        self._round_rewards = rewards
        self._record_reward_diagnostics(rewards, rewards_per_func, group_std[::group])
        return advantages

    def _record_reward_diagnostics(
        self, rewards: torch.Tensor, rewards_per_func: torch.Tensor, group_std: torch.Tensor
    ) -> None:
        """Reward statistics of the gathered batch (`group_std`: one per group)."""
        metrics = self._metrics[self._mode]
        metrics["self_distillation/reward_mean"].append(rewards.mean().item())
        metrics["self_distillation/reward_std"].append(rewards.std().item() if rewards.numel() > 1 else 0.0)
        metrics["self_distillation/reward_min"].append(rewards.min().item())
        metrics["self_distillation/reward_max"].append(rewards.max().item())
        metrics["self_distillation/group_reward_std_mean"].append(group_std.mean().item())
        flat = (group_std <= self.args.diagnostics_flat_tolerance).float().mean().item()
        metrics["self_distillation/flat_group_fraction"].append(flat)
        for i, name in enumerate(self.reward_func_names):
            metrics[f"self_distillation/rewards/{name}"].append(torch.nanmean(rewards_per_func[:, i]).item())
        self._warn_if_degenerate("flat_rewards", flat >= 1.0, _FLAT_MESSAGE)

    def _warn_if_degenerate(self, key: str, degenerate: bool, message: str) -> None:
        """Warn at the 1st and every `diagnostics_warning_interval`-th consecutive degenerate round."""
        key = f"{self._mode}/{key}"
        if not degenerate:
            self._degenerate_counts[key] = 0
            return
        self._degenerate_counts[key] += 1
        count, interval = self._degenerate_counts[key], self.args.diagnostics_warning_interval
        if interval > 0 and (count == 1 or count % interval == 0):
            logger.warning(f"{message} Consecutive degenerate rounds: {count}.")

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        prompts = [row["prompt"] for row in inputs]
        self._announce_generation_prompts(prompts)
        batch = super()._generate_and_score_completions(inputs)
        feedbacks = [row.get("privileged_context") for row in inputs]
        context = self.teacher_context_builder.build(batch, prompts, self._round_rewards, feedbacks)
        batch.update(context)
        # The hooks get the teacher's whole input (its prompt, then the completion), as TRL's do.
        teacher_input_ids, teacher_attention_mask = self._teacher_inputs(batch)
        metrics = self.teacher_context_builder.last_metrics
        for key, value in metrics.items():
            self._metrics[self._mode][key].append(value)
        self._warn_if_degenerate(
            "inactive", metrics["self_distillation/reprompt_sample_fraction"] == 0.0, _INACTIVE_MESSAGE
        )
        self._warn_if_degenerate(
            "no_success", metrics["self_distillation/success_sample_fraction"] == 0.0, _NO_SUCCESS_MESSAGE
        )
        self._dispatch_self_distillation_callback(
            "on_teacher_context_built",
            teacher_input_ids=teacher_input_ids,
            teacher_attention_mask=teacher_attention_mask,
            completion_mask=batch["completion_mask"],
            self_distillation_mask=context["self_distillation_mask"],
        )
        self._announce_batch_prepared(batch, self_distillation_mask=context["self_distillation_mask"])
        return batch

    # ------------------------------------------------------------------------------------------------------------
    # Loss
    # ------------------------------------------------------------------------------------------------------------
    def _compute_policy_loss(self, inputs: dict[str, Any], student_logits: torch.Tensor) -> torch.Tensor:
        """PPO-clipped policy-gradient loss (no KL term), aggregated by `loss_type`."""
        args = self.args
        mask = self._loss_mask(inputs).to(student_logits.dtype)
        logps = token_log_probs(student_logits, inputs["completion_ids"])
        old = inputs.get("old_per_token_logps")
        old = logps.detach() if old is None else old
        log_ratio = logps - old
        if args.importance_sampling_level == "sequence":
            log_ratio = ((log_ratio * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).unsqueeze(1)
        elif args.importance_sampling_level != "token":
            raise ValueError(
                f"importance_sampling_level must be 'token' or 'sequence'; got {args.importance_sampling_level!r}."
            )
        ratio = torch.exp(log_ratio)
        advantages = inputs["advantages"].unsqueeze(1)
        clipped = torch.clamp(ratio, 1 - args.epsilon, 1 + args.epsilon_high)
        per_token = -torch.min(ratio * advantages, clipped * advantages)
        if args.loss_type == "grpo":
            return ((per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).mean()
        if args.loss_type in ("bnpo", "dapo"):
            return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
        if args.loss_type == "dr_grpo":
            return (per_token * mask).sum() / (per_token.shape[0] * self.max_completion_length)
        raise ValueError(f"loss_type must be one of {list(_LOSS_TYPES)}; got {args.loss_type!r}.")

    def _compute_self_distillation_loss(
        self, model: nn.Module, inputs: dict[str, Any], distillation_logits: DistillationLogits
    ) -> torch.Tensor:
        """Mean over the completions of each one's masked token-mean distillation loss (0 for unprompted ones)."""
        per_token = self._distillation_per_token(
            model, inputs, distillation_logits.student_logits, distillation_logits.teacher_logits
        )
        mask = distillation_logits.loss_mask.to(per_token.dtype)
        counts = mask.sum(dim=1)
        if counts.sum() == 0:
            self._record_distillation_loss(torch.zeros((), device=per_token.device))
            return per_token.sum() * 0.0
        per_sequence = (per_token * mask).sum(dim=1) / counts.clamp(min=1.0)
        # Logged: the mean over the completions that had a teacher context.
        self._record_distillation_loss(per_sequence[counts > 0].mean())
        return per_sequence.mean()

    def _compute_loss(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        weight = self.args.distillation_weight
        teacher_logits = self._teacher_logits_first(model, inputs) if weight > 0.0 else None
        student_logits = self._student_logits(model, inputs, teacher_logits)
        loss = None
        if weight < 1.0:
            policy = self._compute_policy_loss(inputs, student_logits)
            self._record_metric("self_distillation/policy_loss", policy.detach())
            loss = policy if weight == 0.0 else (1.0 - weight) * policy
        if weight > 0.0:
            completion_mask = self._loss_mask(inputs)
            sd_mask = inputs["self_distillation_mask"].to(completion_mask.dtype).unsqueeze(1)
            logits = DistillationLogits(
                completion_ids=inputs["completion_ids"],
                completion_mask=completion_mask,
                loss_mask=completion_mask * sd_mask,
                student_logits=student_logits,
                # The server teacher (`use_teacher_server`) returns log-probabilities, scored in the loss itself.
                teacher_logits=teacher_logits,
            )
            distillation = self._compute_self_distillation_loss(model, inputs, logits)
            loss = distillation if loss is None else loss + weight * distillation
        return loss / self._gradient_accumulation_divisor()
