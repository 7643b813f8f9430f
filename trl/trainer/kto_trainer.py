"""Kahneman-Tversky Optimization (KTO) trainer for unpaired desirable / undesirable completions.

The machinery every unpaired-preference trainer shares (the experimental BCO trainer reuses it) lives in
`unpaired_preference_base.py`: dataset preparation (unpairing of paired data, tokenization, label checks, the
mismatched "KL" completions), the collator, the policy / reference log-probability passes and the sum-and-count
metrics. This module holds the KTO loss and the trainer.
"""

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from datasets import Dataset, IterableDataset
from transformers import (
    BaseImageProcessor,
    DataCollator,
    FeatureExtractionMixin,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    ProcessorMixin,
    TrainerCallback,
)
from transformers.trainer_utils import EvalPrediction

from ..models.peft import BF16_ADAPTERS
from .kto_config import KTOConfig
from .unpaired_preference_base import DataCollatorForUnpairedPreference, _UnpairedPreferenceTrainer
from .utils.ignored_options import KTO_IGNORED_OPTIONS
from .vision_collators import DataCollatorForVisionUnpairedPreference  # noqa: F401  (public here, as in TRL)


# ----------------------------------------------------------------------------------------------------------------
# Losses
# ----------------------------------------------------------------------------------------------------------------
def kto_kl_reference_point(policy_kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor) -> torch.Tensor:
    """KTO's reference point: the policy-to-reference KL estimated on mismatched pairs, clamped at zero, detached.

    Args:
        policy_kl_logps: `(n,)` summed log-probs of the KL completions (each scored after another example's prompt)
            under the policy.
        ref_kl_logps: `(n,)` the same under the reference model.

    Returns:
        A scalar `max(0, mean(policy_kl_logps - ref_kl_logps))` (0 for an empty batch).
    """
    if policy_kl_logps.numel() == 0:
        return policy_kl_logps.new_zeros(())
    return (policy_kl_logps - ref_kl_logps).mean().clamp(min=0).detach()


def kto_loss(
    policy_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    label: torch.Tensor,
    kl: torch.Tensor | float = 0.0,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    loss_type: str = "kto",
) -> torch.Tensor:
    """Per-example loss of KTO (or of unpaired APO-zero) from sequence log-probabilities.

    With `r = beta * (policy_logps - ref_logps)` the implied reward and `z = beta * kl` the reference point:

    - `kto`: desirable examples lose `1 - sigmoid(r - z)`, undesirable ones `1 - sigmoid(z - r)`;
    - `apo_zero_unpaired`: desirable examples lose `1 - sigmoid(r)`, undesirable ones `sigmoid(r)` (no KL).

    Desirable losses are multiplied by `desirable_weight`, undesirable ones by `undesirable_weight`.

    Args:
        policy_logps: `(n,)` summed completion log-probs under the policy.
        ref_logps: `(n,)` the same under the reference.
        label: `(n,)` bool, True for desirable examples.
        kl: The (detached) KL reference point, see [`kto_kl_reference_point`].
        beta: KL strength.
        desirable_weight: Weight of desirable losses.
        undesirable_weight: Weight of undesirable losses.
        loss_type: `"kto"` or `"apo_zero_unpaired"`.

    Returns:
        `(n,)` losses (average them for the batch loss).
    """
    logratios = policy_logps - ref_logps
    if loss_type == "kto":
        chosen_losses = 1 - torch.sigmoid(beta * (logratios - kl))
        rejected_losses = 1 - torch.sigmoid(beta * (kl - logratios))
    elif loss_type == "apo_zero_unpaired":
        chosen_losses = 1 - torch.sigmoid(beta * logratios)
        rejected_losses = torch.sigmoid(beta * logratios)
    else:
        raise ValueError(f"Unknown loss_type {loss_type!r}; expected 'kto' or 'apo_zero_unpaired'.")
    label = label.to(torch.bool)
    return torch.where(label, desirable_weight * chosen_losses, undesirable_weight * rejected_losses)


# ----------------------------------------------------------------------------------------------------------------
# Trainer
# ----------------------------------------------------------------------------------------------------------------
class KTOTrainer(_UnpairedPreferenceTrainer):
    """Trainer for Kahneman-Tversky Optimization (KTO).

    KTO learns from unpaired feedback: each example is a prompt, one completion and a boolean label saying whether
    the completion is desirable. The implied reward `beta * log(pi / pi_ref)` of desirable completions is pushed above,
    and that of undesirable ones below, a reference point: the policy-to-reference KL, estimated on mismatched
    prompt/completion pairs of the same batch. Paired preference data is unpaired automatically (chosen -> desirable,
    rejected -> undesirable).

    Speed: the reference scores the main and the KL sequences in a single no-grad forward pass and the policy scores
    the KL sequences in a no-grad pass next to its gradient pass, all packed without padding when the model's
    attention supports packed sequences; with `precompute_ref_log_probs=True` the reference pass happens once, before
    training.

    Example:

    ```python
    from trl import KTOConfig, KTOTrainer
    from trl.assets import get_model_path, load_test_dataset

    trainer = KTOTrainer(
        model=get_model_path("tiny-Qwen2ForCausalLM"),
        args=KTOConfig(output_dir="kto-out", max_steps=5),
        train_dataset=load_test_dataset("standard_unpaired_preference", split="train"),
    )
    trainer.train()
    ```

    Args:
        model (`str`, `PreTrainedModel` or `PeftModel`):
            Model to train: a path or hub id (loaded with `args.model_init_kwargs`; dtype float32 unless given) or an
            instantiated causal language model.
        ref_model (`PreTrainedModel` or `None`, defaults to `None`):
            Reference model. `None` creates a frozen copy of `model`, except with a PEFT model (the reference is the
            model with its adapters disabled) and with `precompute_ref_log_probs=True` (the untrained policy itself
            scores the dataset once).
        args (`KTOConfig` or `None`, defaults to `None`):
            Training configuration. `None` builds `KTOConfig(f"{model_name}-KTO")`.
        data_collator (`DataCollator` or `None`, defaults to `None`):
            Batch collator. Defaults to [`DataCollatorForUnpairedPreference`]; a custom one must return the same keys.
        train_dataset (`Dataset` or `IterableDataset`):
            Unpaired preference data (`prompt`, `completion`, boolean `label`), or paired preference data (`prompt`,
            `chosen`, `rejected`, or `chosen` / `rejected` with an implicit prompt), standard or conversational, with
            optional `tools` and `chat_template_kwargs` columns; or pre-tokenized `prompt_ids`, `completion_ids`,
            `label`.
        eval_dataset (`Dataset`, `IterableDataset`, dict of them or `None`, defaults to `None`):
            Evaluation data in the same formats.
        processing_class (`PreTrainedTokenizerBase`, `ProcessorMixin` or `None`, defaults to `None`):
            Tokenizer; loaded from the model's path when omitted (a missing pad token is set to the eos token).
        compute_metrics (`Callable` or `None`, defaults to `None`):
            Metric function for evaluation; receives, as in TRL, the policy's logits `(n, T, V)` of the padded
            `prompt + completion` sequences as predictions and their token ids `(n, T)` as labels (batches padded to
            one length with -100).
        callbacks (`list[TrainerCallback]` or `None`, defaults to `None`):
            Extra callbacks.
        optimizers (`tuple`, defaults to `(None, None)`):
            Optimizer and scheduler to use instead of the defaults.
        quantization_config (`BitsAndBytesConfig` or `None`, defaults to `None`):
            Quantization used when `model` is a string.
        peft_config (`PeftConfig` or `None`, defaults to `None`):
            Adapter configuration; the model is wrapped with `peft.get_peft_model`.
    """

    _accepts_images = True

    _tag_names = ["trl", "kto"]
    _ignored_options = KTO_IGNORED_OPTIONS
    _name = "KTO"
    _quantized_base = BF16_ADAPTERS
    _reference_copies_given_adapter = True
    _uncalled_trl_hooks = {
        "_precompute_ref_logps": "after Trainer.__init__ to add the reference columns when precompute_ref_log_probs",
        "_compute_kl_logps": "from _compute_loss for the log-probs of the mismatched KL completions",
    }
    _keep_raw_columns = True
    _interleave_unpaired = False
    _template_file = "lm_model_card.md"
    _paper = {
        "title": "KTO: Model Alignment as Prospect Theoretic Optimization",
        "id": "2402.01306",
        "citation": (
            "@article{ethayarajh2024kto,\n"
            "    title        = {{KTO: Model Alignment as Prospect Theoretic Optimization}},\n"
            "    author       = {Kawin Ethayarajh and Winnie Xu and Niklas Muennighoff and Dan Jurafsky and Douwe "
            "Kiela},\n"
            "    year         = 2024,\n"
            "    eprint       = {arXiv:2402.01306},\n"
            "}"
        ),
    }

    def __init__(
        self,
        model: "str | PreTrainedModel | nn.Module",
        ref_model: "PreTrainedModel | nn.Module | str | None" = None,
        args: KTOConfig | None = None,
        data_collator: DataCollator | None = None,
        train_dataset: Dataset | IterableDataset | None = None,
        eval_dataset: Dataset | IterableDataset | dict[str, Dataset | IterableDataset] | None = None,
        processing_class: PreTrainedTokenizerBase
        | BaseImageProcessor
        | FeatureExtractionMixin
        | ProcessorMixin
        | None = None,
        compute_metrics: Callable[[EvalPrediction], dict] | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
    ):
        # ---- Config --------------------------------------------------------------------------------------------
        if args is None:
            args = self._default_args(KTOConfig, model)
        self._check_train_dataset(train_dataset, "KTOTrainer")
        if args.loss_type == "kto" and args.train_sampling_strategy != "sequential":
            raise ValueError(
                "Loss type `'kto'` estimates the KL divergence term and requires `train_sampling_strategy='sequential'` "
                "because the KL completion for each example is precomputed against its neighbors in a fixed-order "
                f"batch; any other strategy breaks that pairing. Got `train_sampling_strategy="
                f"{args.train_sampling_strategy!r}`. Shuffle the dataset beforehand (`dataset.shuffle(seed=...)`) and "
                "keep the default 'sequential', or use loss_type='apo_zero_unpaired', which has no KL term."
            )
        if args.loss_type == "kto" and args.per_device_train_batch_size < 2:
            raise ValueError(
                "Actual (not effective) batch size must be > 1. KTO will not work properly because the KL term will "
                f"be equivalent to the implied reward. Got per_device_train_batch_size="
                f"{args.per_device_train_batch_size}: KTO estimates its KL reference point from mismatched "
                "prompt/completion pairs within a batch. Use per_device_train_batch_size >= 2 (4 or more "
                "recommended), or loss_type='apo_zero_unpaired'."
            )
        self._prepare_iterable_args(args, train_dataset)
        self._check_reference_options(args, "KTOTrainer")
        self._warn_liger_kernel_deprecated(args, "KTOTrainer")

        # ---- Model, processing class, MoE router loss, PEFT ----------------------------------------------------
        model_arg = model
        model, processing_class, tokenizer = self._load_policy(
            model, ref_model, processing_class, args, peft_config, quantization_config
        )

        # ---- Reference model -----------------------------------------------------------------------------------
        ref_model = self._build_preference_ref_model(model_arg, model, ref_model, args)

        # ---- Collator, layout, KL ------------------------------------------------------------------------------
        self.pad_token_id = tokenizer.convert_tokens_to_ids(tokenizer.pad_token)
        self._layout = self._choose_layout(model, padding_free=False)
        self._ref_layout = self._choose_layout(ref_model, padding_free=False) if ref_model is not None else None
        self._needs_kl = args.loss_type == "kto"
        # The KL rows repeat their example's prompt: continue them from its recorded keys/values (policy, reference).
        self._share_kl_prefix = self._needs_kl and self._can_share_kl_prefix(model, ref_model, args)
        # TRL's public attributes of the loss (the loss reads them, so a callback may change them)
        self.beta, self.loss_type = args.beta, args.loss_type
        self.desirable_weight, self.undesirable_weight = args.desirable_weight, args.undesirable_weight
        self.precompute_ref_logps = args.precompute_ref_log_probs
        self._ref_adapter_name = None
        if self._setup_vision(train_dataset, processing_class, args):  # pixel values belong to whole rows
            self._layout = "padded"
            self._ref_layout = "padded" if ref_model is not None else None
            if data_collator is None:
                data_collator = DataCollatorForVisionUnpairedPreference(
                    processor=processing_class,
                    max_length=args.max_length,
                    calculate_kl=self._needs_kl,
                    pad_to_multiple_of=args.pad_to_multiple_of,
                )
        if data_collator is None:
            data_collator = DataCollatorForUnpairedPreference(
                pad_token_id=self.pad_token_id,
                max_length=args.max_length,
                pad_to_multiple_of=args.pad_to_multiple_of,
            )

        # ---- Datasets ------------------------------------------------------------------------------------------
        train_dataset = self._prepare_dataset(train_dataset, processing_class, args, "train")
        self._warn_if_unbalanced(train_dataset, args.desirable_weight, args.undesirable_weight)
        eval_dataset = self._prepare_eval_datasets(
            eval_dataset,
            lambda dataset, name: self._prepare_dataset(dataset, processing_class, args, name),
        )

        # ---- Trainer -------------------------------------------------------------------------------------------
        self._init_trainer(
            ref_model,
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        if args.precompute_ref_log_probs:
            self._precompute_reference_columns(
                self.compute_ref_log_probs,
                self._precompute_columns(),
                args.precompute_ref_batch_size,
                args.precompute_ref_batch_size,
            )
        self._add_model_tags(self.model)

    # TRL's names of settings the trainer resolved
    @property
    def calculate_KL(self) -> bool:  # noqa: N802 - TRL's public name
        """Whether the loss uses the KL reference point (`loss_type="kto"`)."""
        return self._needs_kl

    @calculate_KL.setter
    def calculate_KL(self, value: bool) -> None:  # noqa: N802
        self._needs_kl = bool(value)

    @property
    def aux_loss_enabled(self) -> bool:
        """Whether the MoE router's load-balancing loss is added (see `router_aux_loss_coef`)."""
        return self._aux_loss_enabled

    @aux_loss_enabled.setter
    def aux_loss_enabled(self, value: bool) -> None:
        self._aux_loss_enabled = bool(value)

    @property
    def router_aux_loss_coef(self) -> float:
        """The weight of the router loss (0.0 when it is off)."""
        return self._aux_loss_coef

    @router_aux_loss_coef.setter
    def router_aux_loss_coef(self, value: float) -> None:
        self._aux_loss_coef = float(value)

    def _prepare_eval_dataset(self, dataset: Any, name: str) -> Any:
        """A dataset given to `evaluate()`: prepared like the constructor's `eval_dataset` (a prepared one, with its
        token ids and KL completions, is returned unchanged)."""
        return self._prepare_dataset(dataset, self.processing_class, self.args, name)

    # ------------------------------------------------------------------------------------------------------------
    # Loss
    # ------------------------------------------------------------------------------------------------------------
    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ):
        return self._compute_loss(model, inputs, return_outputs)

    @property
    def _reference_pass_after_policy_forward(self) -> bool:
        """Whether `_compute_loss` scores with the reference after the policy's forward, as TRL does (see
        `_reference_may_run_first`); before it otherwise."""
        return not self._reference_may_run_first(KTOTrainer)

    def _compute_loss(self, model: nn.Module, inputs: dict[str, torch.Tensor | Any], return_outputs: bool):
        """TRL's hook: the loss of one collated batch (and the chosen/rejected rewards when `return_outputs`);
        `compute_loss` calls it."""
        mode = self._mode
        label = inputs["label"].bool()
        n = label.shape[0]
        # The reference pass runs first unless `_reference_pass_after_policy_forward` says otherwise (see DPO's).
        reference_first = not self._reference_pass_after_policy_forward
        if reference_first:
            ref = self._reference_logps(model, inputs)
        policy = self._policy_pass(model, inputs)
        if not reference_first:
            ref = self._reference_logps(model, inputs)
        ref_logps = ref["ref_logps"].to(policy.logps)

        if self._needs_kl:
            if policy.kl_logps is None or "ref_KL_logps" not in ref:
                raise ValueError(
                    "loss_type='kto' needs the KL completions ('KL_completion_ids') in every example of the batch, "
                    "but this batch has none (no 'KL_input_ids'). The trainer adds them when it prepares the "
                    "datasets; a custom collator must keep them (see DataCollatorForUnpairedPreference)."
                )
            local_kl = (
                (policy.kl_logps - ref["ref_KL_logps"].to(policy.kl_logps)).mean() if n else policy.logps.new_zeros(())
            )
            # The reference point is shared by all processes: the mean of their batch estimates, clamped at 0.
            kl = self.accelerator.gather(local_kl.detach().reshape(1)).mean().clamp(min=0).to(policy.logps)
        else:
            kl = policy.logps.new_zeros(())

        losses = kto_loss(
            policy.logps,
            ref_logps,
            label,
            kl,
            beta=self.beta,
            desirable_weight=self.desirable_weight,
            undesirable_weight=self.undesirable_weight,
            loss_type=self.loss_type,
        )
        loss = losses.mean()
        aux_loss = getattr(policy.outputs, "aux_loss", None) if self._aux_loss_enabled else None
        if aux_loss is not None:
            loss = loss + self._aux_loss_coef * aux_loss

        rewards = self.beta * (policy.logps - ref_logps).detach()
        with torch.no_grad():
            means = {"kl": kl}
            if aux_loss is not None:
                means["aux_loss"] = aux_loss.detach().float()
            self._record_class_metrics(
                mode,
                label,
                policy.logps.detach(),
                rewards,
                policy,
                means=means,
                num_tokens=inputs["attention_mask"].sum(),
            )
        if return_outputs:
            return loss, {"rewards": rewards, "label": label}
        return loss
