"""Direct Preference Optimization (DPO) trainer and its loss variants."""

import dataclasses
import functools
import logging
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from datasets import Dataset, IterableDataset
from transformers import (
    BaseImageProcessor,
    DataCollator,
    FeatureExtractionMixin,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    ProcessorMixin,
    TrainerCallback,
    TrainingArguments,
)
from transformers.trainer_utils import EvalPrediction

from ..data_utils import is_conversational, maybe_extract_prompt
from ..models.peft import BF16_ADAPTERS
from .dpo_config import DPOConfig
from .fast_paths.prefix_sharing import paired_groups, supports_prefix_sharing
from .preference_base import _PreferenceTrainer
from .utils import (
    PromptCompletionTokenizer,
    collate_prompt_completions,
    logits_statistics,
    map_kwargs_with_desc,
    scored_completion_tokens,
)
from .utils.ignored_options import DPO_IGNORED_OPTIONS
from .vision_collators import DataCollatorForVisionPreference  # noqa: F401  (public here, as in TRL)


logger = logging.getLogger(__name__)

# Columns of a tokenized preference dataset (the collator's input), and the optional precomputed reference columns.
_TOKENIZED_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")
_REF_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")
# Column names used by older TRL releases for pre-tokenized data, renamed on the way in.
_LEGACY_TOKENIZED_COLUMNS = {
    "prompt_input_ids": "prompt_ids",
    "chosen_input_ids": "chosen_ids",
    "rejected_input_ids": "rejected_ids",
}
# Losses that use the f-divergence "logits" (and may therefore take a non-default f_divergence_type).
_F_DIVERGENCE_LOSSES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft")
# Losses computed on per-token mean log-probs instead of sums.
_LENGTH_NORMALIZED_LOSSES = ("ipo", "sigmoid_norm")


# ----------------------------------------------------------------------------------------------------------------
# Collator
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class DataCollatorForPreference:
    """Collate tokenized preference pairs into one padded batch holding every chosen and every rejected sequence.

    Each example is a dict with `prompt_ids`, `chosen_ids` and `rejected_ids` (lists of token ids) and optionally
    `ref_chosen_logps` / `ref_rejected_logps` (precomputed reference log-probabilities). The batch has `2 * n` rows:
    the `n` sequences `prompt + chosen` first, then the `n` sequences `prompt + rejected`, right-padded, so that both
    halves go through the model in a single forward pass.

    Returned keys: `input_ids`, `attention_mask`, `completion_mask` (1 on completion tokens), and the reference
    columns when present (as `(n,)` float tensors).

    Args:
        pad_token_id (`int`):
            Token used to pad `input_ids`.
        max_length (`int` or `None`, defaults to `None`):
            Truncate every `prompt + completion` sequence to this many tokens.
        truncation_mode (`str`, defaults to `"keep_start"`):
            `"keep_start"` keeps the first `max_length` tokens, `"keep_end"` the last ones.
        pad_to_multiple_of (`int` or `None`, defaults to `None`):
            Pad the sequence length to a multiple of this value.
        return_tensors (`str`, defaults to `"pt"`):
            Only `"pt"` is supported.

    Example:
    ```python
    >>> collator = DataCollatorForPreference(pad_token_id=0)
    >>> batch = collator([{"prompt_ids": [1, 2], "chosen_ids": [3], "rejected_ids": [4, 5]}])
    >>> batch["input_ids"]
    tensor([[1, 2, 3, 0],
            [1, 2, 4, 5]])
    >>> batch["completion_mask"]
    tensor([[0, 0, 1, 0],
            [0, 0, 1, 1]])
    ```
    """

    pad_token_id: int
    max_length: int | None = None
    truncation_mode: str = "keep_start"
    pad_to_multiple_of: int | None = None
    return_tensors: str = "pt"

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if self.return_tensors != "pt":
            raise ValueError(f"Only return_tensors='pt' is supported; got {self.return_tensors!r}.")
        # chosen sequences first, then rejected ones (one forward pass over both)
        batch = collate_prompt_completions(
            [example["prompt_ids"] for example in examples] * 2,
            [example[key] for key in ("chosen_ids", "rejected_ids") for example in examples],
            self.pad_token_id,
            self.max_length,
            self.truncation_mode,
            self.pad_to_multiple_of,
        )
        for key in _REF_COLUMNS:
            if examples and examples[0].get(key) is not None:
                batch[key] = torch.tensor([float(example[key]) for example in examples], dtype=torch.float32)
        return batch


# ----------------------------------------------------------------------------------------------------------------
# Losses
# ----------------------------------------------------------------------------------------------------------------
def _f_divergence_term(logratios: torch.Tensor, f_divergence_type: str, alpha_coef: float) -> torch.Tensor:
    """`f'(u) - f'(1)` at `u = exp(logratios)`: one side's share of the f-DPO preference logit.

    `f` is the divergence's generator, so reverse KL gives the log-ratio itself (plain DPO). Shifting by `f'(1)` makes
    every divergence give 0 where policy and reference agree, which matters once the two sides are divided by
    different lengths (`ipo`, `sigmoid_norm`). As in TRL, `alpha_coef` enters as `a = 1 - alpha_coef` in
    `f'(u) = (1 - u**-a) / a`: a coefficient of 1 is reverse KL, 0 is forward KL.
    """
    if f_divergence_type == "reverse_kl":  # f'(u) = log(u)
        return logratios
    if f_divergence_type == "forward_kl":  # f'(u) = -1/u
        return -torch.expm1(-logratios)
    if f_divergence_type == "js_divergence":  # f'(u) = log(2u / (1 + u))
        return math.log(2.0) + F.logsigmoid(logratios)
    if f_divergence_type == "alpha_divergence":
        a = 1.0 - alpha_coef
        if a == 0.0:  # the limit a -> 0 is reverse KL
            return logratios
        return -torch.expm1(-a * logratios) / a
    raise ValueError(
        f"f_divergence_type must be one of reverse_kl, forward_kl, js_divergence, alpha_divergence; got "
        f"{f_divergence_type!r}."
    )


def _smoothed_sigmoid_loss(logits: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    return -(1 - label_smoothing) * F.logsigmoid(beta * logits) - label_smoothing * F.logsigmoid(-beta * logits)


def dpo_loss(
    loss_type: str,
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
    discopop_tau: float = 0.05,
) -> torch.Tensor:
    """Per-pair loss of one DPO variant from sequence log-probabilities.

    Args:
        loss_type: One of the losses of [`DPOConfig`] (`"sigmoid"`, `"hinge"`, `"ipo"`, ...).
        chosen_logps: `(n,)` summed log-probabilities of the chosen completions under the policy.
        rejected_logps: `(n,)` same for the rejected completions.
        ref_chosen_logps: `(n,)` summed log-probabilities of the chosen completions under the reference.
        ref_rejected_logps: `(n,)` same for the rejected completions.
        chosen_lengths: `(n,)` number of completion tokens of the chosen sequences (needed by `ipo`, `sigmoid_norm`
            and `sft`, which work on per-token means; `sft` on the token mean over the whole batch).
        rejected_lengths: `(n,)` same for the rejected sequences.
        beta: KL strength (tau for `ipo`).
        label_smoothing: Label-flip probability (`robust`, `aot*`) / EXO epsilon; `sigmoid` and `sigmoid_norm` do not
            read it.
        f_divergence_type: f-DPO divergence used to build the preference logits.
        f_alpha_divergence_coef: Coefficient of the alpha-divergence, TRL's parametrisation: 1 gives reverse KL, 0
            forward KL (see `_f_divergence_term`).
        discopop_tau: Temperature of `discopop`.

    Returns:
        `(n,)` tensor of losses (average it for the batch loss).
    """
    if loss_type in _LENGTH_NORMALIZED_LOSSES or loss_type == "sft":
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError(f"loss_type={loss_type!r} works on per-token means and needs chosen/rejected lengths.")
        chosen_lengths = chosen_lengths.to(chosen_logps.dtype).clamp(min=1)
        rejected_lengths = rejected_lengths.to(rejected_logps.dtype).clamp(min=1)
    if loss_type == "sft":
        # Token-mean NLL of the chosen completions over the whole batch, spread over the pairs: the mean of the
        # returned values is -sum(chosen_logps) / sum(chosen_lengths) (long completions weigh more than short ones).
        return -chosen_logps * (chosen_logps.shape[0] / chosen_lengths.sum())
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps

    if loss_type in _F_DIVERGENCE_LOSSES:
        chosen_term = _f_divergence_term(chosen_logratios, f_divergence_type, f_alpha_divergence_coef)
        rejected_term = _f_divergence_term(rejected_logratios, f_divergence_type, f_alpha_divergence_coef)
        if loss_type in _LENGTH_NORMALIZED_LOSSES:
            # per-token means of each side's term (for reverse KL: of the log-ratios)
            chosen_term, rejected_term = chosen_term / chosen_lengths, rejected_term / rejected_lengths
        logits = chosen_term - rejected_term
        if loss_type in ("sigmoid", "sigmoid_norm"):
            # TRL 1.16 does not smooth these two (its label_smoothing is robust's and EXO's, and AOT's).
            return -F.logsigmoid(beta * logits)
        if loss_type == "hinge":
            return torch.relu(1 - beta * logits)
        if loss_type == "ipo":
            # IPO regresses the log-ratio gap onto 1 / (2 tau), with tau = beta.
            return (logits - 1 / (2 * beta)) ** 2
        if loss_type == "exo_pair":
            epsilon = label_smoothing
            # Reverse KL between the model's preference distribution and the epsilon-smoothed labels.
            return torch.sigmoid(beta * logits) * (
                F.logsigmoid(beta * logits) - math.log(1 - epsilon)
            ) + torch.sigmoid(-beta * logits) * (F.logsigmoid(-beta * logits) - math.log(epsilon))
        if loss_type == "robust":
            return (
                -(1 - label_smoothing) * F.logsigmoid(beta * logits) + label_smoothing * F.logsigmoid(-beta * logits)
            ) / (1 - 2 * label_smoothing)
        if loss_type == "discopop":
            scaled = beta * logits
            modulation = torch.sigmoid(scaled / discopop_tau)
            return -F.logsigmoid(scaled) * (1 - modulation) + torch.exp(-scaled) * modulation

    chosen_rewards = beta * chosen_logratios
    rejected_rewards = beta * rejected_logratios
    if loss_type == "nca_pair":
        return (
            -F.logsigmoid(chosen_rewards) - 0.5 * F.logsigmoid(-chosen_rewards) - 0.5 * F.logsigmoid(-rejected_rewards)
        )
    if loss_type == "bco_pair":
        # Chosen rewards pushed above a decision boundary, rejected ones below it. TRL 1.16 places the boundary at 0
        # in training and evaluation alike (no running or batch mean of the rewards is subtracted).
        return -F.logsigmoid(chosen_rewards) - F.logsigmoid(-rejected_rewards)
    if loss_type == "sppo_hard":
        return (chosen_logratios - 1 / (2 * beta)) ** 2 + (rejected_logratios + 1 / (2 * beta)) ** 2
    if loss_type == "aot":
        # Paired AOT: the policy's chosen-minus-rejected gaps must dominate the reference's, quantile by quantile.
        policy_gaps, _ = torch.sort(chosen_logps - rejected_logps)
        ref_gaps, _ = torch.sort(ref_chosen_logps - ref_rejected_logps)
        return _smoothed_sigmoid_loss(policy_gaps - ref_gaps, beta, label_smoothing)
    if loss_type == "aot_unpaired":
        chosen_sorted, _ = torch.sort(chosen_logratios)
        rejected_sorted, _ = torch.sort(rejected_logratios)
        return _smoothed_sigmoid_loss(chosen_sorted - rejected_sorted, beta, label_smoothing)
    if loss_type == "apo_zero":
        return (1 - torch.sigmoid(chosen_rewards)) + torch.sigmoid(rejected_rewards)
    if loss_type == "apo_down":
        return torch.sigmoid(chosen_rewards) + (1 - torch.sigmoid(chosen_rewards - rejected_rewards))
    raise ValueError(f"Unknown loss_type {loss_type!r}.")


# ----------------------------------------------------------------------------------------------------------------
# Trainer
# ----------------------------------------------------------------------------------------------------------------
class DPOTrainer(_PreferenceTrainer):
    """Trainer for Direct Preference Optimization (DPO) and its variants.

    DPO fits the policy directly on preference pairs: it raises the log-probability of the chosen completion relative
    to the rejected one, measured against a frozen reference model, with no reward model and no sampling. Chosen and
    rejected sequences go through the model in a single forward pass, packed without padding when the model's
    attention supports it; the reference pass runs once per batch without gradients (or not at all with
    `precompute_ref_log_probs=True`).

    Example:

    ```python
    from trl import DPOConfig, DPOTrainer
    from trl.assets import get_model_path, load_test_dataset

    trainer = DPOTrainer(
        model=get_model_path("tiny-Qwen2ForCausalLM"),
        args=DPOConfig(output_dir="dpo-out", max_steps=5),
        train_dataset=load_test_dataset("standard_preference", split="train"),
    )
    trainer.train()
    ```

    Args:
        model (`str`, `PreTrainedModel` or `PeftModel`):
            Model to train: a path or hub id (loaded with `args.model_init_kwargs`; dtype float32 unless given) or an
            instantiated causal language model.
        ref_model (`PreTrainedModel` or `None`, defaults to `None`):
            Reference model. `None` creates a frozen copy of `model`, except with a PEFT model (the reference is the
            model with its adapters disabled, or the adapter `args.ref_adapter_name`) and with
            `precompute_ref_log_probs=True` (the untrained policy itself scores the dataset once).
        args (`DPOConfig` or `None`, defaults to `None`):
            Training configuration. `None` builds `DPOConfig(f"{model_name}-DPO")`.
        data_collator (`DataCollator` or `None`, defaults to `None`):
            Batch collator. Defaults to [`DataCollatorForPreference`]; a custom one must return the same keys.
        train_dataset (`Dataset` or `IterableDataset`):
            Preference data: `prompt`, `chosen`, `rejected` (explicit prompt) or `chosen`, `rejected` (implicit
            prompt, extracted), standard or conversational, with optional `tools` and `chat_template_kwargs` columns;
            or pre-tokenized `prompt_ids`, `chosen_ids`, `rejected_ids`.
        eval_dataset (`Dataset`, `IterableDataset`, dict of them or `None`, defaults to `None`):
            Evaluation data in the same formats.
        processing_class (`PreTrainedTokenizerBase`, `ProcessorMixin` or `None`, defaults to `None`):
            Tokenizer; loaded from the model's path when omitted (a missing pad token is set to the eos token).
        compute_metrics (`Callable` or `None`, defaults to `None`):
            Metric function for evaluation. As in TRL, it receives the policy's logits over each batch's padded
            chosen then rejected rows as predictions, and their token ids as labels.
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

    _tag_names = ["trl", "dpo"]
    _ignored_options = DPO_IGNORED_OPTIONS
    _name = "DPO"
    _quantized_base = BF16_ADAPTERS
    _reference_copies_given_adapter = True
    _uncalled_trl_hooks = {
        "_precompute_ref_logps": "after Trainer.__init__ to add the reference columns when precompute_ref_log_probs"
    }
    _template_file = "lm_model_card.md"
    _paper = {
        "title": "Direct Preference Optimization: Your Language Model is Secretly a Reward Model",
        "id": "2305.18290",
        "citation": (
            "@inproceedings{rafailov2023direct,\n"
            "    title        = {{Direct Preference Optimization: Your Language Model is Secretly a Reward Model}},\n"
            "    author       = {Rafael Rafailov and Archit Sharma and Eric Mitchell and Christopher D. Manning and "
            "Stefano Ermon and Chelsea Finn},\n"
            "    year         = 2023,\n"
            "    booktitle    = {Advances in Neural Information Processing Systems 36},\n"
            "}"
        ),
    }

    def __init__(
        self,
        model: "str | PreTrainedModel | nn.Module",
        ref_model: "PreTrainedModel | nn.Module | str | None" = None,
        args: DPOConfig | None = None,
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
            args = self._default_args(DPOConfig, model)
        elif isinstance(args, TrainingArguments) and not isinstance(args, DPOConfig):
            args = _to_dpo_config(args)
        self._check_train_dataset(train_dataset, "DPOTrainer")
        self._prepare_iterable_args(args, train_dataset)
        self._check_dpo_args(args)
        self._check_reference_options(args, "DPOTrainer")
        self._warn_liger_kernel_deprecated(args, "DPOTrainer")

        # ---- Model, processing class, MoE router loss, PEFT ----------------------------------------------------
        model_arg, ref_model_arg = model, ref_model
        model, processing_class, tokenizer = self._load_policy(
            model, ref_model, processing_class, args, peft_config, quantization_config
        )
        self._select_adapters(model, args.model_adapter_name, args.ref_adapter_name)

        # ---- Reference model (also with loss_type=["sft"] alone: the rewards are measured against it) -----------
        ref_model = self._build_preference_ref_model(model_arg, model, ref_model, args)

        # ---- Images: rows are rendered and processed by the collator, forward passes stay padded ----------------
        self._setup_vision(train_dataset, processing_class, args)

        # ---- Collator and layout -------------------------------------------------------------------------------
        self.pad_token_id = tokenizer.convert_tokens_to_ids(tokenizer.pad_token)
        self._layout = self._choose_layout(model, args.padding_free, warn=True)
        self._ref_layout = self._choose_layout(ref_model, args.padding_free) if ref_model is not None else None
        # A pair's chosen and rejected rows share their prompt: run it once (see `supports_prefix_sharing`).
        share = not (self._is_vision_dataset or args.padding_free or args.precompute_ref_log_probs)
        share = share and not self._aux_loss_enabled and supports_prefix_sharing(model)
        self._share_prefix = share
        self._ref_share_prefix = share and (ref_model is None or supports_prefix_sharing(ref_model))
        if self._is_vision_dataset:  # pixel values belong to whole rows: no packing
            self._layout = "padded"
            self._ref_layout = "padded" if ref_model is not None else None
            if data_collator is None:
                data_collator = DataCollatorForVisionPreference(
                    processor=processing_class, max_length=args.max_length, pad_to_multiple_of=args.pad_to_multiple_of
                )
        if data_collator is None:
            data_collator = DataCollatorForPreference(
                pad_token_id=self.pad_token_id,
                max_length=args.max_length,
                truncation_mode=args.truncation_mode,
                pad_to_multiple_of=args.pad_to_multiple_of,
            )

        # ---- Datasets ------------------------------------------------------------------------------------------
        train_dataset = self._prepare_dataset(train_dataset, processing_class, args, "train")
        eval_dataset = self._prepare_eval_datasets(
            eval_dataset, lambda dataset, name: self._prepare_dataset(dataset, processing_class, args, name)
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
                _REF_COLUMNS,
                args.precompute_ref_batch_size,
                args.precompute_ref_batch_size,
                # as in TRL, a reference model the user passed is kept (datasets given to evaluate() need it later)
                release_reference=ref_model_arg is None,
            )
        self._add_model_tags(self.model)

    def _prepare_eval_dataset(self, dataset: Any, name: str) -> Any:
        """A dataset given to `evaluate()`: prepared as the constructor's `eval_dataset` (unchanged when already
        prepared), with its reference log-probs computed first when `precompute_ref_log_probs=True`."""
        dataset = self._prepare_dataset(dataset, self.processing_class, self.args, name)
        if self.args.precompute_ref_log_probs:
            dataset = self._precompute_reference_columns_for_eval(
                dataset, self.compute_ref_log_probs, _REF_COLUMNS, self.args.precompute_ref_batch_size
            )
        return dataset

    # ------------------------------------------------------------------------------------------------------------
    # Validation and setup helpers
    # ------------------------------------------------------------------------------------------------------------
    @staticmethod
    def _check_dpo_args(args: DPOConfig) -> None:
        """Combinations of options that cannot work, rejected before anything is loaded."""
        losses = list(args.loss_type)
        if args.loss_weights is not None and len(args.loss_weights) != len(losses):
            raise ValueError(
                f"loss_weights needs one weight per loss_type entry: loss_type={losses} has {len(losses)} entries but "
                f"loss_weights={args.loss_weights} has {len(args.loss_weights)}."
            )
        if args.f_divergence_type != "reverse_kl":
            unsupported = [loss for loss in losses if loss not in _F_DIVERGENCE_LOSSES]
            if unsupported:
                raise ValueError(
                    f"`f_divergence_type={args.f_divergence_type!r}` is only supported for the following loss types: "
                    f"{sorted(_F_DIVERGENCE_LOSSES)}. You provided {unsupported}. Use the default "
                    "`f_divergence_type='reverse_kl'` with these losses."
                )
        if args.use_weighting and any(loss in ("aot", "aot_unpaired") for loss in losses):
            raise ValueError(
                "use_weighting=True (WPO) cannot be combined with loss_type 'aot' / 'aot_unpaired', whose quantile "
                "matching sorts the pairs. Drop one of the two."
            )
        if "robust" in losses and not 0.0 <= args.label_smoothing < 0.5:
            raise ValueError(
                f"loss_type='robust' needs 0 <= label_smoothing < 0.5 (the label-noise rate); got "
                f"{args.label_smoothing}."
            )
        if "exo_pair" in losses and not 0.0 < args.label_smoothing < 1.0:
            raise ValueError(
                "Label smoothing must be greater than 0.0 when using 'exo_pair' loss. The EXO paper recommends a value "
                f"of 1e-3. loss_type='exo_pair' needs label_smoothing in (0, 1) (its epsilon); got {args.label_smoothing}."
            )
        if not 0.0 <= args.label_smoothing < 1.0 and set(losses) & {"aot", "aot_unpaired"}:
            raise ValueError(f"label_smoothing must be in [0, 1); got {args.label_smoothing}.")
        if args.beta <= 0 and any(loss in ("ipo", "sppo_hard") for loss in losses):
            raise ValueError(f"loss_type 'ipo' / 'sppo_hard' divide by beta, which must be > 0; got {args.beta}.")

    # ------------------------------------------------------------------------------------------------------------
    # Dataset preparation
    # ------------------------------------------------------------------------------------------------------------
    def _prepare_dataset(
        self, dataset: Dataset | IterableDataset, processing_class: Any, args: DPOConfig, dataset_name: str
    ) -> Dataset | IterableDataset:
        if self._is_vision_dataset:  # the vision collator renders and processes the raw rows
            return dataset
        dataset, first, columns, map_kwargs, is_iterable = self._open_dataset(
            dataset,
            args,
            dataset_name,
            _LEGACY_TOKENIZED_COLUMNS,
            f"The {dataset_name} dataset is empty; DPOTrainer needs at least one preference pair.",
        )
        if all(c in columns for c in _TOKENIZED_COLUMNS):
            tokenized = dataset
        else:
            missing = [c for c in ("chosen", "rejected") if c not in columns]
            if missing:
                raise ValueError(
                    f"The {dataset_name} dataset has columns {columns}, but DPOTrainer needs preference data with "
                    f"'chosen' and 'rejected' columns (missing: {missing}), plus an optional 'prompt' (otherwise the "
                    "shared beginning of chosen and rejected is used as the prompt), or pre-tokenized 'prompt_ids', "
                    "'chosen_ids' and 'rejected_ids'. Rename your columns (dataset.rename_column(old, new))."
                )
            conversational = is_conversational(first)
            if conversational:
                self._check_chat_template(processing_class, dataset_name)
            dataset = dataset.map(
                maybe_extract_prompt, **map_kwargs_with_desc(map_kwargs, f"Extracting prompt in {dataset_name}")
            )
            # The raw columns stay beside the token columns (as in TRL); the trainer's dataloader drops them.
            tokenize = _PreferenceTokenizer(processing_class, conversational)
            tokenized = dataset.map(tokenize, **map_kwargs_with_desc(map_kwargs, f"Tokenizing {dataset_name}"))

        # Drop pairs where truncation would leave the chosen or the rejected completion without a scored token.
        max_length, mode = args.max_length, args.truncation_mode
        keep_fn = _HasTargets(max_length, mode)
        if not is_iterable:
            flags = [
                keep_fn.check(len(p), len(c), len(r))
                for p, c, r in zip(tokenized["prompt_ids"], tokenized["chosen_ids"], tokenized["rejected_ids"])
            ]
            shortest = min(len(p) for p in tokenized["prompt_ids"])
            none_left = (
                f"No {dataset_name} pair has a completion token left to train on: with max_length={max_length} and "
                f"truncation_mode={mode!r}, every prompt fills the whole length (the shortest prompt is {shortest} "
                "tokens, expected fewer than max_length) or a completion is empty. Raise max_length, shorten the "
                "prompts, or use truncation_mode='keep_end'."
            )
            tokenized = self._keep_flagged(tokenized, flags, dataset_name, "pairs", max_length, none_left)
        else:
            tokenized = tokenized.filter(keep_fn)
        return tokenized

    # ------------------------------------------------------------------------------------------------------------
    # Log-probabilities
    # ------------------------------------------------------------------------------------------------------------
    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = [*_TOKENIZED_COLUMNS, *_REF_COLUMNS]
            if self._is_vision_dataset:
                self._signature_columns += ["prompt", "chosen", "rejected", "images", "image"]

    def _sequence_logps(self, token_logps: torch.Tensor, target_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Summed log-prob and scored-token count of each sequence (LD-DPO down-weights the longer tail)."""
        mask = target_mask.to(token_logps.dtype)
        counts = target_mask.sum(dim=1)
        if self.args.ld_alpha is None:
            return (token_logps * mask).sum(dim=1), counts
        num_pairs = token_logps.shape[0] // 2
        rank = target_mask.long().cumsum(dim=1) - 1  # index of each scored token inside its completion
        shared = torch.minimum(counts[:num_pairs], counts[num_pairs:]).repeat(2)
        weights = torch.where(rank < shared.unsqueeze(1), 1.0, self.args.ld_alpha).to(token_logps.dtype)
        return (token_logps * mask * weights).sum(dim=1), counts

    def _logits_stats(self, logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-token statistics of the full distribution (WPO's sharpness only when `use_weighting`)."""
        return logits_statistics(logits, targets, sharpness=self.args.use_weighting)

    def compute_ref_log_probs(self, model: nn.Module, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Reference log-probabilities of the chosen and rejected completions of a collated batch.

        Computed without gradients by the reference model, by the PEFT policy with its adapters disabled (or with
        `args.ref_adapter_name` active), or, while precomputing before training, by the untrained policy itself.

        Args:
            model: The policy (used for the PEFT reference and for precomputation).
            inputs: A batch from [`DataCollatorForPreference`].

        Returns:
            `{"ref_chosen_logps": (n,), "ref_rejected_logps": (n,)}` summed log-probabilities.
        """
        target_mask = self._target_mask(inputs)
        layout = self._ref_layout if self.ref_model is not None else self._layout
        with self._reference_module(model, self.args.ref_adapter_name) as reference:
            groups = paired_groups(len(inputs["input_ids"])) if self._ref_share_prefix else None
            result = self._token_logps(reference, inputs, layout, with_stats=False, prefix_groups=groups)
        sums, _ = self._sequence_logps(result.logps.float(), target_mask)
        num_pairs = sums.shape[0] // 2
        return {"ref_chosen_logps": sums[:num_pairs], "ref_rejected_logps": sums[num_pairs:]}

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
        return not self._reference_may_run_first(DPOTrainer)

    def _batch_reference_logps(
        self, model: nn.Module, inputs: dict[str, torch.Tensor | Any], num_pairs: int
    ) -> dict[str, torch.Tensor]:
        """The batch's precomputed reference log-probs, or computed now (`compute_ref_log_probs`, cached when the
        reference is fixed)."""
        if all(key in inputs for key in _REF_COLUMNS):
            return {key: inputs[key].float() for key in _REF_COLUMNS}  # the policy's sums are float32
        parts = [(inputs["input_ids"], inputs["attention_mask"], inputs.get("completion_mask"))]
        compute = functools.partial(self.compute_ref_log_probs, model, inputs)
        return self._reference_values(model, compute, parts, num_pairs)

    def _compute_loss(self, model: nn.Module, inputs: dict[str, torch.Tensor | Any], return_outputs: bool):
        """TRL's hook: the loss of one collated batch (and the chosen/rejected rewards when `return_outputs`);
        `compute_loss` calls it."""
        mode = self._mode
        target_mask = self._target_mask(inputs)
        num_pairs = inputs["input_ids"].shape[0] // 2

        # The reference pass runs first, so that none of its memory sits on the policy's activations (which the last
        # layers may then keep, see `LayerBudget`), unless `_reference_pass_after_policy_forward` says otherwise.
        reference_first = not self._reference_pass_after_policy_forward
        if reference_first:
            ref = self._batch_reference_logps(model, inputs, num_pairs)
        groups = paired_groups(num_pairs * 2) if self._share_prefix else None
        policy = self._token_logps(model, inputs, self._layout, with_stats=True, prefix_groups=groups)
        token_logps = policy.logps.float()
        sums, counts = self._sequence_logps(token_logps, target_mask)
        chosen_logps, rejected_logps = sums[:num_pairs], sums[num_pairs:]
        chosen_lengths, rejected_lengths = counts[:num_pairs], counts[num_pairs:]
        plain_chosen_logps = chosen_logps
        if self.args.ld_alpha is not None:
            plain_chosen_logps = (token_logps[:num_pairs] * target_mask[:num_pairs]).sum(dim=1)
        if not reference_first:
            ref = self._batch_reference_logps(model, inputs, num_pairs)
        ref_chosen_logps, ref_rejected_logps = ref["ref_chosen_logps"], ref["ref_rejected_logps"]

        pair_weights = None
        if self.args.use_weighting:
            # WPO: length-normalised, sharpness-adjusted probability of both completions under the current policy.
            adjusted = (token_logps.detach() - policy.stats["log_sum_sq_probs"]) * target_mask
            mean_adjusted = adjusted.sum(dim=1) / counts.clamp(min=1)
            pair_weights = torch.exp(mean_adjusted[:num_pairs] + mean_adjusted[num_pairs:]).clamp(max=1.0)

        weights = self.args.loss_weights or [1.0] * len(self.args.loss_type)
        loss = token_logps.new_zeros(())
        for loss_type, weight in zip(self.args.loss_type, weights):
            losses = dpo_loss(
                loss_type,
                # the NLL term ignores LD-DPO's down-weighting of the longer tail
                plain_chosen_logps if loss_type == "sft" else chosen_logps,
                rejected_logps,
                ref_chosen_logps,
                ref_rejected_logps,
                chosen_lengths=chosen_lengths,
                rejected_lengths=rejected_lengths,
                beta=self.args.beta,
                label_smoothing=self.args.label_smoothing,
                f_divergence_type=self.args.f_divergence_type,
                f_alpha_divergence_coef=self.args.f_alpha_divergence_coef,
                discopop_tau=self.args.discopop_tau,
            )
            if pair_weights is not None and loss_type != "sft":
                losses = losses * pair_weights
            loss = loss + weight * losses.mean()

        aux_loss = getattr(policy.outputs, "aux_loss", None) if self._aux_loss_enabled else None
        if aux_loss is not None:
            loss = loss + self._aux_loss_coef * aux_loss

        chosen_rewards = self.args.beta * (chosen_logps - ref_chosen_logps).detach()
        rejected_rewards = self.args.beta * (rejected_logps - ref_rejected_logps).detach()
        with torch.no_grad():
            self._log_batch_metrics(
                mode,
                inputs,
                target_mask,
                num_pairs,
                chosen_logps.detach(),
                rejected_logps.detach(),
                chosen_rewards,
                rejected_rewards,
                policy,
                aux_loss,
            )
        if return_outputs:
            return loss, {"chosen_rewards": chosen_rewards, "rejected_rewards": rejected_rewards}
        return loss

    def _log_batch_metrics(
        self,
        mode: str,
        inputs: dict[str, torch.Tensor],
        target_mask: torch.Tensor,
        num_pairs: int,
        chosen_logps: torch.Tensor,
        rejected_logps: torch.Tensor,
        chosen_rewards: torch.Tensor,
        rejected_rewards: torch.Tensor,
        policy: Any,
        aux_loss: torch.Tensor | None,
    ) -> None:
        """Store the batch's metrics (gathered across processes in one collective by `_record_batch_metrics`)."""
        mask = target_mask.float()
        chosen_mask, rejected_mask = mask[:num_pairs], mask[num_pairs:]
        mean_logit = policy.stats["mean_logit"]
        # Pair-level metrics are averaged over processes; token-level ones are ratios of summed numerators/denominators.
        pair_level = {
            "rewards/chosen": chosen_rewards.mean(),
            "rewards/rejected": rejected_rewards.mean(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
            "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
            "logps/chosen": chosen_logps.mean(),
            "logps/rejected": rejected_logps.mean(),
        }
        if aux_loss is not None:
            pair_level["aux_loss"] = aux_loss.detach().float()
        token_level = {
            "logits/chosen": ((mean_logit[:num_pairs] * chosen_mask).sum(), chosen_mask.sum()),
            "logits/rejected": ((mean_logit[num_pairs:] * rejected_mask).sum(), rejected_mask.sum()),
            "entropy": ((policy.entropy.float() * mask).sum(), mask.sum()),
            "mean_token_accuracy": ((policy.stats["correct"][:num_pairs] * chosen_mask).sum(), chosen_mask.sum()),
        }
        self._record_batch_metrics(
            mode, means=pair_level, ratios=token_level, num_tokens=inputs["attention_mask"].sum()
        )


# ----------------------------------------------------------------------------------------------------------------
# Dataset-map helpers (picklable, so that `dataset_num_proc` works)
# ----------------------------------------------------------------------------------------------------------------
class _PreferenceTokenizer:
    """Turns one `{prompt, chosen, rejected}` example into `prompt_ids`, `chosen_ids`, `rejected_ids`.

    See `trl.trainer.utils.PromptCompletionTokenizer`: both sequences are tokenized in full and split at their shared
    prefix with the tokenized prompt.
    """

    def __init__(self, processing_class: Any, conversational: bool):
        self.tokenize = PromptCompletionTokenizer(processing_class, conversational)

    def __call__(self, example: dict[str, Any]) -> dict[str, Any]:
        prompt_ids, (chosen_ids, rejected_ids) = self.tokenize(
            example, example.get("prompt"), [example["chosen"], example["rejected"]], ("prompt", "chosen", "rejected")
        )
        output: dict[str, Any] = {"prompt_ids": prompt_ids, "chosen_ids": chosen_ids, "rejected_ids": rejected_ids}
        # The kept text columns show the completions as tokenized: with the EOS token appended.
        eos = self.tokenize.tokenizer.eos_token
        if not self.tokenize.conversational and eos:
            for key in ("chosen", "rejected"):
                if isinstance(example[key], str) and not example[key].endswith(eos):
                    output[key] = example[key] + eos
        return output


class _HasTargets:
    """Whether both completions of a pair keep at least one scored token after truncation."""

    def __init__(self, max_length: int | None, mode: str):
        self.max_length = max_length
        self.mode = mode

    def _targets(self, prompt_len: int, completion_len: int) -> int:
        return scored_completion_tokens(prompt_len, completion_len, self.max_length, self.mode)

    def check(self, prompt_len: int, chosen_len: int, rejected_len: int) -> bool:
        return self._targets(prompt_len, chosen_len) > 0 and self._targets(prompt_len, rejected_len) > 0

    def __call__(self, example: dict[str, Any]) -> bool:
        return self.check(len(example["prompt_ids"]), len(example["chosen_ids"]), len(example["rejected_ids"]))


def _to_dpo_config(args: TrainingArguments) -> DPOConfig:
    """Convert plain `TrainingArguments` to `DPOConfig`, keeping every value the user set."""
    values = {}
    for f in dataclasses.fields(args):
        if f.init and not f.name.startswith("_"):
            values[f.name] = getattr(args, f.name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return DPOConfig(**values)
