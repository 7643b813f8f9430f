"""The private base of the reference-free preference trainers (experimental CPO and ORPO).

Both learn from `prompt` / `chosen` / `rejected` pairs without a reference model: the loss depends only on the
policy's log-probabilities of the two completions (a preference term) and on the NLL of the chosen sequence (a
behaviour-cloning term). [`_ReferenceFreePreferenceTrainer`] holds everything the two share on top of
[`_PreferenceTrainer`] (model loading, PEFT, dataset checks, evaluation steps): the tokenisation of the pairs into
TRL's columns, the collator, the single forward pass over chosen and rejected, the sequence log-probabilities, the
NLL and the metrics. A subclass supplies the preference loss and three switches (length-normalised log-probs, NLL
over the prompt too, the positions of the `logits/*` metrics).

Encoder-decoder models (T5, BART, ...) take the same path with another layout: the prompt is the encoder input, the
chosen / rejected completions are the decoder labels, and the forward pass stacks both completions along the batch
with the encoder input repeated.
"""

import logging
import random
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn as nn
from datasets import Dataset, IterableDataset
from transformers import PreTrainedModel, TrainerCallback
from transformers.trainer_utils import EvalLoopOutput

from ..data_utils import is_conversational, maybe_apply_chat_template, maybe_extract_prompt
from ..import_utils import is_comet_available, is_wandb_available
from ..trainer.fast_paths.prefix_sharing import (
    MIN_SHARED_SAVING,
    paired_groups,
    right_padded,
    share_prefixes,
    shared_prefix_token_logps,
    sharing_possible_now,
    supports_prefix_sharing,
)
from ..trainer.preference_base import _PreferenceTrainer
from ..trainer.utils import (
    PromptCompletionTokenizer,
    collate_prompt_completions,
    compute_sequence_token_logps,
    disable_dropout_in_model,
    log_table_to_comet_experiment,
    map_kwargs_with_desc,
    pad,
    selective_log_softmax,
)
from ..trainer.utils.logprobs import mean_logits_from_hidden
from ..trainer.utils.packing import SequenceTokenLogps
from .reference_free_legacy import _ReferenceFreeLegacyHelpers, pair_metric_values
from .utils import load_causal_lm


logger = logging.getLogger(__name__)

# The token columns of a prepared dataset, named as in TRL (`chosen_input_ids` holds the prompt too).
TOKEN_COLUMNS = (
    "chosen_input_ids",
    "chosen_attention_mask",
    "chosen_labels",
    "rejected_input_ids",
    "rejected_attention_mask",
    "rejected_labels",
    "prompt_input_ids",
    "prompt_attention_mask",
)
_COLLATED_COLUMNS = ("prompt_input_ids", "chosen_input_ids", "rejected_input_ids")
# The columns of a dataset prepared for an encoder-decoder model (TRL's names: the completions are decoder labels).
_ENCODER_DECODER_COLUMNS = ("prompt_input_ids", "chosen_labels", "rejected_labels")
# Completion length limit of encoder-decoder models when `max_completion_length` is None (TRL's default).
DEFAULT_ENCODER_DECODER_COMPLETION_LENGTH = 128
# Pre-tokenized input in the column names of `DPOTrainer` (completions without the prompt).
_DPO_TOKEN_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")
_LABEL_PAD = -100


# ----------------------------------------------------------------------------------------------------------------
# Dataset rows and collation
# ----------------------------------------------------------------------------------------------------------------
def pair_token_columns(
    prompt_ids: list[int], chosen_ids: list[int], rejected_ids: list[int], max_length: int | None
) -> dict[str, list[int]]:
    """TRL's token columns of one pair: `prompt + completion` ids, their masks and labels (-100 on the prompt).

    The prompt is kept whole and both completions are cut to the room `max_length` leaves after it (none when the
    prompt alone reaches it).
    """
    if max_length is not None:
        room = max(0, max_length - len(prompt_ids))
        chosen_ids, rejected_ids = chosen_ids[:room], rejected_ids[:room]
    columns: dict[str, list[int]] = {}
    for name, completion in (("chosen", chosen_ids), ("rejected", rejected_ids)):
        ids = list(prompt_ids) + list(completion)
        columns[f"{name}_input_ids"] = ids
        columns[f"{name}_attention_mask"] = [1] * len(ids)
        columns[f"{name}_labels"] = [_LABEL_PAD] * len(prompt_ids) + list(completion)
    columns["prompt_input_ids"] = list(prompt_ids)
    columns["prompt_attention_mask"] = [1] * len(prompt_ids)
    return columns


def encoder_decoder_token_columns(
    prompt_ids: list[int], chosen_ids: list[int], rejected_ids: list[int], max_completion_length: int | None
) -> dict[str, list[int]]:
    """TRL's token columns of one pair for an encoder-decoder model: the prompt (encoder input, kept whole) and the
    two completions as decoder labels, each cut to `max_completion_length` tokens."""
    chosen_ids, rejected_ids = list(chosen_ids)[:max_completion_length], list(rejected_ids)[:max_completion_length]
    if not chosen_ids or not rejected_ids:
        empty = "chosen" if not chosen_ids else "rejected"
        raise ValueError(
            f"A pair has an empty {empty} completion (prompt ids {list(prompt_ids)[:20]}...): an encoder-decoder model "
            "scores the completion tokens only, so there is nothing to train on. Remove such pairs from the dataset."
        )
    return {
        "prompt_input_ids": list(prompt_ids),
        "prompt_attention_mask": [1] * len(prompt_ids),
        "chosen_labels": chosen_ids,
        "rejected_labels": rejected_ids,
    }


class _PairTokenizer:
    """Turns one `{prompt, chosen, rejected}` row (text or messages) into TRL's token columns.

    The split into prompt and completions is `PromptCompletionTokenizer`'s; as in TRL, the prompt starts with the BOS
    token and each completion ends with the EOS token (conversational completions too, after the template's own
    end-of-turn text) when the tokenizer has them.
    """

    def __init__(self, processing_class: Any, conversational: bool, max_length: int | None):
        self.tokenize = PromptCompletionTokenizer(processing_class, conversational)
        tokenizer = self.tokenize.tokenizer
        self.bos_token_id = tokenizer.bos_token_id
        self.eos_token_id = tokenizer.eos_token_id
        self.max_length = max_length

    def __call__(self, example: dict[str, Any]) -> dict[str, Any]:
        prompt_ids, (chosen_ids, rejected_ids) = self.tokenize(
            example, example.get("prompt"), [example["chosen"], example["rejected"]], ("prompt", "chosen", "rejected")
        )
        if self.bos_token_id is not None and (not prompt_ids or prompt_ids[0] != self.bos_token_id):
            prompt_ids = [self.bos_token_id, *prompt_ids]
        if self.eos_token_id is not None:
            chosen_ids, rejected_ids = (
                ids if ids and ids[-1] == self.eos_token_id else [*ids, self.eos_token_id]
                for ids in (chosen_ids, rejected_ids)
            )
        return pair_token_columns(prompt_ids, chosen_ids, rejected_ids, self.max_length)


class _PreTokenizedPair:
    """TRL's token columns from pre-tokenized rows (`prompt_ids`/`chosen_ids`/`rejected_ids`, or TRL's own columns,
    whose `chosen_input_ids` start with the prompt); the ids are used as given, only truncated."""

    def __init__(self, columns_fn: Callable[[list[int], list[int], list[int]], dict[str, Any]], with_prompt: bool):
        self.columns_fn = columns_fn  # `(prompt, chosen, rejected) -> columns` (`pair_token_columns` with its limit)
        self.with_prompt = with_prompt

    def __call__(self, example: dict[str, Any]) -> dict[str, Any]:
        if not self.with_prompt:
            prompt = list(example["prompt_ids"])
            return self.columns_fn(prompt, list(example["chosen_ids"]), list(example["rejected_ids"]))
        prompt = list(example["prompt_input_ids"])
        completions = []
        for name in ("chosen", "rejected"):
            ids = list(example[f"{name}_input_ids"])
            if ids[: len(prompt)] != prompt:
                raise ValueError(
                    f"Pre-tokenized row: {name}_input_ids must start with prompt_input_ids (TRL's columns hold the "
                    f"prompt + completion), but {ids[: len(prompt)]} != {prompt}. Pass completions without the prompt "
                    "as prompt_ids / chosen_ids / rejected_ids instead."
                )
            completions.append(ids[len(prompt) :])
        return self.columns_fn(prompt, completions[0], completions[1])


def _encoder_decoder_columns_of(example: dict[str, Any], columns_fn: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    """A row already holding TRL's encoder-decoder columns, truncated and checked again by `columns_fn`."""
    return columns_fn(example["prompt_input_ids"], example["chosen_labels"], example["rejected_labels"])


class _EncoderDecoderPairTokenizer:
    """TRL's encoder-decoder columns of one `{prompt, chosen, rejected}` row (text or messages).

    Conversational rows are rendered with the chat template first (the prompt with the generation prompt, each
    completion as the template's continuation of it); then, as in TRL, the prompt and the two completions are
    tokenized separately with the tokenizer's own special tokens, the completions cut to `max_completion_length`.
    """

    def __init__(self, processing_class: Any, max_completion_length: int):
        self.processing_class = processing_class
        self.tokenizer = getattr(processing_class, "tokenizer", processing_class)
        self.max_completion_length = max_completion_length

    def __call__(self, example: dict[str, Any]) -> dict[str, Any]:
        texts = maybe_apply_chat_template(
            {key: example[key] for key in ("prompt", "chosen", "rejected")}, self.processing_class
        )
        prompt_ids = self.tokenizer(texts["prompt"], add_special_tokens=True)["input_ids"]
        chosen_ids, rejected_ids = (
            self.tokenizer(
                texts[name], truncation=True, max_length=self.max_completion_length, add_special_tokens=True
            )["input_ids"]
            for name in ("chosen", "rejected")
        )
        return encoder_decoder_token_columns(prompt_ids, chosen_ids, rejected_ids, None)


@dataclass
class DataCollatorForReferenceFreePreference:
    """Collate prepared pairs into one right-padded batch: the `n` chosen sequences, then the `n` rejected ones.

    Each example holds TRL's `prompt_input_ids`, `chosen_input_ids` and `rejected_input_ids` (the latter two starting
    with the prompt). The batch keeps the padded positions: TRL's `logits/*` metrics average over them, so their
    token ids matter. As in TRL, each half is padded to its own longest sequence with `pad_token_id`, and the shorter
    half then to the common length with `padding_value`.

    Args:
        pad_token_id (`int`):
            Token used to pad `input_ids`.
        padding_value (`int` or `None`, defaults to `None`):
            Token filling the columns beyond the longest sequence of a half (`None`: `pad_token_id`).

    Returns:
        `input_ids`, `attention_mask`, `completion_mask`, each `(2 * n, T)`.
    """

    pad_token_id: int
    padding_value: int | None = None

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        prompts = [list(example["prompt_input_ids"]) for example in examples]
        completions = [
            list(example[f"{name}_input_ids"])[len(prompt) :]
            for name in ("chosen", "rejected")
            for example, prompt in zip(examples, prompts)
        ]
        batch = collate_prompt_completions(prompts * 2, completions, self.pad_token_id)
        if self.padding_value is not None and self.padding_value != self.pad_token_id:
            n = len(examples)
            for half in (slice(0, n), slice(n, 2 * n)):
                longest = int(batch["attention_mask"][half].sum(dim=1).max())
                batch["input_ids"][half, longest:] = self.padding_value
        return batch


@dataclass
class DataCollatorForEncoderDecoderPreference:
    """Collate pairs prepared for an encoder-decoder model: the prompts twice (encoder input of the `n` chosen, then
    of the `n` rejected completions) and the completions as decoder labels.

    Each example holds TRL's `prompt_input_ids`, `chosen_labels` and `rejected_labels`.

    Args:
        pad_token_id (`int`):
            Token used to pad the prompts (`attention_mask` hides them).
        padding_value (`int` or `None`, defaults to `None`):
            Token used instead of `pad_token_id` when set.

    Returns:
        `input_ids`, `attention_mask` (`(2 * n, P)`, right-padded prompts) and `labels` (`(2 * n, L)`, -100 after the
        end of each completion).
    """

    pad_token_id: int
    padding_value: int | None = None

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        prompts = [torch.tensor(example["prompt_input_ids"], dtype=torch.long) for example in examples] * 2
        labels = [
            torch.tensor(example[f"{name}_labels"], dtype=torch.long)
            for name in ("chosen", "rejected")
            for example in examples
        ]
        pad_id = self.pad_token_id if self.padding_value is None else self.padding_value
        return {
            "input_ids": pad(prompts, pad_id),
            "attention_mask": pad([torch.ones_like(prompt) for prompt in prompts], 0),
            "labels": pad(labels, _LABEL_PAD),
        }


# ----------------------------------------------------------------------------------------------------------------
# Trainer
# ----------------------------------------------------------------------------------------------------------------
class _ReferenceFreePreferenceTrainer(_ReferenceFreeLegacyHelpers, _PreferenceTrainer):
    """Private base of `CPOTrainer` and `ORPOTrainer`: offline preference training without a reference model.

    Chosen and rejected sequences go through the model in one forward pass on a right-padded batch; the LM head runs
    only where a token is scored, and the `logits/*` metrics come from the final hidden states (see
    `mean_logits_from_hidden`). Encoder-decoder models (`is_encoder_decoder`, read from the model's config unless
    `args.is_encoder_decoder` declares it) get the prompts as encoder input and the completions as decoder labels,
    scored from the decoder's logits. A subclass sets `_config_class`, `_name` and implements
    [`_preference_loss`]; the switches below pick what differs between the methods. TRL's older step-by-step helpers
    (`concatenated_forward`, `get_batch_loss_metrics`, ...) come from `_ReferenceFreeLegacyHelpers`.
    """

    _config_class: type = None
    # Sequence log-probabilities as per-token means (True) or sums (False).
    _length_normalized: bool = False
    # NLL of the chosen sequences over prompt and completion (ORPO) or the completion only (CPO).
    _nll_includes_prompt: bool = False
    # `logits/*` average the logits of every position (CPO) or of every position but the last (ORPO).
    _logits_metric_drops_last: bool = False

    def __init__(
        self,
        model: "PreTrainedModel | nn.Module | str | None" = None,
        args: Any = None,
        data_collator: Callable[[list[Any]], dict[str, Any]] | None = None,
        train_dataset: Dataset | IterableDataset | None = None,
        eval_dataset: Dataset | IterableDataset | dict[str, Dataset | IterableDataset] | None = None,
        processing_class: Any = None,
        model_init: Callable[[], PreTrainedModel] | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (None, None),
        preprocess_logits_for_metrics: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        peft_config: Any = None,
        compute_metrics: Callable[[EvalLoopOutput], dict] | None = None,
    ):
        name = type(self).__name__
        if model is None:
            if model_init is None:
                raise ValueError(f"{name} needs a `model` (a model or a path / hub id) or a `model_init` callable.")
            model = model_init()
        if args is None:
            args = self._default_args(self._config_class, model)
        elif not isinstance(args, self._config_class):
            raise TypeError(
                f"{name} needs args of type {self._config_class.__name__}; got {type(args).__name__}. Build a "
                f"{self._config_class.__name__} with the same values."
            )
        self._check_train_dataset(train_dataset, name)
        self._prepare_iterable_args(args, train_dataset)
        self._check_reference_options(args, name)
        if args.generate_during_eval and not (is_wandb_available() or is_comet_available()):
            raise ValueError(
                "generate_during_eval=True logs sampled completions to Weights & Biases or Comet, but neither wandb "
                "nor comet_ml is installed. Install one (`pip install wandb`) or set generate_during_eval=False."
            )

        # ---- Model, processing class, MoE router loss, PEFT (no reference model: the methods need none) ---------
        model, processing_class, tokenizer = self._load_policy(model, None, processing_class, args, peft_config)
        self.is_encoder_decoder = self._resolve_encoder_decoder(model, args, name)
        if args.disable_dropout:
            disable_dropout_in_model(model)
        self.pad_token_id = tokenizer.convert_tokens_to_ids(tokenizer.pad_token)
        if self.is_encoder_decoder:
            config = getattr(model, "config", None)
            self._decoder_start_token_id = getattr(config, "decoder_start_token_id", None)
            if self._decoder_start_token_id is None:
                raise ValueError(
                    f"The encoder-decoder model {type(model).__name__} has no config.decoder_start_token_id, so the "
                    "decoder input cannot be built from the labels. Set model.config.decoder_start_token_id (usually "
                    "the pad or BOS token id)."
                )
            pad_id = getattr(config, "pad_token_id", None)
            self._decoder_pad_token_id = self.pad_token_id if pad_id is None else pad_id
        # TRL's `logits/*` metrics average over the padded positions too: the batch keeps them.
        self._layout = "padded"
        # A pair's chosen and rejected rows share their prompt: run it once, pad positions kept for the metrics.
        self._share_prefix = (
            not self.is_encoder_decoder and not self._aux_loss_enabled and supports_prefix_sharing(model)
        )
        if data_collator is None:
            collator_class = (
                DataCollatorForEncoderDecoderPreference
                if self.is_encoder_decoder
                else DataCollatorForReferenceFreePreference
            )
            data_collator = collator_class(
                pad_token_id=self.pad_token_id, padding_value=getattr(args, "padding_value", None)
            )

        # ---- Datasets ------------------------------------------------------------------------------------------
        train_dataset = self._prepare_dataset(train_dataset, processing_class, args, "train")
        eval_dataset = self._prepare_eval_datasets(
            eval_dataset, lambda dataset, split: self._prepare_dataset(dataset, processing_class, args, split)
        )

        self._init_trainer(
            None,
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )
        self._add_model_tags(self.model)

    def _load_model(self, model: Any, args: Any, architecture: Any = None, quantization_config: Any = None, **_: Any):
        # As in TRL, a string is loaded with AutoModelForCausalLM.from_pretrained (no float32 default); an
        # encoder-decoder checkpoint with AutoModelForSeq2SeqLM.
        return load_causal_lm(model, args, type(self).__name__, encoder_decoder=True)

    @staticmethod
    def _resolve_encoder_decoder(model: nn.Module, args: Any, trainer_name: str) -> bool:
        """Whether `model` is an encoder-decoder model: `args.is_encoder_decoder` when set, else the model's config.

        A declaration that contradicts the model's config is an error; for an encoder-decoder model, a warning tells
        how completions are limited (`max_completion_length`, 128 tokens when None; `max_length` does not apply).
        """
        from_config = getattr(getattr(model, "config", None), "is_encoder_decoder", None)
        declared = args.is_encoder_decoder
        if declared is not None and from_config is not None and bool(declared) != bool(from_config):
            found = "an encoder-decoder" if from_config else "a decoder-only"
            raise ValueError(
                f"args.is_encoder_decoder={declared}, but the model ({type(model).__name__}) is {found} model "
                f"(config.is_encoder_decoder={from_config}). Set is_encoder_decoder=None to read it from the model's "
                f"config, or pass the model {trainer_name} should train."
            )
        is_encoder_decoder = bool(from_config if declared is None else declared)
        if is_encoder_decoder and not hasattr(model, "get_encoder"):
            raise ValueError(
                f"args.is_encoder_decoder=True, but {type(model).__name__} has no encoder (no `get_encoder()`). "
                "Pass an encoder-decoder model (e.g. AutoModelForSeq2SeqLM) or set is_encoder_decoder=False."
            )
        if is_encoder_decoder:
            if args.max_completion_length is None:
                warnings.warn(
                    f"{trainer_name} with an encoder-decoder model truncates the completions (decoder labels) to "
                    f"max_completion_length, which is None: {DEFAULT_ENCODER_DECODER_COMPLETION_LENGTH} tokens are "
                    "used, as in TRL. Set max_completion_length in the config to choose.",
                    UserWarning,
                    stacklevel=3,
                )
            max_length_default = type(args).__dataclass_fields__["max_length"].default
            if args.max_length != max_length_default:
                logger.warning(
                    "max_length=%s does not apply to encoder-decoder models (prompts are kept whole, as in TRL); "
                    "completions are limited by max_completion_length.",
                    args.max_length,
                )
        return is_encoder_decoder

    @staticmethod
    def _completion_limit(args: Any) -> int:
        """Completion length limit of an encoder-decoder model (`max_completion_length`, else TRL's 128)."""
        return args.max_completion_length or DEFAULT_ENCODER_DECODER_COMPLETION_LENGTH

    # ------------------------------------------------------------------------------------------------------------
    # Dataset preparation
    # ------------------------------------------------------------------------------------------------------------
    def _prepare_dataset(
        self, dataset: Dataset | IterableDataset, processing_class: Any, args: Any, dataset_name: str
    ) -> Dataset | IterableDataset:
        name = type(self).__name__
        dataset, first, columns, map_kwargs, is_iterable = self._open_dataset(
            dataset, args, dataset_name, {}, f"The {dataset_name} dataset is empty; {name} needs at least one pair."
        )
        encoder_decoder = self.is_encoder_decoder
        if encoder_decoder:
            columns_fn: Any = partial(
                encoder_decoder_token_columns, max_completion_length=self._completion_limit(args)
            )
        else:
            columns_fn = partial(pair_token_columns, max_length=args.max_length)
        if encoder_decoder and all(c in columns for c in _ENCODER_DECODER_COLUMNS):
            row_fn: Any = partial(_encoder_decoder_columns_of, columns_fn=columns_fn)
        elif all(c in columns for c in _COLLATED_COLUMNS):
            row_fn = _PreTokenizedPair(columns_fn, with_prompt=True)
        elif all(c in columns for c in _DPO_TOKEN_COLUMNS):
            row_fn = _PreTokenizedPair(columns_fn, with_prompt=False)
        else:
            missing = [c for c in ("chosen", "rejected") if c not in columns]
            if missing:
                raise ValueError(
                    f"The {dataset_name} dataset has columns {columns}, but {name} needs preference data with "
                    f"'chosen' and 'rejected' columns (missing: {missing}), plus an optional 'prompt' (otherwise the "
                    "shared beginning of chosen and rejected is used as the prompt), or pre-tokenized 'prompt_ids', "
                    "'chosen_ids' and 'rejected_ids'. Rename your columns (dataset.rename_column(old, new)); "
                    "unpaired data (prompt / completion / label) needs KTOTrainer or BCOTrainer."
                )
            conversational = is_conversational(first)
            if conversational:
                self._check_chat_template(processing_class, dataset_name)
            dataset = dataset.map(
                maybe_extract_prompt, **map_kwargs_with_desc(map_kwargs, f"Extracting prompt in {dataset_name}")
            )
            if encoder_decoder:
                row_fn = _EncoderDecoderPairTokenizer(processing_class, self._completion_limit(args))
            else:
                row_fn = _PairTokenizer(processing_class, conversational, args.max_length)
        tokenized = dataset.map(row_fn, **map_kwargs_with_desc(map_kwargs, f"Tokenizing {dataset_name}"))

        # A prompt that fills max_length leaves nothing to score (and NaN for length-normalised losses): drop it.
        # (Encoder-decoder prompts are not truncated and empty completions are refused when tokenizing.)
        max_length = args.max_length
        if max_length is None or encoder_decoder:
            return tokenized
        if is_iterable:
            return tokenized.filter(lambda example: len(example["prompt_input_ids"]) < max_length)
        prompt_lengths = [len(ids) for ids in tokenized["prompt_input_ids"]]
        none_left = (
            f"No {dataset_name} pair has a completion token left to train on: with max_length={max_length} every "
            f"prompt fills the whole length (the shortest prompt is {min(prompt_lengths)} tokens, expected fewer "
            "than max_length). Raise max_length or shorten the prompts."
        )
        flags = [length < max_length for length in prompt_lengths]
        return self._keep_flagged(tokenized, flags, dataset_name, "pairs", max_length, none_left)

    def _prepare_eval_dataset(self, dataset: Any, name: str) -> Any:
        """A dataset given to `evaluate()`: prepared as the constructor's `eval_dataset` (an already prepared one
        passes through unchanged: its token columns are recognised)."""
        return self._prepare_dataset(dataset, self.processing_class, self.args, name)

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = list(_ENCODER_DECODER_COLUMNS if self.is_encoder_decoder else _COLLATED_COLUMNS)

    def tokenize_row(self, feature: dict[str, Any], model: Any = None) -> dict[str, list[int]]:
        """TRL's token columns of one `{prompt, chosen, rejected}` row (text or messages, explicit prompt)."""
        if self.is_encoder_decoder:
            return _EncoderDecoderPairTokenizer(self.processing_class, self._completion_limit(self.args))(feature)
        row_fn = _PairTokenizer(self.processing_class, is_conversational(feature), self.args.max_length)
        return row_fn(feature)

    # ------------------------------------------------------------------------------------------------------------
    # Log-probabilities and loss
    # ------------------------------------------------------------------------------------------------------------
    @staticmethod
    def get_batch_logps(
        logits: torch.Tensor,
        labels: torch.Tensor,
        average_log_prob: bool = False,
        is_encoder_decoder: bool = False,
    ) -> torch.Tensor:
        """Log-probability of the labelled tokens of each sequence, summed (or averaged), from full logits.

        Args:
            logits: `(batch, seq_len, vocab)` logits.
            labels: `(batch, seq_len)` token ids, -100 where nothing is scored. For a decoder-only model the label at
                `t + 1` is scored by the logits at `t`.
            average_log_prob: Return the per-token mean instead of the sum.
            is_encoder_decoder: Labels are aligned with the logits (no shift).

        Returns:
            `(batch,)` log-probabilities.
        """
        if logits.shape[:-1] != labels.shape:
            raise ValueError(f"logits {tuple(logits.shape[:-1])} and labels {tuple(labels.shape)} must match.")
        if not is_encoder_decoder:
            logits, labels = logits[:, :-1], labels[:, 1:]
        mask = labels != _LABEL_PAD
        logps = selective_log_softmax(logits, labels.masked_fill(~mask, 0)) * mask
        total = logps.sum(dim=-1)
        return total / mask.sum(dim=-1) if average_log_prob else total

    def _nll_weight(self) -> float:
        """Weight of the NLL term in the loss (0 skips it)."""
        return 1.0

    def _preference_loss(
        self, chosen_logps: torch.Tensor, rejected_logps: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """`(per-pair losses, chosen rewards, rejected rewards, extra metrics)` from the sequence log-probs."""
        raise NotImplementedError

    def _decoder_only_forward(
        self, model: nn.Module, inputs: dict[str, torch.Tensor], num_pairs: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        """One forward pass of a causal LM over the `2 * num_pairs` sequences `prompt + completion`.

        Returns:
            `(token_logps, completion_targets, nll_targets, mean_logits, outputs)`: the next-token log-probs
            `(2n, T - 1)` where scored, the completion targets, the NLL targets of the chosen half `(n, T - 1)`, the
            mean logit of every position the `logits/*` metrics average and the model outputs.
        """
        attention = inputs["attention_mask"][:, 1:].bool()
        completion_targets = self._target_mask(inputs)
        nll_targets = attention[:num_pairs] if self._nll_includes_prompt else completion_targets[:num_pairs]
        scored = completion_targets.clone()
        scored[:num_pairs] |= nll_targets
        result = self._shared_prefix_token_logps(model, inputs, scored)
        if result is not None:
            return self._with_mean_logits(model, result, completion_targets, nll_targets)
        result = compute_sequence_token_logps(
            model,
            inputs["input_ids"],
            inputs["attention_mask"],
            scored,
            layout=self._layout,
            pad_token_id=self.pad_token_id,
            output_hidden_states=True,
        )
        return self._with_mean_logits(model, result, completion_targets, nll_targets)

    def _shared_prefix_token_logps(
        self, model: nn.Module, inputs: dict[str, torch.Tensor], scored: torch.Tensor
    ) -> SequenceTokenLogps | None:
        """The forward pass with each pair's prompt run once (see `share_prefixes`), or None when the model, the
        engine or the batch does not allow it or it saves too little."""
        input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]
        if not self._share_prefix or not sharing_possible_now(model) or not right_padded(attention_mask):
            return None
        groups = paired_groups(len(input_ids))
        layout = share_prefixes(input_ids, attention_mask, groups, self.pad_token_id, keep_padding=True)
        if layout.saved_share < MIN_SHARED_SAVING:
            return None
        self._shared_prefix_passes = self._shared_prefix_passes + 1
        return shared_prefix_token_logps(model, input_ids, layout, scored, final_hidden_states=True)

    def _with_mean_logits(
        self, model: nn.Module, result: SequenceTokenLogps, completion_targets: torch.Tensor, nll_targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        with torch.no_grad():
            mean_logits = mean_logits_from_hidden(model, result.outputs.hidden_states[-1])
            if self._logits_metric_drops_last:
                mean_logits = mean_logits[:, :-1]
        return result.logps, completion_targets, nll_targets, mean_logits, result.outputs

    def _encoder_decoder_forward(
        self, model: nn.Module, inputs: dict[str, torch.Tensor], num_pairs: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        """One forward pass of an encoder-decoder model: prompts (repeated) to the encoder, completions as labels.

        The decoder reads the labels shifted right (see [`shift_labels_right`]) and scores every label token, so the
        NLL covers the chosen completions for both methods and the `logits/*` metrics average every decoder position
        (padding included), as in TRL. The decoder is short, so its full logits are used.

        Returns:
            Same as [`_decoder_only_forward`], over the `(2n, L)` decoder positions.
        """
        labels = inputs["labels"]
        targets = labels != _LABEL_PAD
        outputs = model(
            input_ids=inputs["input_ids"],
            attention_mask=inputs["attention_mask"],
            decoder_input_ids=self.shift_labels_right(labels),
            use_cache=False,
        )
        token_logps = selective_log_softmax(outputs.logits, labels.masked_fill(~targets, 0)).masked_fill(~targets, 0)
        with torch.no_grad():
            mean_logits = outputs.logits.detach().float().mean(dim=-1)
        return token_logps, targets, targets[:num_pairs], mean_logits, outputs

    def shift_labels_right(self, labels: torch.Tensor) -> torch.Tensor:
        """Decoder input ids of an encoder-decoder model: the labels shifted one step right after the model's
        `decoder_start_token_id`, with the -100 padding replaced by the model's pad token."""
        shifted = labels.new_full(labels.shape, self._decoder_start_token_id)
        shifted[:, 1:] = labels[:, :-1]
        return shifted.masked_fill(shifted == _LABEL_PAD, self._decoder_pad_token_id)

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ):
        mode = self._mode
        num_pairs = inputs["input_ids"].shape[0] // 2
        forward = self._encoder_decoder_forward if self.is_encoder_decoder else self._decoder_only_forward
        token_logps, completion_targets, nll_targets, mean_logits, outputs = forward(model, inputs, num_pairs)
        token_logps = token_logps.float()
        mask = completion_targets.to(token_logps.dtype)
        sums, counts = (token_logps * mask).sum(dim=1), mask.sum(dim=1)
        sequence_logps = sums / counts if self._length_normalized else sums
        chosen_logps, rejected_logps = sequence_logps[:num_pairs], sequence_logps[num_pairs:]

        losses, chosen_rewards, rejected_rewards, extra = self._preference_loss(chosen_logps, rejected_logps)
        loss = losses.mean()
        weight = self._nll_weight()
        if weight:
            nll_mask = nll_targets.to(token_logps.dtype)
            nll_loss = -(token_logps[:num_pairs] * nll_mask).sum() / nll_mask.sum()
            loss = loss + weight * nll_loss
        else:
            nll_loss = token_logps.new_zeros(())  # not computed (TRL logs 0)
        aux_loss = getattr(outputs, "aux_loss", None) if self._aux_loss_enabled else None
        if aux_loss is not None:
            loss = loss + self._aux_loss_coef * aux_loss

        with torch.no_grad():
            means = pair_metric_values(
                chosen_rewards,
                rejected_rewards,
                chosen_logps,
                rejected_logps,
                mean_logits[:num_pairs].mean(),
                mean_logits[num_pairs:].mean(),
                nll_loss,
                extra,
            )
            if aux_loss is not None:
                means["aux_loss"] = aux_loss.detach().float()
            self._record_batch_metrics(mode, means=means)
        if return_outputs:
            return loss, {"logits/chosen": means["logits/chosen"], "logits/rejected": means["logits/rejected"]}
        return loss

    def _prediction_logits_and_labels(
        self, model: nn.Module, inputs: dict[str, Any], outputs: dict[str, torch.Tensor], ignore_keys: list[str]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # As in TRL: the batch's mean chosen and rejected logits (those named in `ignore_keys`, as "eval_logits/...",
        # left out), with zeros as labels.
        names = [name for name in ("logits/chosen", "logits/rejected") if f"eval_{name}" not in ignore_keys]
        logits = torch.stack([outputs[name].float() for name in names]) if names else torch.zeros(0)
        return logits, torch.zeros(logits.shape[0], device=logits.device)

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        # TRL's CPO / ORPO batches hold no `input_ids` key, so transformers counts no FLOPs there and `total_flos`
        # stays 0; the same is reported here so that logs compare equal.
        return 0

    def store_metrics(self, metrics: dict[str, float], train_eval: str = "train") -> None:
        """Store already-reduced metric values for the next log."""
        for key, value in metrics.items():
            self._metrics[train_eval][key].append(float(value))

    # ------------------------------------------------------------------------------------------------------------
    # Generation during evaluation
    # ------------------------------------------------------------------------------------------------------------
    def generate_from_model(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> list[str]:
        """Sample one completion per prompt of a collated batch; returns the decoded prompt + completion texts."""
        from ..models.utils import unwrap_model_for_generation

        n = batch["input_ids"].shape[0] // 2
        if self.is_encoder_decoder:
            return self._generate_encoder_decoder(model, batch["input_ids"][:n], batch["attention_mask"][:n])
        prompt_mask = (batch["attention_mask"][:n] * (1 - batch["completion_mask"][:n])).bool()
        prompts = [row[mask] for row, mask in zip(batch["input_ids"][:n], prompt_mask)]
        width = max(1, max(len(p) for p in prompts))
        input_ids = torch.full((n, width), self.pad_token_id, dtype=torch.long, device=batch["input_ids"].device)
        attention_mask = torch.zeros_like(input_ids)
        for row, prompt in enumerate(prompts):  # left padding for generation
            if len(prompt):
                input_ids[row, width - len(prompt) :] = prompt
                attention_mask[row, width - len(prompt) :] = 1
        max_new_tokens = self.args.max_completion_length or max(1, (self.args.max_length or 1024) - width)
        with torch.no_grad(), unwrap_model_for_generation(model, self.accelerator) as unwrapped:
            output = unwrapped.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=max_new_tokens,
                do_sample=True,
                pad_token_id=self.pad_token_id,
            )
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        return [tokenizer.decode(ids.tolist(), skip_special_tokens=True) for ids in output]

    def _generate_encoder_decoder(
        self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> list[str]:
        """Sample one completion per prompt with an encoder-decoder model; returns the decoded prompt + completion
        texts (the decoder output holds the completion only)."""
        from ..models.utils import unwrap_model_for_generation

        with torch.no_grad(), unwrap_model_for_generation(model, self.accelerator) as unwrapped:
            output = unwrapped.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=self._completion_limit(self.args),
                do_sample=True,
                pad_token_id=self.pad_token_id,
            )
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        return [
            tokenizer.decode(prompt[mask.bool()].tolist(), skip_special_tokens=True)
            + tokenizer.decode(ids.tolist(), skip_special_tokens=True)
            for prompt, mask, ids in zip(input_ids, attention_mask, output)
        ]

    def evaluation_loop(
        self,
        dataloader: torch.utils.data.DataLoader,
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> EvalLoopOutput:
        """Evaluation as usual; with `generate_during_eval`, also log a table of sampled completions first."""
        if self.args.generate_during_eval:
            dataset = dataloader.dataset
            size = min(len(dataset), self.args.eval_batch_size)
            indices = random.Random(self.state.global_step).sample(range(len(dataset)), k=size)
            batch = self._prepare_inputs(self.data_collator([dataset[i] for i in indices]))
            texts = self.generate_from_model(self.model, batch)
            tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
            prompts = [tokenizer.decode(dataset[i]["prompt_input_ids"], skip_special_tokens=True) for i in indices]
            rows = [[prompt, text[len(prompt) :]] for prompt, text in zip(prompts, texts)]
            if "wandb" in self.args.report_to and is_wandb_available():
                import wandb

                if wandb.run is not None:
                    wandb.log({"game_log": wandb.Table(columns=["Prompt", "Policy"], data=rows)})
            if "comet_ml" in self.args.report_to and is_comet_available():
                import pandas as pd

                log_table_to_comet_experiment(
                    name="game_log.csv", table=pd.DataFrame(rows, columns=["Prompt", "Policy"])
                )
        return super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
