"""Odds Ratio Preference Optimization (ORPO) trainer."""

import torch
import torch.nn.functional as F

from ...trainer.utils.ignored_options import ORPO_IGNORED_OPTIONS
from ..reference_free_base import _ReferenceFreePreferenceTrainer
from .orpo_config import ORPOConfig


def orpo_log_odds_ratio(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor) -> torch.Tensor:
    r"""Log odds ratio of the chosen over the rejected completion, from per-token mean log-probabilities.

    With $\ell = \frac{1}{|y|}\log \pi(y|x)$ (so $p = e^{\ell} \in (0, 1)$) and
    $\operatorname{odds}(p) = \frac{p}{1-p}$:

    $$ \log\frac{\operatorname{odds}(p_c)}{\operatorname{odds}(p_r)} = (\ell_c - \ell_r) - \left(\log(1 - e^{\ell_c}) -
    \log(1 - e^{\ell_r})\right) $$

    Args:
        chosen_logps: `(n,)` mean log-probabilities of the chosen completions (< 0).
        rejected_logps: `(n,)` same for the rejected ones.

    Returns:
        `(n,)` log odds ratios.
    """
    return (chosen_logps - rejected_logps) - (
        torch.log1p(-torch.exp(chosen_logps)) - torch.log1p(-torch.exp(rejected_logps))
    )


def orpo_loss(
    chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, beta: float = 0.1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""ORPO's per-pair odds-ratio loss (the NLL of the chosen sequence is added outside).

    $$ \mathcal{L}_{OR} = -\beta \log\sigma\!\left(\log\frac{\operatorname{odds}(p_c)}{\operatorname{odds}(p_r)}\right),
    \qquad \mathcal{L}_{ORPO} = \mathcal{L}_{NLL}(y_c) + \operatorname{mean}(\mathcal{L}_{OR}) $$

    Args:
        chosen_logps: `(n,)` mean log-probabilities of the chosen completions.
        rejected_logps: `(n,)` same for the rejected ones.
        beta: Weight (lambda) of the odds-ratio term.

    Returns:
        `(losses, log_sigmoid_ratio, log_odds, (chosen_rewards, rejected_rewards) stacked)`: the per-pair losses
        `-beta * log sigmoid(log_odds)`, `log sigmoid(log_odds)`, the log odds ratios, and the implicit rewards
        `beta * logps` as a `(2, n)` tensor.
    """
    log_odds = orpo_log_odds_ratio(chosen_logps, rejected_logps)
    ratio = F.logsigmoid(log_odds)
    return -beta * ratio, ratio, log_odds, torch.stack([beta * chosen_logps, beta * rejected_logps])


class ORPOTrainer(_ReferenceFreePreferenceTrainer):
    """Trainer for Odds Ratio Preference Optimization (ORPO): supervised fine-tuning and preference alignment at once.

    ORPO needs no reference model and no separate SFT stage: the loss is the NLL of the chosen sequences (prompt and
    completion) plus `beta` times a penalty on the log odds ratio of the chosen over the rejected completion. No
    reference model is created, so training holds one model in memory.

    Example:

    ```python
    from trl.assets import get_model_path, load_test_dataset
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    trainer = ORPOTrainer(
        model=get_model_path("tiny-Qwen2ForCausalLM"),
        args=ORPOConfig(output_dir="orpo-out", max_steps=5),
        train_dataset=load_test_dataset("standard_preference", split="train"),
    )
    trainer.train()
    ```

    Args:
        model (`str`, `PreTrainedModel` or `None`):
            Causal or encoder-decoder language model to train, or a path / hub id loaded with
            `AutoModelForCausalLM.from_pretrained` (`AutoModelForSeq2SeqLM` for an encoder-decoder checkpoint) and
            `args.model_init_kwargs`. `None` requires `model_init`.
        args (`ORPOConfig` or `None`, defaults to `None`):
            Training configuration. `None` builds `ORPOConfig(f"{model_name}-ORPO")`.
        data_collator (`Callable` or `None`, defaults to `None`):
            Batch collator; defaults to `DataCollatorForReferenceFreePreference`
            (`DataCollatorForEncoderDecoderPreference` for an encoder-decoder model), padding with
            `args.padding_value` when set.
        train_dataset (`Dataset` or `IterableDataset`):
            Preference data, in the formats of `CPOTrainer`.
        eval_dataset (`Dataset`, `IterableDataset`, dict of them or `None`, defaults to `None`):
            Evaluation data in the same formats.
        processing_class (`PreTrainedTokenizerBase` or `None`, defaults to `None`):
            Tokenizer; loaded from the model's path when omitted (a missing pad token is set to the eos token).
        model_init (`Callable` or `None`, defaults to `None`):
            Builds the model when `model` is None.
        callbacks (`list[TrainerCallback]` or `None`, defaults to `None`):
            Extra callbacks.
        optimizers (`tuple`, defaults to `(None, None)`):
            Optimizer and scheduler to use instead of the defaults.
        preprocess_logits_for_metrics (`Callable` or `None`, defaults to `None`):
            Applied to the predictions before they are stored for `compute_metrics`.
        peft_config (`PeftConfig` or `None`, defaults to `None`):
            Adapter configuration; the model is wrapped with `peft.get_peft_model`.
        compute_metrics (`Callable` or `None`, defaults to `None`):
            Metric function for evaluation. As in TRL, it receives each batch's mean chosen and rejected logits as
            predictions, with labels 0.0.
    """

    _tag_names = ["trl", "orpo"]
    _ignored_options = ORPO_IGNORED_OPTIONS
    _name = "ORPO"
    _config_class = ORPOConfig
    _paper = {
        "title": "ORPO: Monolithic Preference Optimization without Reference Model",
        "id": "2403.07691",
        "citation": (
            "@article{hong2024orpo,\n"
            "    title        = {{ORPO: Monolithic Preference Optimization without Reference Model}},\n"
            "    author       = {Jiwoo Hong and Noah Lee and James Thorne},\n"
            "    year         = 2024,\n"
            "    eprint       = {arXiv:2403.07691}\n"
            "}"
        ),
    }
    _length_normalized = True
    _nll_includes_prompt = True
    _logits_metric_drops_last = True

    def odds_ratio_loss(
        self, policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """TRL's odds-ratio method: `(beta * log sigmoid(log_odds), chosen_rewards, rejected_rewards, mean log
        sigmoid(log_odds), mean log_odds)`; the first entry is *subtracted* from the NLL (see [`orpo_loss`])."""
        losses, ratio, log_odds, rewards = orpo_loss(policy_chosen_logps, policy_rejected_logps, self.args.beta)
        return -losses, rewards[0], rewards[1], ratio.mean(), log_odds.mean()

    def _preference_loss(self, chosen_logps, rejected_logps):
        losses, ratio, log_odds, rewards = orpo_loss(chosen_logps, rejected_logps, self.args.beta)
        return losses, rewards[0], rewards[1], {"log_odds_ratio": ratio.mean(), "log_odds_chosen": log_odds.mean()}
