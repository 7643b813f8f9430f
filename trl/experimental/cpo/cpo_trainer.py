"""Contrastive Preference Optimization (CPO) trainer, with the SimPO and AlphaPO variants."""

import torch
import torch.nn.functional as F

from ...trainer.utils.ignored_options import CPO_IGNORED_OPTIONS
from ..reference_free_base import _ReferenceFreePreferenceTrainer
from .cpo_config import CPOConfig


def alphapo_shaped_logps(logps: torch.Tensor, alpha: float) -> torch.Tensor:
    r"""AlphaPO's reward shape applied to sequence log-probabilities.

    $$ r_\alpha(\ell) = \frac{1 - e^{-\alpha \ell}}{\alpha}, \qquad r_0(\ell) = \ell $$

    `alpha = 0` is the limit (the log-probability itself); `alpha > 0` flattens very unlikely sequences, `alpha < 0`
    stretches them.
    """
    if alpha == 0:
        return logps
    return (1 - torch.exp(-alpha * logps)) / alpha


def cpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    loss_type: str = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    alpha: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""Per-pair preference loss of CPO and its variants, and the implicit rewards, from policy log-probabilities.

    With $r_c = r_\alpha(\ell_c)$, $r_r = r_\alpha(\ell_r)$ (see [`alphapo_shaped_logps`]), $\Delta = r_c - r_r$,
    $\varepsilon$ = `label_smoothing`:

    - `sigmoid` (CPO): $-(1-\varepsilon)\log\sigma(\beta\Delta) - \varepsilon\log\sigma(-\beta\Delta)$
    - `simpo` (SimPO / AlphaPO): the same with $\Delta - \gamma/\beta$, i.e. a target margin $\gamma$ on
      $\beta\Delta$ (`simpo_gamma`)
    - `hinge`: $\max(0, 1 - \beta\Delta)$
    - `ipo`: $(\Delta - \frac{1}{2\beta})^2$

    The rewards are $\beta r_c$ and $\beta r_r$. `ipo` and `simpo` expect length-normalised (per-token mean)
    log-probabilities, the others summed ones; the caller chooses. The behaviour-cloning NLL term is added outside.

    Args:
        chosen_logps: `(n,)` log-probabilities of the chosen completions under the policy.
        rejected_logps: `(n,)` same for the rejected completions.
        loss_type: `"sigmoid"`, `"hinge"`, `"ipo"` or `"simpo"` (AlphaPO is `"simpo"` with `alpha != 0`).
        beta: Temperature (tau for `ipo`).
        label_smoothing: Probability of a flipped label (`sigmoid`, `simpo`).
        simpo_gamma: Target margin of `simpo`.
        alpha: AlphaPO reward shape (0: plain log-probabilities).

    Returns:
        `(losses, chosen_rewards, rejected_rewards)`, each `(n,)`.
    """
    chosen = alphapo_shaped_logps(chosen_logps, alpha)
    rejected = alphapo_shaped_logps(rejected_logps, alpha)
    logits = chosen - rejected
    if loss_type in ("sigmoid", "simpo"):
        if loss_type == "simpo":
            logits = logits - simpo_gamma / beta
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * logits) - label_smoothing * F.logsigmoid(-beta * logits)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * logits)
    elif loss_type == "ipo":
        losses = (logits - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"Unknown loss_type {loss_type!r}; expected sigmoid, hinge, ipo or simpo.")
    return losses, beta * chosen, beta * rejected


class CPOTrainer(_ReferenceFreePreferenceTrainer):
    """Trainer for Contrastive Preference Optimization (CPO) and its reference-free variants SimPO and AlphaPO.

    CPO drops DPO's reference model: the preference term compares the policy's own log-probabilities of the chosen
    and rejected completions, and a behaviour-cloning term (NLL of the chosen completions, weight `cpo_alpha`) keeps
    the policy on the preferred data. SimPO (`loss_type="simpo"`, usually `cpo_alpha=0`) uses per-token mean
    log-probabilities and a target margin; AlphaPO (`loss_type="alphapo"`) adds a reward shape `alpha`. No reference
    model is created, so training holds one model in memory.

    Example:

    ```python
    from trl.assets import get_model_path, load_test_dataset
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    trainer = CPOTrainer(
        model=get_model_path("tiny-Qwen2ForCausalLM"),
        args=CPOConfig(output_dir="cpo-out", max_steps=5, loss_type="simpo", cpo_alpha=0.0),
        train_dataset=load_test_dataset("standard_preference", split="train"),
    )
    trainer.train()
    ```

    Args:
        model (`str`, `PreTrainedModel` or `None`):
            Causal or encoder-decoder language model to train, or a path / hub id loaded with
            `AutoModelForCausalLM.from_pretrained` (`AutoModelForSeq2SeqLM` for an encoder-decoder checkpoint) and
            `args.model_init_kwargs`. `None` requires `model_init`.
        args (`CPOConfig` or `None`, defaults to `None`):
            Training configuration. `None` builds `CPOConfig(f"{model_name}-CPO")`.
        data_collator (`Callable` or `None`, defaults to `None`):
            Batch collator; defaults to `DataCollatorForReferenceFreePreference`
            (`DataCollatorForEncoderDecoderPreference` for an encoder-decoder model).
        train_dataset (`Dataset` or `IterableDataset`):
            Preference data: `prompt`, `chosen`, `rejected` (explicit prompt) or `chosen`, `rejected` (implicit
            prompt, extracted), standard or conversational; or pre-tokenized `prompt_ids`, `chosen_ids`,
            `rejected_ids` (or TRL's `prompt_input_ids`, `chosen_input_ids`, `rejected_input_ids`).
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

    _tag_names = ["trl", "cpo"]
    _ignored_options = CPO_IGNORED_OPTIONS
    _name = "CPO"
    _config_class = CPOConfig
    _paper = {
        "title": "Contrastive Preference Optimization: Pushing the Boundaries of LLM Performance in Machine Translation",
        "id": "2401.08417",
        "citation": (
            "@inproceedings{xu2024contrastive,\n"
            "    title        = {{Contrastive Preference Optimization: Pushing the Boundaries of LLM Performance in "
            "Machine Translation}},\n"
            "    author       = {Haoran Xu and Amr Sharaf and Yunmo Chen and Weiting Tan and Lingfeng Shen and "
            "Benjamin Van Durme and Kenton Murray and Young Jin Kim},\n"
            "    year         = 2024,\n"
            "    booktitle    = {Forty-first International Conference on Machine Learning, {ICML} 2024, Vienna, "
            "Austria, July 21-27, 2024},\n"
            "    publisher    = {OpenReview.net},\n"
            "    url          = {https://openreview.net/forum?id=51iwkioZpn}\n"
            "}"
        ),
    }

    @property
    def _length_normalized(self) -> bool:  # SimPO and IPO compare per-token means
        return self.args.loss_type in ("ipo", "simpo")

    def _nll_weight(self) -> float:
        return self.args.cpo_alpha

    def cpo_loss(
        self, policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[`cpo_loss`] with this trainer's settings: `(losses, chosen_rewards, rejected_rewards)`."""
        args = self.args
        return cpo_loss(
            policy_chosen_logps,
            policy_rejected_logps,
            loss_type=args.loss_type,
            beta=args.beta,
            label_smoothing=args.label_smoothing,
            simpo_gamma=args.simpo_gamma,
            alpha=args.alpha,
        )

    def _preference_loss(self, chosen_logps, rejected_logps):
        return (*self.cpo_loss(chosen_logps, rejected_logps), {})
