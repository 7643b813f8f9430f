"""Reward (outcome reward model) trainer: a Bradley-Terry model trained on pairwise preferences."""

import copy
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict
from transformers import (
    AutoModelForSequenceClassification,
    DataCollator,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    TrainerCallback,
)
from transformers.trainer_utils import EvalPrediction

from ..data_utils import get_dataset_column_names, is_conversational
from ..models.peft import BF16_ADAPTERS, is_quantized_peft_model
from .base_trainer import _BaseTrainer
from .fast_paths.prefix_sharing import (
    MIN_SHARED_SAVING,
    paired_groups,
    pooled_scores_share_safely,
    share_prefixes,
    shared_prefix_pooled_scores,
    sharing_possible_now,
    supports_prefix_sharing,
)
from .reward_config import RewardConfig
from .utils import disable_dropout_in_model, model_accepts_argument, pad, sequence_scores_without_padding
from .utils.ignored_options import REWARD_IGNORED_OPTIONS
from .utils.logprobs import small_head_output


logger = logging.getLogger(__name__)

# Pre-tokenized column pairs accepted in the input (TRL's names first, then those of older releases, renamed), and
# the columns the collator reads.
_TOKENIZED_PAIRS = (("chosen_ids", "rejected_ids"), ("chosen_input_ids", "rejected_input_ids"))
_COLUMNS = ("chosen_ids", "rejected_ids", "margin")


@dataclass
class DataCollatorForPreference:
    """Collate tokenized preference pairs into one padded batch holding every chosen sequence, then every rejected one.

    Each example is a dict with `chosen_ids` and `rejected_ids` (lists of token ids) and optionally a numeric
    `margin`. With `n` examples the batch has `2 * n` rows: rows `0..n-1` are the chosen sequences and rows
    `n..2n-1` the rejected ones, so both sides go through the model in a single forward pass. Sequences are padded on
    the right with `pad_token_id`, which is also how sequence-classification models find the last real token.

    Args:
        pad_token_id (`int`):
            Token used to pad `input_ids`.
        pad_to_multiple_of (`int` or `None`, defaults to `None`):
            Pad the sequence length to a multiple of this value.
        return_tensors (`str`, defaults to `"pt"`):
            Only `"pt"` is supported.

    Example:
    ```python
    >>> collator = DataCollatorForPreference(pad_token_id=0)
    >>> batch = collator([{"chosen_ids": [1, 2, 3], "rejected_ids": [4, 5]}])
    >>> batch["input_ids"].tolist(), batch["attention_mask"].tolist()
    ([[1, 2, 3], [4, 5, 0]], [[1, 1, 1], [1, 1, 0]])
    ```
    """

    pad_token_id: int
    pad_to_multiple_of: int | None = None
    return_tensors: str = "pt"

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if self.return_tensors != "pt":
            raise ValueError(f"Only return_tensors='pt' is supported; got {self.return_tensors!r}.")
        sequences = [torch.as_tensor(ex["chosen_ids"], dtype=torch.long) for ex in examples]
        sequences += [torch.as_tensor(ex["rejected_ids"], dtype=torch.long) for ex in examples]
        batch = {
            "input_ids": pad(sequences, self.pad_token_id, "right", self.pad_to_multiple_of),
            "attention_mask": pad([torch.ones_like(s) for s in sequences], 0, "right", self.pad_to_multiple_of),
        }
        if "margin" in examples[0]:
            batch["margin"] = torch.tensor([float(ex["margin"]) for ex in examples], dtype=torch.float32)
        return batch


class RewardTrainer(_BaseTrainer):
    r"""Trainer for outcome reward models.

    A sequence-classification model with a single output is trained so that the reward (its output at the last token)
    of the chosen answer exceeds the reward of the rejected one, with the Bradley-Terry loss
    `-log(sigmoid(r_chosen - r_rejected - margin))`, optionally plus
    `center_rewards_coefficient * mean((r_chosen + r_rejected) ** 2)`.

    Example:

    ```python
    from trl import RewardConfig, RewardTrainer
    from trl.assets import get_model_path, load_test_dataset

    trainer = RewardTrainer(
        model=get_model_path("tiny-Qwen2ForSequenceClassification"),
        args=RewardConfig(output_dir="reward-out", max_steps=5),
        train_dataset=load_test_dataset("standard_preference", split="train"),
    )
    trainer.train()
    ```

    Args:
        model (`str`, `PreTrainedModel` or `PeftModel`):
            Model to train: a path or hub id, loaded with `AutoModelForSequenceClassification` and `num_labels=1`
            (plus `args.model_init_kwargs`; float32 unless a dtype is given; a causal LM checkpoint gets a new
            `score` head), or an instantiated model whose `config.num_labels` is 1.
        args (`RewardConfig` or `None`, defaults to `None`):
            Training configuration. `None` builds `RewardConfig(f"{model_name}-Reward")`.
        data_collator (`DataCollator` or `None`, defaults to `None`):
            Batch collator. Defaults to [`~trainer.reward_trainer.DataCollatorForPreference`].
        train_dataset (`Dataset` or `IterableDataset`):
            Preference data: `chosen` and `rejected` with an optional `prompt` (prepended to both), standard text or
            conversational messages; or pre-tokenized `chosen_ids`/`rejected_ids` (the older names
            `chosen_input_ids`/`rejected_input_ids` are renamed). An optional numeric `margin` column is subtracted
            inside the loss. The prepared dataset keeps the given columns (`chosen` / `rejected` then hold the full
            sequence that was tokenized: prompt prepended, EOS appended to text) beside `chosen_ids` / `rejected_ids`.
        eval_dataset (`Dataset`, `IterableDataset`, dict of them or `None`, defaults to `None`):
            Evaluation data in the same formats.
        processing_class (`PreTrainedTokenizerBase` or `None`, defaults to `None`):
            Tokenizer; loaded with `AutoTokenizer` from the model's path when omitted. A missing pad token is set to
            the eos token, and the model's `pad_token_id` is set to the tokenizer's.
        compute_metrics (`Callable` or `None`, defaults to `None`):
            Metric function for evaluation. As in TRL, it receives the rewards of each batch's chosen sequences
            followed by its rejected ones, `(2 * batch, 1)` concatenated over the batches, and no labels.
        callbacks (`list[TrainerCallback]` or `None`, defaults to `None`):
            Extra callbacks.
        optimizers (`tuple`, defaults to `(None, None)`):
            Optimizer and scheduler to use instead of the defaults.
        optimizer_cls_and_kwargs (`tuple` or `None`, defaults to `None`):
            Optimizer class and its kwargs, created on the model's parameters.
        preprocess_logits_for_metrics (`Callable` or `None`, defaults to `None`):
            Transform each batch's `(2 * batch, 1)` reward predictions before they are cached for `compute_metrics`.
        quantization_config (`BitsAndBytesConfig` or `None`, defaults to `None`):
            Quantization used when `model` is a string.
        peft_config (`PeftConfig` or `None`, defaults to `None`):
            Adapter configuration. The model's score head is added to `modules_to_save` so that it is trained and
            saved with the adapter.
    """

    _tag_names = ["trl", "reward-trainer"]
    _ignored_options = REWARD_IGNORED_OPTIONS
    _name = "Reward"
    _quantized_base = BF16_ADAPTERS
    _template_file = "rm_model_card.md"

    def __init__(
        self,
        model: "str | PreTrainedModel | nn.Module",
        args: RewardConfig | None = None,
        data_collator: DataCollator | None = None,
        train_dataset: Dataset | IterableDataset | None = None,
        eval_dataset: Dataset | IterableDataset | dict[str, Dataset | IterableDataset] | None = None,
        processing_class: PreTrainedTokenizerBase | None = None,
        compute_metrics: Callable[[EvalPrediction], dict] | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (None, None),
        optimizer_cls_and_kwargs: tuple[type[torch.optim.Optimizer], dict[str, Any]] | None = None,
        preprocess_logits_for_metrics: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        quantization_config: Any = None,
        peft_config: Any = None,
    ):
        # ---- Config --------------------------------------------------------------------------------------------
        if args is None:
            args = self._default_args(RewardConfig, model)
        self._check_train_dataset(train_dataset, "RewardTrainer")
        self._prepare_iterable_args(args, train_dataset)

        # ---- Model ---------------------------------------------------------------------------------------------
        model_id = self._model_id(model)
        if isinstance(model, str):
            num_labels = (args.model_init_kwargs or {}).get("num_labels", 1)
            if num_labels != 1:
                raise ValueError(
                    f"RewardTrainer loads the model with num_labels=1 (one scalar reward), but "
                    f"args.model_init_kwargs sets num_labels={num_labels}. Remove num_labels from model_init_kwargs."
                )
        model = self._load_model(
            model,
            args,
            architecture=AutoModelForSequenceClassification,
            quantization_config=quantization_config,
            num_labels=1,
        )
        self._reject_peft_model_with_config(model, peft_config)
        model_num_labels = getattr(getattr(model, "config", None), "num_labels", None)
        if model_num_labels != 1:
            raise ValueError(
                f"The model has `num_labels={model_num_labels}`, but reward models require `num_labels=1` to output a "
                "single scalar reward per sequence. Please instantiate your model with `num_labels=1` or pass a model "
                "name as a string to have it configured automatically. For example: "
                "AutoModelForSequenceClassification.from_pretrained(..., num_labels=1)."
            )

        # ---- Tokenizer -----------------------------------------------------------------------------------------
        if processing_class is None:
            processing_class = self._load_processing_class(model_id, args, tokenizer_only=True)
        tokenizer = getattr(processing_class, "tokenizer", processing_class)
        if args.pad_token is not None:
            self._check_in_vocab(tokenizer, args.pad_token, "pad_token")
            tokenizer.pad_token = args.pad_token
        self._ensure_pad_token(tokenizer)
        if args.eos_token is not None:
            self._check_in_vocab(tokenizer, args.eos_token, "eos_token")
            tokenizer.eos_token = args.eos_token

        # ---- Chat template -------------------------------------------------------------------------------------
        if args.chat_template_path is not None:
            model, processing_class, added_tokens = self._apply_chat_template_path(
                model, processing_class, args.chat_template_path
            )
            tokenizer = getattr(processing_class, "tokenizer", processing_class)
            if added_tokens and peft_config is not None:
                peft_config = _with_trainable_tokens(peft_config, added_tokens)

        # The sequence-classification head reads the reward at the last token that is not `pad_token_id`, so the
        # model must know the pad id the collator uses (right padding then works as well as left padding).
        pad_token_id = tokenizer.convert_tokens_to_ids(tokenizer.pad_token)
        model.config.pad_token_id = pad_token_id

        if args.disable_dropout:
            disable_dropout_in_model(model)

        # ---- PEFT ----------------------------------------------------------------------------------------------
        peft_config = self._with_trainable_head(peft_config, model, task_type="SEQ_CLS")
        model = self._wrap_peft(model, peft_config, args)
        _check_score_head_dtype(model)

        # ---- Collator and datasets -----------------------------------------------------------------------------
        if data_collator is None:
            data_collator = DataCollatorForPreference(
                pad_token_id=pad_token_id, pad_to_multiple_of=args.pad_to_multiple_of
            )
        train_dataset = self._prepare_dataset(train_dataset, processing_class, args, "train")
        if eval_dataset is not None:
            if isinstance(eval_dataset, dict) and not isinstance(eval_dataset, (DatasetDict, IterableDatasetDict)):
                eval_dataset = {
                    key: self._prepare_dataset(ds, processing_class, args, key) for key, ds in eval_dataset.items()
                }
            else:
                eval_dataset = self._prepare_dataset(eval_dataset, processing_class, args, "eval")

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
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )
        # The loss is a mean over the pairs of the micro-batch: the Trainer divides it by the number of accumulation
        # steps itself, which is exact for equal-size micro-batches.
        self.model_accepts_loss_kwargs = False
        self._forward_accepts_use_cache = model_accepts_argument(self.model, "use_cache")
        # A pair's chosen and rejected texts usually start alike (the prompt): run that prefix once.
        self._share_prefix = supports_prefix_sharing(self.model, causal_lm=False)

        self._init_activation_offloading()
        self._add_model_tags(self.model)

    def _prepare_eval_dataset(self, dataset: Any, name: str) -> Any:
        """A dataset given to `evaluate()`, prepared as the constructor's `eval_dataset` (unchanged when already
        prepared: it has `chosen_ids` / `rejected_ids`)."""
        return self._prepare_dataset(dataset, self.processing_class, self.args, name)

    @staticmethod
    def _check_in_vocab(tokenizer: Any, token: str, option: str) -> None:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or (token_id == tokenizer.unk_token_id and token != tokenizer.unk_token):
            raise ValueError(
                f"args.{option}={token!r} is not in the tokenizer's vocabulary. Use a token that exists, or add it to "
                "the tokenizer (and resize the model's embeddings) first."
            )

    # ------------------------------------------------------------------------------------------------------------
    # Dataset preparation
    # ------------------------------------------------------------------------------------------------------------
    def _prepare_dataset(
        self, dataset: Dataset | IterableDataset, processing_class: Any, args: RewardConfig, dataset_name: str
    ) -> Dataset | IterableDataset:
        if isinstance(dataset, (DatasetDict, IterableDatasetDict)):
            raise ValueError(
                f"The {dataset_name} dataset is a DatasetDict with splits {list(dataset.keys())}; pass one split, for "
                "example dataset['train']."
            )
        is_iterable = isinstance(dataset, IterableDataset)
        map_kwargs: dict[str, Any] = {} if is_iterable else {"num_proc": args.dataset_num_proc}
        first = next(iter(dataset), None)
        if first is None:
            raise ValueError(f"The {dataset_name} dataset is empty; RewardTrainer needs at least one pair.")
        columns = list(get_dataset_column_names(dataset) or first.keys())

        if "margin" in columns:
            _check_margin(dataset, first, dataset_name)

        tokenized_pair = next((pair for pair in _TOKENIZED_PAIRS if set(pair) <= set(columns)), None)
        if tokenized_pair is not None:
            renames = {old: new for old, new in zip(tokenized_pair, _COLUMNS) if old != new}
            if renames:
                dataset = dataset.rename_columns(renames)
                columns = [renames.get(c, c) for c in columns]
        elif "chosen" in columns and "rejected" in columns:
            conversational = is_conversational({"chosen": first["chosen"]})
            if "prompt" in columns and is_conversational({"prompt": first["prompt"]}) != conversational:
                raise ValueError(
                    f"In the {dataset_name} dataset the `prompt` and `chosen` columns are in different formats (one "
                    "is a list of messages, the other plain text). Use conversational messages for both or plain "
                    "strings for both."
                )
            tokenizer = getattr(processing_class, "tokenizer", processing_class)
            if conversational and getattr(tokenizer, "chat_template", None) is None:
                raise ValueError(
                    f"The {dataset_name} dataset is conversational but the tokenizer has no chat template. Set one "
                    "with RewardConfig(chat_template_path=...) (a .jinja file or a tokenizer directory), or assign "
                    "tokenizer.chat_template before creating the trainer."
                )
            eos_token_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token) if tokenizer.eos_token else None
            tokenize = _PreferenceTokenizer(processing_class, conversational, eos_token_id)
            # The given columns stay (as in TRL); the trainer's dataloader keeps only those the collator reads.
            dataset = dataset.map(tokenize, **_desc(map_kwargs, f"Tokenizing {dataset_name}"))
        else:
            raise ValueError(
                f"RewardTrainer expects preference data, but the {dataset_name} dataset has columns {columns}. "
                "Expected `chosen` and `rejected` (with an optional `prompt`, standard text or conversational "
                "messages), or pre-tokenized `chosen_ids` and `rejected_ids`. Rename your columns with "
                "dataset.rename_column(old, new); for unpaired data (prompt/completion/label) build pairs first."
            )

        # The reward is read at the last token, so over-long pairs are dropped rather than truncated.
        if args.max_length is not None:
            keep = _FitsMaxLength(args.max_length)
            if is_iterable:
                dataset = dataset.filter(keep)
            else:
                n_before = len(dataset)
                kept = dataset.filter(keep, **_desc(map_kwargs, f"Filtering {dataset_name} by max_length"))
                n_dropped = n_before - len(kept)
                if n_dropped:  # otherwise the dataset stays the same object (a prepared one is returned unchanged)
                    dataset = kept
                if n_dropped == n_before:
                    raise ValueError(
                        f"Every pair of the {dataset_name} dataset has a chosen or rejected sequence longer than "
                        f"max_length={args.max_length} tokens, so none is left. Raise max_length (or set it to None)."
                    )
                if n_dropped:
                    logger.warning(
                        "Dropped %d of %d %s pairs whose chosen or rejected sequence is longer than max_length=%d.",
                        n_dropped,
                        n_before,
                        dataset_name,
                        args.max_length,
                    )
        return dataset

    # ------------------------------------------------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------------------------------------------------
    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = list(_COLUMNS)

    def training_step(self, *args, **kwargs):
        with self.maybe_activation_offload_context:
            return super().training_step(*args, **kwargs)

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ):
        mode = self._mode
        forward_kwargs = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}
        if self._forward_accepts_use_cache:
            forward_kwargs["use_cache"] = False
        # One forward pass over [chosen; rejected]: the first half of the rows are the chosen sequences. Their
        # padding is dropped when the model allows it (same scores).
        # These two call the backbone and the score head themselves, past the model's forward that mixed precision
        # wraps in autocast: they run under the same autocast.
        # The score head's output is a few numbers per position: declared small, so that under gradient checkpointing
        # the last layers may keep their activations (`LayerBudget`).
        num_labels = getattr(getattr(self.accelerator.unwrap_model(model), "config", None), "num_labels", 1)
        with small_head_output(4 * inputs["input_ids"].numel() * num_labels * 4):
            with self.accelerator.autocast():
                pooled = self._shared_prefix_scores(model, inputs["input_ids"], inputs["attention_mask"])
                if pooled is None:
                    pooled = sequence_scores_without_padding(model, inputs["input_ids"], inputs["attention_mask"])
            outputs = model(**forward_kwargs) if pooled is None else None
        rewards = (outputs.logits if pooled is None else pooled)[:, 0].float()
        rewards_chosen, rewards_rejected = rewards.chunk(2)
        difference = rewards_chosen - rewards_rejected
        if "margin" in inputs:
            difference = difference - inputs["margin"].to(difference)
        loss = -F.logsigmoid(difference).mean()
        if self.args.center_rewards_coefficient is not None:
            loss = loss + self.args.center_rewards_coefficient * ((rewards_chosen + rewards_rejected) ** 2).mean()

        with torch.no_grad():
            self._log_reward_metrics(mode, inputs["attention_mask"], rewards_chosen, rewards_rejected)
        if return_outputs:
            return loss, {"rewards_chosen": rewards_chosen, "rewards_rejected": rewards_rejected}
        return loss

    def _shared_prefix_scores(
        self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor | None:
        """Rewards of the batch with each pair's common prefix run once, or None when that does not apply or saves
        too few tokens (see `trl.trainer.fast_paths.prefix_sharing`)."""
        if not self._share_prefix or not sharing_possible_now(model, causal_lm=False):  # DDP / FSDP / ZeRO-3
            return None
        if not pooled_scores_share_safely(model, input_ids, attention_mask):
            return None
        layout = share_prefixes(input_ids, attention_mask, paired_groups(len(input_ids)), self._pad_token_id())
        if layout.saved_share < MIN_SHARED_SAVING:
            return None
        self._shared_prefix_passes = self._shared_prefix_passes + 1
        return shared_prefix_pooled_scores(model, input_ids, attention_mask, layout)

    def _pad_token_id(self) -> int:
        return self.accelerator.unwrap_model(self.model).config.pad_token_id

    def _log_reward_metrics(
        self,
        mode: str,
        attention_mask: torch.Tensor,
        rewards_chosen: torch.Tensor,
        rewards_rejected: torch.Tensor,
    ) -> None:
        if mode == "train":
            self._record_num_tokens(mode, self.accelerator.gather(attention_mask.sum().reshape(1)).sum().item())
        else:
            self._record_num_tokens(mode)
        chosen = self.accelerator.gather(rewards_chosen.detach())
        rejected = self.accelerator.gather(rewards_rejected.detach())
        all_rewards = torch.cat([chosen, rejected])
        self._metrics[mode]["accuracy"].append((chosen > rejected).float().mean().item())
        self._metrics[mode]["margin"].append((chosen - rejected).mean().item())
        self._metrics[mode]["min_reward"].append(all_rewards.min().item())
        self._metrics[mode]["mean_reward"].append(all_rewards.mean().item())
        self._metrics[mode]["max_reward"].append(all_rewards.max().item())

    def prediction_step(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, tuple | None]:
        """Evaluation step: the loss and, as in TRL, the rewards of the batch's chosen then rejected sequences as
        predictions `(2 * n, 1)`, without labels (an empty tuple)."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss, outputs = self.compute_loss(model, inputs, return_outputs=True)
        loss = loss.detach()
        if prediction_loss_only:
            return loss, None, None
        logits = torch.cat([outputs["rewards_chosen"], outputs["rewards_rejected"]]).unsqueeze(-1)
        return loss, logits, ()


# ----------------------------------------------------------------------------------------------------------------
# Helpers (module-level and picklable so that `dataset_num_proc` works)
# ----------------------------------------------------------------------------------------------------------------
def _desc(map_kwargs: dict[str, Any], text: str) -> dict[str, Any]:
    return {**map_kwargs, "desc": text} if "num_proc" in map_kwargs else dict(map_kwargs)


def _check_margin(dataset: Dataset | IterableDataset, first: dict[str, Any], dataset_name: str) -> None:
    """A `margin` column must hold numbers (no strings, no missing values)."""
    features = getattr(dataset, "features", None)
    feature = features.get("margin") if features else None
    dtype = getattr(feature, "dtype", None)
    numeric_dtype = isinstance(dtype, str) and dtype.startswith(("int", "uint", "float", "double", "bool"))
    if feature is not None and not numeric_dtype:
        raise ValueError(
            f"The `margin` column of the {dataset_name} dataset must hold numbers, but its type is {feature}. Convert "
            "it, for example with dataset.map(lambda ex: {'margin': float(ex['margin'])}), or drop the column."
        )
    values = [first["margin"]] if isinstance(dataset, IterableDataset) else dataset["margin"]
    for index, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(
                f"The `margin` column of the {dataset_name} dataset must hold a number in every row, but row {index} "
                f"has {value!r}. Fill or drop rows without a margin."
            )


def _with_trainable_tokens(peft_config: Any, added_tokens: list[int]) -> Any:
    """Copy of `peft_config` that trains the embedding rows of tokens added by a cloned chat template."""
    if not hasattr(peft_config, "trainable_token_indices"):
        return peft_config
    peft_config = copy.copy(peft_config)
    indices = peft_config.trainable_token_indices or {}
    if isinstance(indices, list):
        indices = {"embed_tokens": indices}
    indices = dict(indices)
    indices["embed_tokens"] = sorted(set(indices.get("embed_tokens", [])) | set(added_tokens))
    peft_config.trainable_token_indices = indices
    return peft_config


class _PreferenceTokenizer:
    """Turns one preference row into `chosen_ids` and `rejected_ids` (prompt prepended to both).

    The `chosen` / `rejected` columns are rewritten to the sequences that were tokenized: the prompt prepended and,
    for text, the EOS token appended.
    """

    def __init__(self, processing_class: Any, conversational: bool, eos_token_id: int | None):
        self.processing_class = processing_class
        self.tokenizer = getattr(processing_class, "tokenizer", processing_class)
        self.conversational = conversational
        self.eos_token_id = eos_token_id

    def _chat(self, messages: list[dict[str, Any]], example: dict[str, Any]) -> list[int]:
        tools = example.get("tools")
        if isinstance(tools, str):
            tools = json.loads(tools)
        template_kwargs = dict(example.get("chat_template_kwargs") or {})
        out = self.processing_class.apply_chat_template(
            messages, tools=tools, tokenize=True, return_dict=True, **template_kwargs
        )
        ids = out["input_ids"]
        return ids.tolist() if torch.is_tensor(ids) else list(ids)

    def _text(self, text: Any, key: str) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(
                f"Standard preference data needs a string `{key}` (or prompt + {key}); got {type(text).__name__}. "
                "Use strings throughout, or conversational message lists for prompt, chosen and rejected."
            )
        ids = list(self.tokenizer(text)["input_ids"])
        # The reward is read at the last token: end every sequence with EOS, as the model will see at inference.
        if self.eos_token_id is not None and (not ids or ids[-1] != self.eos_token_id):
            ids.append(self.eos_token_id)
        return ids

    def __call__(self, example: dict[str, Any]) -> dict[str, Any]:
        prompt = example.get("prompt")
        output: dict[str, Any] = {}
        eos = self.tokenizer.eos_token if self.eos_token_id is not None else None
        for key in ("chosen", "rejected"):
            if self.conversational:
                messages = list(prompt or []) + list(example[key])
                output[f"{key}_ids"] = self._chat(messages, example)
                output[key] = messages
            else:
                text = example[key]
                if prompt is not None:
                    # An explicit prompt is simply prepended: the pair is scored as one sequence.
                    text = prompt + text if isinstance(prompt, str) and isinstance(text, str) else None
                output[f"{key}_ids"] = self._text(text, key)
                output[key] = text + eos if eos and not text.endswith(eos) else text
        return output


class _FitsMaxLength:
    def __init__(self, max_length: int):
        self.max_length = max_length

    def __call__(self, example: dict[str, Any]) -> bool:
        return len(example["chosen_ids"]) <= self.max_length and len(example["rejected_ids"]) <= self.max_length


def _check_score_head_dtype(model: nn.Module) -> None:
    """On a quantized base the score head's trained copy is cast to bf16 (as TRL does); on a base that computes in
    another dtype its first product would fail with a dtype mismatch (under TRL too): say so before training."""
    if not is_quantized_peft_model(model):
        return
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head = head if head is not None else getattr(model.get_base_model(), "score", None)
    weight = getattr(head, "weight", None)
    embeddings = model.get_input_embeddings()
    if weight is not None and weight.requires_grad and weight.dtype != embeddings.weight.dtype:
        raise ValueError(
            f"The reward model's score head is trained in {weight.dtype} (a quantized base's trainable parameters are "
            f"cast to bfloat16) but the base computes in {embeddings.weight.dtype}: its first forward pass would fail "
            "with a dtype mismatch. Load the quantized base in bfloat16 (`dtype=torch.bfloat16` and "
            "`bnb_4bit_compute_dtype=torch.bfloat16`)."
        )
