"""XPO (Exploratory Preference Optimization): Online DPO with an exploration bonus.

For each prompt one completion is sampled from the policy and one from the reference model. The pair is ranked like
in Online DPO (reward models / functions or a judge) and the DPO / IPO loss is applied to it; on top, XPO adds
`alpha` times the policy's log-probability of the reference completion. Minimising that term lowers the likelihood of
what the reference already produces, an optimism bonus that drives the policy to explore (Xie et al., 2024).
"""

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from datasets import Dataset, IterableDataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin, TrainerCallback

from ...trainer.online_rewards import RewardFunc
from ...trainer.utils import use_adapter
from ..online_dpo.online_dpo_config import _schedule_values
from ..online_dpo.online_dpo_trainer import OnlineDPOTrainer, online_dpo_loss
from .xpo_config import XPOConfig


def xpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    policy_logps_of_ref_samples: torch.Tensor,
    beta: float,
    alpha: float,
    loss_type: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two per-pair terms of the XPO loss (their sum is minimised).

    Args:
        chosen_logps, rejected_logps: `(n,)` policy log-probabilities (summed over tokens) of the chosen and rejected
            completions of each pair (one of them sampled from the policy, the other from the reference).
        ref_chosen_logps, ref_rejected_logps: `(n,)` reference log-probabilities of the same completions.
        policy_logps_of_ref_samples: `(n,)` policy log-probabilities of the completions sampled from the reference.
        beta: KL strength (IPO tau).
        alpha: Weight of the exploration term.
        loss_type: `"sigmoid"` or `"ipo"` (see [`online_dpo_loss`]).

    Returns:
        `(dpo_losses, xpo_losses)`, both `(n,)`: the preference loss and `alpha * policy_logps_of_ref_samples`.
    """
    dpo_losses = online_dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta, loss_type)
    return dpo_losses, alpha * policy_logps_of_ref_samples


class XPOTrainer(OnlineDPOTrainer):
    """Trainer for XPO (Exploratory Preference Optimization), a small extension of [`OnlineDPOTrainer`].

    Example:

    ```python
    from trl.assets import get_model_path, load_test_dataset
    from trl.experimental.xpo import XPOConfig, XPOTrainer

    trainer = XPOTrainer(
        model=get_model_path("tiny-Qwen2ForCausalLM"),
        reward_funcs=get_model_path("tiny-Qwen2ForSequenceClassification"),
        args=XPOConfig(output_dir="xpo-out", per_device_train_batch_size=2, max_new_tokens=16, max_steps=5),
        train_dataset=load_test_dataset("standard_prompt_only", split="train"),
    )
    trainer.train()
    ```

    Args:
        model (`str`, `PreTrainedModel` or `PeftModel`):
            Policy to train (path / hub id or instance).
        ref_model (`str`, `PreTrainedModel` or `None`, defaults to `None`):
            Reference model: it samples the second completion of each pair and anchors the DPO loss. `None` copies the
            initial policy (PEFT policy: the policy with its adapters disabled).
        reward_funcs (`RewardFunc`, `list[RewardFunc]` or `None`, defaults to `None`):
            Reward models and/or functions ranking each (policy, reference) pair, as in [`OnlineDPOTrainer`].
            Exclusive with `judge`.
        args (`XPOConfig` or `None`, defaults to `None`):
            Training configuration. `None` builds `XPOConfig(f"{model_name}-XPO")`.
        data_collator (`Callable` or `None`, defaults to `None`):
            Must be None (see [`OnlineDPOTrainer`]).
        train_dataset (`Dataset` or `IterableDataset`):
            Prompt-only data with a `prompt` column.
        eval_dataset (`Dataset`, `IterableDataset`, dict of them or `None`, defaults to `None`):
            Evaluation prompts.
        processing_class (`PreTrainedTokenizerBase` or `None`, defaults to `None`):
            Tokenizer of the policy (and of the reference).
        reward_processing_classes (`PreTrainedTokenizerBase`, a list of them or `None`, defaults to `None`):
            Tokenizers of the reward models.
        peft_config (`PeftConfig` or `None`, defaults to `None`):
            Adapter configuration.
        compute_metrics (`Callable` or `None`, defaults to `None`):
            Accepted for compatibility; unused.
        callbacks (`list[TrainerCallback]` or `None`, defaults to `None`):
            Extra callbacks.
        optimizers (`tuple`, defaults to `(None, None)`):
            Optimizer and scheduler to use instead of the defaults.
        preprocess_logits_for_metrics (`Callable` or `None`, defaults to `None`):
            Accepted for compatibility; unused.
        judge (`BasePairwiseJudge` or `None`, defaults to `None`):
            Pairwise judge ranking each (policy, reference) pair. Exclusive with `reward_funcs`.
    """

    _tag_names = ["trl", "xpo"]
    _name = "XPO"
    _paper = {
        "title": "Exploratory Preference Optimization: Harnessing Implicit Q*-Approximation for Sample-Efficient RLHF",
        "id": "2405.21046",
        "citation": (
            "@article{xie2024exploratory,\n"
            "    title        = {{Exploratory Preference Optimization: Harnessing Implicit Q*-Approximation for "
            "Sample-Efficient RLHF}},\n"
            "    author       = {Tengyang Xie and Dylan J. Foster and Akshay Krishnamurthy and Corby Rosset and Ahmed "
            "Awadallah and Alexander Rakhlin},\n"
            "    year         = 2024,\n"
            "    eprint       = {arXiv:2405.21046}\n"
            "}"
        ),
    }
    _config_class = XPOConfig
    _policy_samples_per_prompt = 1
    _reward_models_score_ids = True

    def __init__(
        self,
        model: "str | PreTrainedModel | nn.Module" = None,
        ref_model: "str | PreTrainedModel | nn.Module | None" = None,
        reward_funcs: RewardFunc | list[RewardFunc] | None = None,
        args: XPOConfig | None = None,
        data_collator: Callable | None = None,
        train_dataset: Dataset | IterableDataset | None = None,
        eval_dataset: Dataset | dict[str, Dataset] | None = None,
        processing_class: PreTrainedTokenizerBase | ProcessorMixin | None = None,
        reward_processing_classes: PreTrainedTokenizerBase | list[PreTrainedTokenizerBase] | None = None,
        peft_config: Any = None,
        compute_metrics: Callable | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (None, None),
        preprocess_logits_for_metrics: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        judge: Any = None,
    ):
        super().__init__(
            model=model,
            ref_model=ref_model,
            reward_funcs=reward_funcs,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes,
            peft_config=peft_config,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            judge=judge,
        )
        self._alpha_schedule = _schedule_values(self.args.alpha)

    @property
    def alpha(self) -> float:
        """The exploration weight of the current epoch (`args.alpha` may hold one value per epoch)."""
        return self._epoch_value(self._alpha_schedule)

    def _generate_pairs(self, rows: list[dict[str, Any]]) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
        # First completion: the policy (through the core's backend); second: the reference, with transformers.
        output = self._generate_rows(rows)
        prompt_lists = output["prompt_ids"]
        if self.ref_model is not None:
            with self._unwrapped_for_generation(self.ref_model) as reference:
                ref_completions = self._generate_with(reference, prompt_lists)
        else:  # PEFT policy: the reference is the base model, adapters disabled
            with self._unwrapped_for_generation(self.model_wrapped) as policy, use_adapter(policy, None):
                ref_completions = self._generate_with(policy, prompt_lists)
        return prompt_lists, output["completion_ids"], ref_completions

    def _compute_loss(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        beta, alpha = self.beta, self.alpha
        logps, ref_logps, aux_loss = self._sequence_logps(model, inputs)
        num_pairs = logps.shape[0] // 2
        chosen, rejected, valid = self._chosen_rejected(inputs["first_win_prob"])
        dpo_losses, xpo_losses = xpo_loss(
            logps[chosen],
            logps[rejected],
            ref_logps[chosen],
            ref_logps[rejected],
            logps[num_pairs:],
            beta,
            alpha,
            self.args.loss_type,
        )
        valid_f = valid.to(dpo_losses.dtype)
        dpo_term = torch.where(valid, dpo_losses, torch.zeros_like(dpo_losses)).sum() / valid_f.sum().clamp(min=1.0)
        # The exploration term does not depend on the verdict: every reference sample counts.
        xpo_term = xpo_losses.mean()
        loss = (dpo_term + xpo_term) / self._gradient_accumulation_divisor()
        loss = self._add_aux_loss(loss, aux_loss)

        with torch.no_grad():
            logps, ref_logps = logps.detach(), ref_logps.detach()
            chosen_rewards = beta * (logps[chosen] - ref_logps[chosen])
            rejected_rewards = beta * (logps[rejected] - ref_logps[rejected])
            count = valid_f.sum()

            def over_pairs(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                return (values.float() * valid_f).sum(), count

            contains_eos = inputs["contains_eos"].float()
            # As TRL logs them: KL and entropy over both completions of every pair; `logps/*` add the policy's and
            # the reference's log-probability of the chosen / rejected completion; the score margin is policy
            # sample - reference sample, whichever won.
            means = {
                "loss/xpo": xpo_term.detach(),
                "objective/kl": (logps - ref_logps).mean(),
                "objective/entropy": -logps.mean(),
                "val/model_contain_eos_token": contains_eos[:num_pairs].mean(),
                "val/ref_contain_eos_token": contains_eos[num_pairs:].mean(),
                "alpha": alpha,
                "beta": beta,
            }
            ratios = {"loss/dpo": over_pairs(dpo_losses.detach())}
            if "scores" in inputs:
                scores = inputs["scores"]
                means["objective/model_scores"] = scores[:num_pairs].mean()
                means["objective/ref_scores"] = scores[num_pairs:].mean()
                means["objective/scores_margin"] = (scores[:num_pairs] - scores[num_pairs:]).mean()
            ratios.update(
                {
                    "rewards/chosen": over_pairs(chosen_rewards),
                    "rewards/rejected": over_pairs(rejected_rewards),
                    "rewards/accuracies": over_pairs(chosen_rewards > rejected_rewards),
                    "rewards/margins": over_pairs(chosen_rewards - rejected_rewards),
                    "logps/chosen": over_pairs(logps[chosen] + ref_logps[chosen]),
                    "logps/rejected": over_pairs(logps[rejected] + ref_logps[rejected]),
                }
            )
            self._record_batch_metrics(self._mode, means=means, ratios=ratios)
        return loss
