"""Process reward model (PRM) trainer: a token classifier that judges every reasoning step."""

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from datasets import Dataset, DatasetDict, Features, IterableDataset, IterableDatasetDict, List, Value
from transformers import (
    AutoModelForTokenClassification,
    BaseImageProcessor,
    DataCollator,
    FeatureExtractionMixin,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    ProcessorMixin,
    TrainerCallback,
)
from transformers.trainer_utils import EvalPrediction

from ...data_utils import get_dataset_column_names, is_conversational
from ...trainer.base_trainer import _BaseTrainer
from ...trainer.utils import disable_dropout_in_model, pad
from ...trainer.utils.ignored_options import PRM_IGNORED_OPTIONS
from .prm_config import PRMConfig


logger = logging.getLogger(__name__)

_REQUIRED_COLUMNS = ("prompt", "completions", "labels")


def compute_accuracy(eval_pred: EvalPrediction) -> dict[str, float]:
    """Step accuracy of a token-classification model: the share of labelled positions predicted correctly.

    Positions whose label is -100 are ignored. Float labels (soft step scores in `[0, 1]`) count as class 1 when
    above 0.5.

    Args:
        eval_pred (`EvalPrediction`):
            Predictions of shape `(n, seq_len, num_labels)` (logits) and labels of shape `(n, seq_len)`.

    Returns:
        `dict[str, float]`: `{"accuracy": value}` (NaN when no position is labelled).
    """
    predictions = eval_pred.predictions
    if isinstance(predictions, (tuple, list)):
        predictions = predictions[0]
    predictions = np.asarray(predictions)
    labels = np.asarray(eval_pred.label_ids)
    mask = labels != -100
    if not mask.any():
        return {"accuracy": float("nan")}
    predicted = predictions.argmax(axis=-1)[mask]
    targets = labels[mask]
    if np.issubdtype(targets.dtype, np.floating) and not np.all(np.isin(targets, (0.0, 1.0))):
        targets = (targets > 0.5).astype(np.int64)
    return {"accuracy": float((predicted == targets.astype(np.int64)).mean())}


@dataclass
class _DataCollatorForStepwiseSupervision:
    """Pad `input_ids` (with `pad_token_id`), build `attention_mask`, and pad `labels` with -100 (right padding).

    Labels stay integer class ids unless the dataset holds float (soft) step labels.
    """

    pad_token_id: int

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        input_ids = [torch.as_tensor(ex["input_ids"], dtype=torch.long) for ex in examples]
        raw_labels = [list(ex["labels"]) for ex in examples]
        is_float = any(isinstance(value, float) and value != int(value) for row in raw_labels for value in row)
        dtype = torch.float32 if is_float else torch.long
        labels = [torch.as_tensor(row, dtype=dtype) for row in raw_labels]
        return {
            "input_ids": pad(input_ids, self.pad_token_id, "right"),
            "attention_mask": pad([torch.ones_like(ids) for ids in input_ids], 0, "right"),
            "labels": pad(labels, -100, "right"),
        }


class PRMTrainer(_BaseTrainer):
    r"""Trainer for process-supervised reward models (PRM), experimental.

    The model is a token classifier (for example `AutoModelForTokenClassification` with 2 labels). Each example holds
    a `prompt`, a list of reasoning steps (`completions`) and one label per step (`labels`, bools, or floats in
    `[0, 1]` used as soft targets). Every step is followed by `args.step_separator`, and the step's label is placed on
    the last token of that separator; all other positions are ignored (-100). The loss is the cross-entropy over the
    labelled positions, averaged over all of them in the (accumulated) batch.

    Example:

    ```python
    from trl.assets import get_model_path, load_test_dataset
    from trl.experimental.prm import PRMConfig, PRMTrainer

    trainer = PRMTrainer(
        model=get_model_path("tiny-Qwen2ForTokenClassification"),
        args=PRMConfig(output_dir="prm-out", max_steps=5),
        train_dataset=load_test_dataset("standard_stepwise_supervision", split="train"),
    )
    trainer.train()
    ```

    Args:
        model (`PreTrainedModel`, `torch.nn.Module`, `str` or `None`, defaults to `None`):
            Token-classification model to train. A path or hub id is loaded with `AutoModelForTokenClassification`
            and `num_labels=2`. May be `None` when `model_init` is given.
        args (`PRMConfig` or `None`, defaults to `None`):
            Training configuration. `None` builds `PRMConfig(f"{model_name}-PRM")`.
        data_collator (`DataCollator` or `None`, defaults to `None`):
            Batch collator. Defaults to right padding of `input_ids` and of `labels` (with -100).
        train_dataset (`Dataset` or `None`, defaults to `None`):
            Stepwise-supervision data in standard format (`prompt`, `completions`, `labels`), or already tokenized
            `input_ids` and `labels`.
        eval_dataset (`Dataset`, dict of `Dataset` or `None`, defaults to `None`):
            Evaluation data in the same format (every step's label is kept, even with `train_on_last_step_only`).
        processing_class (`PreTrainedTokenizerBase`, `BaseImageProcessor`, `FeatureExtractionMixin`, `ProcessorMixin`
            or `None`, defaults to `None`):
            Tokenizer; loaded from the model's path when omitted (required with `model_init`).
        model_init (`Callable[[], PreTrainedModel]` or `None`, defaults to `None`):
            Function returning a fresh model, as in `Trainer`.
        compute_metrics (`Callable` or `None`, defaults to `None`):
            Metric function for evaluation. `None` uses [`experimental.prm.compute_accuracy`] (metric `accuracy`).
        callbacks (`list[TrainerCallback]` or `None`, defaults to `None`):
            Extra callbacks.
        optimizers (`tuple`, defaults to `(None, None)`):
            Optimizer and scheduler to use instead of the defaults.
        preprocess_logits_for_metrics (`Callable` or `None`, defaults to `None`):
            Transform logits before they are cached for `compute_metrics`.
        peft_config (`PeftConfig` or `None`, defaults to `None`):
            Adapter configuration. The classification head is added to `modules_to_save`.
    """

    _tag_names = ["trl", "prm"]
    _ignored_options = PRM_IGNORED_OPTIONS
    _name = "PRM"
    _paper = {
        "title": "Solving math word problems with process- and outcome-based feedback",
        "id": "2211.14275",
        "citation": """\
@article{uesato2022solving,
    title        = {{Solving Math Word Problems With Process- and Outcome-Based Feedback}},
    author       = {Uesato, Jonathan and Kushman, Nate and Kumar, Ramana and Song, Francis and Siegel, Noah and Wang, Lisa and Creswell, Antonia and Irving, Geoffrey and Higgins, Irina},
    year         = 2022,
    journal      = {arXiv preprint arXiv:2211.14275}
}""",
    }

    def __init__(
        self,
        model: "PreTrainedModel | nn.Module | str | None" = None,
        args: PRMConfig | None = None,
        data_collator: DataCollator | None = None,
        train_dataset: Dataset | None = None,
        eval_dataset: Dataset | dict[str, Dataset] | None = None,
        processing_class: PreTrainedTokenizerBase
        | BaseImageProcessor
        | FeatureExtractionMixin
        | ProcessorMixin
        | None = None,
        model_init: Callable[[], PreTrainedModel] | None = None,
        compute_metrics: Callable[[EvalPrediction], dict] | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (None, None),
        preprocess_logits_for_metrics: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        peft_config: Any = None,
    ):
        if model is None and model_init is None:
            raise ValueError(
                "PRMTrainer needs a `model` (a token-classification model or its path) or a `model_init`."
            )
        if args is None:
            args = self._default_args(PRMConfig, model if model is not None else "model")
        self._check_train_dataset(train_dataset, "PRMTrainer")
        self._prepare_iterable_args(args, train_dataset)

        # ---- Model ---------------------------------------------------------------------------------------------
        if model is not None:
            model_id = self._model_id(model)
            model = self._load_trained_model(
                model, args, peft_config, architecture=AutoModelForTokenClassification, num_labels=2
            )
            if args.disable_dropout:
                disable_dropout_in_model(model)
            peft_config = self._with_trainable_head(peft_config, model, task_type="TOKEN_CLS")
            model = self._wrap_peft(model, peft_config, args)
        elif peft_config is not None:
            raise ValueError(
                "peft_config cannot be combined with model_init; wrap the model inside model_init instead."
            )

        # ---- Tokenizer -----------------------------------------------------------------------------------------
        if processing_class is None:
            if model is None:
                raise ValueError("With model_init, pass the tokenizer explicitly as `processing_class`.")
            processing_class = self._load_processing_class(model_id, args, tokenizer_only=True)
        tokenizer = self._ensure_pad_token(processing_class)

        # ---- Datasets ------------------------------------------------------------------------------------------
        train_dataset = self._prepare_dataset(train_dataset, tokenizer, args, "train", is_eval=False)
        if eval_dataset is not None:
            if isinstance(eval_dataset, dict) and not isinstance(eval_dataset, (DatasetDict, IterableDatasetDict)):
                eval_dataset = {
                    key: self._prepare_dataset(ds, tokenizer, args, key, is_eval=True)
                    for key, ds in eval_dataset.items()
                }
            else:
                eval_dataset = self._prepare_dataset(eval_dataset, tokenizer, args, "eval", is_eval=True)
        num_labels = getattr(getattr(model, "config", None), "num_labels", 2)
        if num_labels != 2 and _label_dtype(train_dataset, {}) == "float64":
            raise ValueError(
                f"Float (soft) step labels need a token classifier with 2 labels, but the model has "
                f"num_labels={num_labels}. Use bool labels or a 2-label model."
            )
        if data_collator is None:
            data_collator = _DataCollatorForStepwiseSupervision(
                pad_token_id=tokenizer.convert_tokens_to_ids(tokenizer.pad_token)
            )
        if compute_metrics is None:
            compute_metrics = compute_accuracy

        # ---- Trainer -------------------------------------------------------------------------------------------
        self._init_metrics()
        self._total_train_tokens = 0
        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            model_init=model_init,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )
        # The loss is divided by the number of labelled positions in the whole accumulated batch (no shift: a
        # token classifier predicts a label at the token itself).
        self.model_accepts_loss_kwargs = True
        self._loss_shifts_labels = False
        self._add_model_tags(self.model)

    def _prepare_eval_dataset(self, dataset: Any, name: str) -> Any:
        """A dataset given to `evaluate()`, prepared as the constructor's `eval_dataset` (unchanged when already
        tokenized: it has `input_ids` and `labels`)."""
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        return self._prepare_dataset(dataset, tokenizer, self.args, name, is_eval=True)

    # ------------------------------------------------------------------------------------------------------------
    # Tokenization
    # ------------------------------------------------------------------------------------------------------------
    @staticmethod
    def tokenize_row(
        features: dict[str, Any],
        tokenizer: PreTrainedTokenizerBase,
        step_separator: str,
        max_length: int | None,
        max_completion_length: int | None,
        train_on_last_step_only: bool,
        is_eval: bool,
    ) -> dict[str, list]:
        r"""Tokenize one stepwise-supervision example into `input_ids` and per-token `labels`.

        The prompt is tokenized without special tokens, with the BOS token prepended when the tokenizer has one; its
        labels are -100. Each step is tokenized on its own and followed by the tokens of `step_separator`; the step's
        label goes on the last of those tokens and every other token of the step gets -100. A separator occurring
        inside a step is ordinary text. Bool labels become 0/1; float labels in `[0, 1]` are kept as soft targets.
        The steps are then cut to `max_completion_length` tokens, and prompt + steps to `max_length` tokens.

        Args:
            features (`dict[str, Any]`):
                Row with `prompt` (str), `completions` (list of str) and `labels` (list of bool/float, one per step).
            tokenizer (`PreTrainedTokenizerBase`):
                Tokenizer of the model.
            step_separator (`str`):
                Text appended after every step.
            max_length (`int` or `None`):
                Maximum length of the whole sequence; `None` for no limit.
            max_completion_length (`int` or `None`):
                Maximum length of the steps; `None` for no limit.
            train_on_last_step_only (`bool`):
                Keep only the final step's label (when `is_eval` is False).
            is_eval (`bool`):
                Whether the row is evaluation data (all labels are kept).

        Returns:
            `dict[str, list]`: `input_ids` and `labels` of equal length.

        Example:
        ```python
        >>> PRMTrainer.tokenize_row(
        ...     {"prompt": "Q", "completions": ["a", "b"], "labels": [True, False]}, tokenizer, "\n", None, None, False, False
        ... )  # with a tokenizer mapping Q->10, a->11, b->12, "\n"->13 and no BOS
        {'input_ids': [10, 11, 13, 12, 13], 'labels': [-100, -100, 1, -100, 0]}
        ```
        """
        prompt, steps, step_labels = features["prompt"], features["completions"], features["labels"]
        _check_row(prompt, steps, step_labels)

        prompt_ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        if tokenizer.bos_token_id is not None:
            prompt_ids = [tokenizer.bos_token_id, *prompt_ids]
        separator_ids = list(tokenizer(step_separator, add_special_tokens=False)["input_ids"])

        completion_ids: list[int] = []
        completion_labels: list = []
        last = len(steps) - 1
        for index, (step, label) in enumerate(zip(steps, step_labels)):
            step_ids = list(tokenizer(step, add_special_tokens=False)["input_ids"]) + separator_ids
            value = -100 if (train_on_last_step_only and not is_eval and index < last) else _label_value(label)
            completion_ids += step_ids
            completion_labels += [-100] * (len(step_ids) - 1) + [value]

        if max_completion_length is not None:
            completion_ids = completion_ids[:max_completion_length]
            completion_labels = completion_labels[:max_completion_length]
        input_ids = prompt_ids + completion_ids
        labels = [-100] * len(prompt_ids) + completion_labels
        if max_length is not None:
            input_ids = input_ids[:max_length]
            labels = labels[:max_length]
        return {"input_ids": input_ids, "labels": labels}

    def _prepare_dataset(
        self, dataset: Dataset | IterableDataset, tokenizer: Any, args: PRMConfig, dataset_name: str, is_eval: bool
    ) -> Dataset | IterableDataset:
        if isinstance(dataset, (DatasetDict, IterableDatasetDict)):
            raise ValueError(
                f"The {dataset_name} dataset is a DatasetDict with splits {list(dataset.keys())}; pass one split, for "
                "example dataset['train']."
            )
        is_iterable = isinstance(dataset, IterableDataset)
        first = next(iter(dataset), None)
        if first is None:
            raise ValueError(f"The {dataset_name} dataset is empty; PRMTrainer needs at least one example.")
        columns = list(get_dataset_column_names(dataset) or first.keys())
        if "input_ids" in columns and "labels" in columns:
            extra = [c for c in columns if c not in ("input_ids", "labels")]
            return dataset.remove_columns(extra) if extra else dataset
        missing = [c for c in _REQUIRED_COLUMNS if c not in columns]
        if missing:
            raise ValueError(
                f"PRMTrainer expects stepwise-supervision data with columns {list(_REQUIRED_COLUMNS)}, but the "
                f"{dataset_name} dataset has columns {columns} (missing {missing}). Each row needs a `prompt` string, "
                "a `completions` list of step strings and a `labels` list with one bool (or float) per step."
            )
        if is_conversational({"prompt": first["prompt"]}) or (
            first["completions"] and isinstance(first["completions"][0], (list, dict))
        ):
            raise ValueError(
                f"PRMTrainer only supports the standard (plain text) format, but the {dataset_name} dataset is "
                "conversational. Render the prompt and the steps to strings first (for example with the tokenizer's "
                "chat template for the prompt)."
            )
        if not is_iterable:
            self._warn_separator_inside_steps(dataset, args.step_separator, dataset_name)

        fn_kwargs = {
            "tokenizer": tokenizer,
            "step_separator": args.step_separator,
            "max_length": args.max_length,
            "max_completion_length": args.max_completion_length,
            "train_on_last_step_only": args.train_on_last_step_only,
            "is_eval": is_eval,
        }
        # Explicit output features: otherwise the new `labels` column would inherit the bool type of the input one.
        features = Features({"input_ids": List(Value("int64")), "labels": List(Value(_label_dtype(dataset, first)))})
        map_kwargs: dict[str, Any] = {"fn_kwargs": fn_kwargs, "remove_columns": columns, "features": features}
        if not is_iterable:
            map_kwargs.update(num_proc=args.dataset_num_proc, desc=f"Tokenizing {dataset_name} dataset")
        dataset = dataset.map(self.tokenize_row, **map_kwargs)

        # Truncation can remove every labelled position of a row; such rows carry no training signal.
        if not is_iterable:
            n_before = len(dataset)
            dataset = dataset.filter(_has_label, num_proc=args.dataset_num_proc)
            n_dropped = n_before - len(dataset)
            if n_dropped == n_before:
                raise ValueError(
                    f"No {dataset_name} example has a labelled step left: every row has an empty `completions` "
                    f"list or lost all its steps to truncation (max_length={args.max_length}, "
                    f"max_completion_length={args.max_completion_length}). Expected at least one step per row; raise "
                    "these limits if the steps were cut."
                )
            if n_dropped:
                logger.warning(
                    "Dropped %d of %d %s examples with no labelled step left after truncation.",
                    n_dropped,
                    n_before,
                    dataset_name,
                )
        else:
            dataset = dataset.filter(_has_label)
        return dataset

    @staticmethod
    def _warn_separator_inside_steps(dataset: Dataset, separator: str, dataset_name: str) -> None:
        # Malformed rows (a step that is not a string) are refused with a clear error when tokenized, just after.
        rows = sum(
            isinstance(steps, list) and any(isinstance(step, str) and separator in step for step in steps)
            for steps in dataset["completions"]
        )
        if rows:
            logger.warning(
                "%d of %d %s examples have a step containing the step separator %r. It is kept as ordinary text "
                "inside the step (no label there); only the separator appended after each step carries the step's "
                "label. Use another step_separator if this is not intended.",
                rows,
                len(dataset),
                dataset_name,
                separator,
            )

    # ------------------------------------------------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------------------------------------------------
    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = ["input_ids", "labels", "attention_mask"]

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ):
        labels = inputs["labels"]
        forward_kwargs = {key: value for key, value in inputs.items() if key != "labels"}
        outputs = model(**forward_kwargs)
        mask = labels != -100
        step_logits = outputs.logits[mask].float()
        targets = labels[mask]
        if targets.is_floating_point():
            if step_logits.shape[-1] != 2:
                raise ValueError(
                    f"Float (soft) step labels need a model with 2 labels, but the model outputs "
                    f"{step_logits.shape[-1]} classes. Use bool labels or a 2-label token classifier."
                )
            log_probs = F.log_softmax(step_logits, dim=-1)
            per_step = -(targets * log_probs[:, 1] + (1.0 - targets) * log_probs[:, 0])
        else:
            per_step = F.cross_entropy(step_logits, targets, reduction="none")
        if num_items_in_batch is not None:
            loss = per_step.sum() / num_items_in_batch
            loss = self._scale_for_token_average(loss, num_items_in_batch)
        else:
            loss = per_step.sum() / mask.sum().clamp(min=1)

        return (loss, outputs) if return_outputs else loss


# ----------------------------------------------------------------------------------------------------------------
# Row checks and helpers (module-level so that `dataset_num_proc` can pickle them)
# ----------------------------------------------------------------------------------------------------------------
def _check_row(prompt: Any, steps: Any, step_labels: Any) -> None:
    if not isinstance(prompt, str):
        raise ValueError(
            f"PRMTrainer only supports the standard format: `prompt` must be a string, got {type(prompt).__name__} "
            f"({str(prompt)[:100]})."
        )
    if not isinstance(steps, list) or not all(isinstance(step, str) for step in steps):
        raise ValueError(
            f"`completions` must be a list of step strings; got {str(steps)[:200]}. Conversational steps are not "
            "supported."
        )
    if not isinstance(step_labels, list) or len(step_labels) != len(steps):
        found = len(step_labels) if isinstance(step_labels, list) else type(step_labels).__name__
        raise ValueError(
            f"Each step needs exactly one label, but an example has {len(steps)} steps and {found} labels "
            f"(prompt {prompt[:80]!r}). Make `labels` the same length as `completions`."
        )


def _label_value(label: Any) -> int | float:
    if isinstance(label, (bool, np.bool_)):
        return int(label)
    if isinstance(label, (int, np.integer)) and label in (0, 1):
        return int(label)
    if isinstance(label, (float, np.floating)) and 0.0 <= label <= 1.0:
        return float(label)
    raise ValueError(
        f"Step labels must be bools (or numbers in [0, 1] used as soft targets); got {label!r}. Convert the labels, "
        "e.g. True for a correct step and False for a wrong one."
    )


def _label_dtype(dataset: Dataset | IterableDataset, first: dict[str, Any]) -> str:
    """`float64` when the step labels are floats (soft targets), `int64` for bools and integers."""
    features = getattr(dataset, "features", None)
    feature = features.get("labels") if features else None
    inner = getattr(feature, "feature", None)
    dtype = getattr(inner, "dtype", None)
    if isinstance(dtype, str):
        return "float64" if dtype.startswith(("float", "double")) else "int64"
    values = first.get("labels") or []
    return "float64" if any(isinstance(v, float) for v in values) else "int64"


def _has_label(example: dict[str, Any]) -> bool:
    return any(label != -100 for label in example["labels"])
