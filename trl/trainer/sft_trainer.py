"""Supervised fine-tuning (SFT) trainer."""

import dataclasses
import logging
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict
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

from .._compat import label_smoothed_loss
from ..data_utils import (
    get_dataset_column_names,
    is_conversational,
    is_conversational_from_value,
    maybe_convert_to_chatml,
    pack_dataset,
)
from ..models.peft import BF16_ADAPTERS
from ..models.selective_activation_checkpointing import apply_selective_checkpointing_option
from ._sft_data import _AppendEOS, _LabelBuilder, _shortest_prompt, _Tokenizer, _Truncator
from .base_trainer import _BaseTrainer
from .sft_config import SFTConfig
from .utils import (
    compute_token_logps,
    drop_padding,
    entropy_from_logits,
    fusable_lm_head,
    model_accepts_argument,
    pad,
)
from .utils.dataset_rows import map_kwargs_with_desc as _desc
from .utils.ignored_options import SFT_IGNORED_OPTIONS
from .utils.logprobs import head_in_common_dtype
from .utils.packing import packed_forward_inputs
from .utils.token_losses import _chunked_cross_entropy_loss, dft_loss, dft_token_weights  # noqa: F401  (TRL's names)
from .utils.vision import check_image_columns, check_vision_processing_class, is_vision_example
from .vision_collators import DataCollatorForVisionLanguageModeling  # noqa: F401  (public here, as in TRL)


logger = logging.getLogger(__name__)

# Columns the collator understands; anything else is dropped after preparation.
# Columns the model receives through the collator; `remove_unused_columns` drops the others (as in TRL).
_SIGNATURE_COLUMNS = ["input_ids", "labels", "seq_lengths"]


@dataclass
class DataCollatorForLanguageModeling:
    """Collate tokenized language-modeling examples into a padded or padding-free batch.

    Each example is a dict with `input_ids` and optionally `labels` (with -100 on positions without loss; defaults to
    a copy of `input_ids`) and `seq_lengths` (lengths of the sequences packed into the example; read when the first
    example has it). Other keys (`completion_mask`, raw text columns, ...) are ignored: the trainer builds `labels`
    when it prepares the dataset.

    Padded batches hold `input_ids`, `labels`, `position_ids` (with `return_position_ids=True`) and `attention_mask`.
    Padding-free batches hold `input_ids`, `labels` and `position_ids` of shape `(1, total_tokens)` plus the sequence
    boundaries variable-length attention kernels read: `cu_seq_lens_q` / `cu_seq_lens_k` (`int32` cumulative
    lengths starting at 0), `max_length_q` / `max_length_k` (`int`, the longest sequence) and `seq_idx` (`int32`,
    the index of each token's sequence).

    Args:
        pad_token_id (`int`):
            Token used to pad `input_ids`.
        padding_free (`bool`, defaults to `False`):
            Concatenate the whole batch into a single row with `position_ids` that restart at each sequence, and no
            attention mask: no compute is spent on padding, and attention never crosses a sequence boundary. The label
            of the first token of every sequence is set to -100 so no sequence is trained to predict the next one.
        return_position_ids (`bool`, defaults to `False`):
            Also return `position_ids` for padded batches (restarting at each packed sequence when `seq_lengths` is
            present).
        pad_to_multiple_of (`int` or `None`, defaults to `None`):
            Pad the sequence length to a multiple of this value. In padding-free mode every padding token forms a
            sequence of its own (position 0).
        return_tensors (`str`, defaults to `"pt"`):
            Only `"pt"` is supported.
        max_row_length (`int` or `None`, defaults to `None`):
            Padding-free only, opt-in (not in TRL): the most tokens one row may hold. `None` (TRL's layout) puts the
            whole batch into a single row, which is ideal for variable-length attention kernels (FlashAttention).
            Eager/SDPA attention builds a dense mask whose cost grows with the square of the row length; a bound
            places examples into rows first-fit (longest first) and pads each row with tokens that nothing attends
            to. The sequence-boundary keys then describe the flattened batch, padding included.
    """

    pad_token_id: int
    padding_free: bool = False
    return_position_ids: bool = False
    pad_to_multiple_of: int | None = None
    return_tensors: str = "pt"
    max_row_length: int | None = None

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        if self.return_tensors != "pt":
            raise ValueError(f"Only return_tensors='pt' is supported; got {self.return_tensors!r}.")
        input_ids = [torch.as_tensor(ex["input_ids"], dtype=torch.long) for ex in examples]
        labels = [
            torch.as_tensor(ex["labels"], dtype=torch.long) if ex.get("labels") is not None else ids.clone()
            for ex, ids in zip(examples, input_ids)
        ]
        # Lengths of the individual sequences inside each example (packed examples hold several).
        if "seq_lengths" in examples[0]:
            pieces = [[int(n) for n in ex["seq_lengths"]] for ex in examples]
        else:
            pieces = [[len(ids)] for ids in input_ids]
        position_ids = self.get_position_ids_from_packed_seq_lengths(pieces)

        if self.padding_free:
            return self._padding_free(input_ids, labels, position_ids, pieces)

        batch = {
            "input_ids": pad(input_ids, self.pad_token_id, "right", self.pad_to_multiple_of),
            "labels": pad(labels, -100, "right", self.pad_to_multiple_of),
        }
        if self.return_position_ids:
            batch["position_ids"] = pad(position_ids, 0, "right", self.pad_to_multiple_of)
        batch["attention_mask"] = pad([torch.ones_like(ids) for ids in input_ids], 0, "right", self.pad_to_multiple_of)
        return batch

    @staticmethod
    def get_position_ids_from_packed_seq_lengths(batch_seq_lengths: list[list[int]]) -> list[torch.Tensor]:
        """Position ids that restart at 0 at each packed sequence, one tensor per example.

        Args:
            batch_seq_lengths (`list[list[int]]`):
                For each example, the lengths of the sequences packed into it.

        Returns:
            `list[torch.Tensor]`: for each example, a `torch.long` tensor of its position ids.
        """
        return [_positions_from_lengths([int(n) for n in lengths]) for lengths in batch_seq_lengths]

    def _padding_free(
        self,
        input_ids: list[torch.Tensor],
        labels: list[torch.Tensor],
        position_ids: list[torch.Tensor],
        pieces: list[list[int]],
    ) -> dict[str, Any]:
        rows = _first_fit_rows([len(ids) for ids in input_ids], self.max_row_length)
        row_ids, row_labels, row_pos, row_lengths = [], [], [], []
        for members in rows:
            ids = torch.cat([input_ids[i] for i in members])
            pos = torch.cat([position_ids[i] for i in members])
            lab = torch.cat([labels[i] for i in members]).clone()
            lab[pos == 0] = -100  # a sequence's first token is never the continuation of the previous one
            row_ids.append(ids)
            row_labels.append(lab)
            row_pos.append(pos)
            row_lengths.append([n for i in members for n in pieces[i]])
        width = max(len(ids) for ids in row_ids)
        if self.pad_to_multiple_of is not None:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        for i, ids in enumerate(row_ids):
            extra = width - len(ids)
            if extra:
                # Every padding token is a sequence of its own (position 0), so real tokens never attend to it.
                row_ids[i] = F.pad(ids, (0, extra), value=self.pad_token_id)
                row_labels[i] = F.pad(row_labels[i], (0, extra), value=-100)
                row_pos[i] = F.pad(row_pos[i], (0, extra), value=0)
                row_lengths[i] = row_lengths[i] + [1] * extra
        # Variable-length attention kernels (FlashAttention) read the sequence boundaries of the flattened batch.
        lengths = torch.tensor([n for row in row_lengths for n in row], dtype=torch.int32)
        cu_seq_lens = F.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))
        max_length = int(lengths.max()) if len(lengths) else 0
        seq_idx = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), lengths.long())
        return {
            "input_ids": torch.stack(row_ids),
            "labels": torch.stack(row_labels),
            "position_ids": torch.stack(row_pos),
            "cu_seq_lens_q": cu_seq_lens,
            "cu_seq_lens_k": cu_seq_lens.clone(),
            "max_length_q": max_length,
            "max_length_k": max_length,
            "seq_idx": seq_idx.reshape(len(row_ids), width),
        }


def _first_fit_rows(lengths: list[int], capacity: int | None) -> list[list[int]]:
    """Group example indices into rows of at most `capacity` tokens (first fit, longest first); None: one row."""
    if capacity is None:
        return [list(range(len(lengths)))]
    capacity = max(capacity, max(lengths, default=0))
    rows: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, free in enumerate(room):
            if lengths[index] <= free:
                rows[r].append(index)
                room[r] -= lengths[index]
                break
        else:
            rows.append([index])
            room.append(capacity - lengths[index])
    return [sorted(members) for members in rows]


def _positions_from_lengths(lengths: list[int]) -> torch.Tensor:
    """Position ids restarting at 0 for each sequence length in `lengths`."""
    return (
        torch.cat([torch.arange(n, dtype=torch.long) for n in lengths])
        if lengths
        else torch.zeros(0, dtype=torch.long)
    )


class SFTTrainer(_BaseTrainer):
    """Trainer for supervised fine-tuning of language models.

    Example:

    ```python
    from trl import SFTConfig, SFTTrainer
    from trl.assets import get_model_path, load_test_dataset

    trainer = SFTTrainer(
        model=get_model_path("tiny-Qwen2ForCausalLM"),
        args=SFTConfig(output_dir="sft-out", max_steps=5),
        train_dataset=load_test_dataset("standard_prompt_completion", split="train"),
    )
    trainer.train()
    ```

    Args:
        model (`str`, `PreTrainedModel` or `PeftModel`):
            Model to train: a path or hub id (loaded with `args.model_init_kwargs`; dtype float32 unless given) or an
            instantiated causal language model.
        args (`SFTConfig`, `TrainingArguments` or `None`, defaults to `None`):
            Training configuration. `None` builds `SFTConfig(f"{model_name}-SFT")`; a plain `TrainingArguments` is
            converted to `SFTConfig`.
        data_collator (`DataCollator` or `None`, defaults to `None`):
            Batch collator. Defaults to [`DataCollatorForLanguageModeling`]. Cannot be combined with padding-free.
        train_dataset (`Dataset` or `IterableDataset`):
            Language modeling (`text` / `messages`), prompt-completion (`prompt` + `completion`, standard or
            conversational), ShareGPT `conversations`, or pre-tokenized (`input_ids`, optional `labels`) data.
        eval_dataset (`Dataset`, `IterableDataset`, dict of them or `None`, defaults to `None`):
            Evaluation data in the same formats.
        processing_class (`PreTrainedTokenizerBase`, `ProcessorMixin` or `None`, defaults to `None`):
            Tokenizer; loaded from the model's path when omitted (a missing pad token is set to the eos token).
        compute_loss_func (`Callable` or `None`, defaults to `None`):
            Custom loss `f(outputs, labels, num_items_in_batch=...)` replacing the built-in one.
        compute_metrics (`Callable` or `None`, defaults to `None`):
            Metric function for evaluation, as in `Trainer`.
        callbacks (`list[TrainerCallback]` or `None`, defaults to `None`):
            Extra callbacks.
        optimizers (`tuple`, defaults to `(None, None)`):
            Optimizer and scheduler to use instead of the defaults.
        optimizer_cls_and_kwargs (`tuple` or `None`, defaults to `None`):
            Optimizer class and its kwargs, created on the model's parameters.
        preprocess_logits_for_metrics (`Callable` or `None`, defaults to `None`):
            Transform logits before they are cached for `compute_metrics`.
        quantization_config (`BitsAndBytesConfig` or `None`, defaults to `None`):
            Quantization used when `model` is a string.
        peft_config (`PeftConfig` or `None`, defaults to `None`):
            Adapter configuration; the model is wrapped with `peft.get_peft_model`.
        formatting_func (`Callable` or `None`, defaults to `None`):
            `f(example) -> str` producing the text to train on (not with `completion_only_loss=True`).
    """

    _accepts_images = True

    _tag_names = ["trl", "sft"]
    _ignored_options = SFT_IGNORED_OPTIONS
    _name = "SFT"
    _quantized_base = BF16_ADAPTERS
    _uncalled_trl_hooks = {
        "_reject_skip_prepare_without_labels": "at construction to check datasets used with skip_prepare_dataset"
    }
    _template_file = "lm_model_card.md"

    def __init__(
        self,
        model: "str | PreTrainedModel | nn.Module",
        args: SFTConfig | TrainingArguments | None = None,
        data_collator: DataCollator | None = None,
        train_dataset: Dataset | IterableDataset | None = None,
        eval_dataset: Dataset | IterableDataset | dict[str, Dataset | IterableDataset] | None = None,
        processing_class: PreTrainedTokenizerBase
        | BaseImageProcessor
        | FeatureExtractionMixin
        | ProcessorMixin
        | None = None,
        compute_loss_func: Callable | None = None,
        compute_metrics: Callable[[EvalPrediction], dict] | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (None, None),
        optimizer_cls_and_kwargs: tuple[type[torch.optim.Optimizer], dict[str, Any]] | None = None,
        preprocess_logits_for_metrics: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        quantization_config: Any = None,
        peft_config: Any = None,
        formatting_func: Callable[[dict], str] | None = None,
    ):
        # ---- Config --------------------------------------------------------------------------------------------
        if args is None:
            args = self._default_args(SFTConfig, model)
        elif isinstance(args, TrainingArguments) and not isinstance(args, SFTConfig):
            args = _to_sft_config(args)
        self._check_train_dataset(train_dataset, "SFTTrainer")
        self._prepare_iterable_args(args, train_dataset)
        if args.use_liger_kernel:
            from ..import_utils import is_liger_kernel_available

            if not is_liger_kernel_available():
                raise ImportError(
                    "You have set `use_liger_kernel` to `True` but liger-kernel >= 0.3.0 is not available. Please "
                    "install it with `pip install liger-kernel`. (SFTTrainer's Liger path needs liger-kernel >= "
                    "0.8.2: `pip install trl[liger]`; or set use_liger_kernel=False.)"
                )
        if getattr(train_dataset, "_format_type", None) == "custom":
            raise ValueError(
                "SFTTrainer does not accept datasets with an on-the-fly transform (`Dataset.with_transform`); apply "
                "the transformation with `Dataset.map` instead."
            )

        # ---- Model ---------------------------------------------------------------------------------------------
        model_id = self._model_id(model)
        model = self._load_trained_model(model, args, peft_config, quantization_config=quantization_config)

        # ---- Processing class ----------------------------------------------------------------------------------
        if processing_class is None:
            processing_class = self._load_processing_class(model_id, args)
        tokenizer = self._ensure_pad_token(processing_class)
        if args.eos_token is not None:
            eos_id = tokenizer.convert_tokens_to_ids(args.eos_token)
            if eos_id is None or eos_id == tokenizer.unk_token_id:
                raise ValueError(
                    f"args.eos_token={args.eos_token!r} is not in the tokenizer's vocabulary. Use a token that "
                    "exists (for example the chat template's end-of-turn token) or add it to the tokenizer first."
                )
            tokenizer.eos_token = args.eos_token
            generation_config = getattr(model, "generation_config", None)
            if generation_config is not None:
                existing = generation_config.eos_token_id
                existing = [] if existing is None else ([existing] if isinstance(existing, int) else list(existing))
                if eos_id not in existing:
                    generation_config.eos_token_id = [*existing, eos_id]

        # ---- Chat template -------------------------------------------------------------------------------------
        if args.chat_template_path is not None:
            model, processing_class, added_tokens = self._apply_chat_template_path(
                model, processing_class, args.chat_template_path
            )
            if added_tokens and peft_config is not None:
                _make_added_tokens_trainable(peft_config, added_tokens)
            tokenizer = getattr(processing_class, "tokenizer", processing_class)

        # ---- MoE router loss -----------------------------------------------------------------------------------
        self._aux_loss_enabled, self._aux_loss_coef = self._resolve_aux_loss(model, args)

        # ---- PEFT (after the selective-checkpointing wrapper, which PEFT's own checkpointing call goes through) ----
        will_be_peft = peft_config is not None or self._is_peft_model(model)
        apply_selective_checkpointing_option(model, args, will_be_peft)
        model = self._wrap_peft(model, peft_config, args)
        apply_selective_checkpointing_option(model, args, will_be_peft)

        # ---- Images: the collator renders and processes the rows, so dataset preparation is skipped -------------
        first_example = self._first_example(train_dataset)
        check_image_columns(first_example, "SFTTrainer")
        self._is_vision_dataset = is_vision_example(first_example)
        if self._is_vision_dataset:
            check_vision_processing_class(processing_class, "SFTTrainer")
            if args.padding_free:
                raise ValueError(
                    "Padding-free training is yet not supported for vision datasets. Please set `padding_free=False` "
                    "in the `SFTConfig`."
                )
            if args.packing:
                raise ValueError(
                    "Packing is not supported for vision datasets. Please set `packing=False` in the SFTConfig."
                )

        # ---- Collator ------------------------------------------------------------------------------------------
        self.padding_free = args.padding_free or (args.packing and args.packing_strategy in ("bfd", "bfd_split"))
        if self.padding_free and data_collator is not None:
            raise ValueError(
                "padding_free (also implied by packing with a bfd strategy) builds batches in its own layout and "
                "cannot be combined with a custom data_collator. Remove the collator or set padding_free=False and "
                "packing_strategy='wrapped'."
            )
        if args.padding_free and not args.packing and args.max_length is not None:
            raise ValueError(
                "When `padding_free=True` without packing, `max_length` is not enforced. Either enable packing (e.g., "
                "`packing=True, packing_strategy='bfd'`), provide already truncated inputs, or set `max_length=None`. "
                f"(Padding-free batches hold whole sequences; max_length={args.max_length} is set.)"
            )
        if self.padding_free and not args.padding_free:
            logger.info("packing_strategy=%r implies padding_free=True.", args.packing_strategy)
        if data_collator is None and self._is_vision_dataset:
            data_collator = DataCollatorForVisionLanguageModeling(
                processor=processing_class,
                max_length=args.max_length,
                completion_only_loss=args.completion_only_loss,
                pad_to_multiple_of=args.pad_to_multiple_of,
                dataset_text_field=args.dataset_text_field,
                assistant_only_loss=args.assistant_only_loss,
            )
        if data_collator is None:
            pad_token_id = tokenizer.convert_tokens_to_ids(tokenizer.pad_token)
            # Padding-free batches are one row, as in TRL (same layout, token counts and FLOPs).
            data_collator = DataCollatorForLanguageModeling(
                pad_token_id=pad_token_id,
                padding_free=self.padding_free,
                pad_to_multiple_of=args.pad_to_multiple_of,
            )

        # ---- Datasets ------------------------------------------------------------------------------------------
        if formatting_func is not None and args.completion_only_loss:
            raise ValueError(
                "A formatting function was provided while `completion_only_loss=True`, which is incompatible: a "
                "formatting function turns each example into a single text, so there is no completion to restrict the "
                "loss to. Apply the formatting before passing the dataset, or set completion_only_loss=False."
            )
        skip_prepare = bool((args.dataset_kwargs or {}).get("skip_prepare_dataset", False)) or self._is_vision_dataset
        if not skip_prepare:
            train_dataset = self._prepare_dataset(
                train_dataset, processing_class, args, args.packing, formatting_func, "train"
            )
            if eval_dataset is not None:
                eval_packing = args.packing if args.eval_packing is None else args.eval_packing
                if isinstance(eval_dataset, dict):
                    eval_dataset = {
                        key: self._prepare_dataset(ds, processing_class, args, eval_packing, formatting_func, key)
                        for key, ds in eval_dataset.items()
                    }
                else:
                    eval_dataset = self._prepare_dataset(
                        eval_dataset, processing_class, args, eval_packing, formatting_func, "eval"
                    )

        # ---- Trainer -------------------------------------------------------------------------------------------
        self._formatting_func = formatting_func
        self._skip_prepare_dataset = skip_prepare
        self._init_metrics()
        self._total_train_tokens = 0
        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            compute_loss_func=compute_loss_func,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )
        # Our loss divides by the number of target tokens in the whole (accumulated, all-process) batch, so the
        # Trainer must pass `num_items_in_batch` and must not rescale for gradient accumulation again.
        self.model_accepts_loss_kwargs = True
        self._loss_shifts_labels = not getattr(getattr(self.model, "config", None), "is_encoder_decoder", False)
        # PEFT prompt tuning / p-tuning prepends virtual tokens: the logits have that many extra leading positions.
        self._num_virtual_tokens = _num_virtual_tokens(self.model)
        self._forward_accepts_logits_to_keep = (
            model_accepts_argument(self.model, "logits_to_keep") and not self._num_virtual_tokens
        )

        self._init_activation_offloading()
        self._add_model_tags(self.model)

    def _ignored_option_facts(self) -> dict[str, Any]:
        facts = super()._ignored_option_facts()
        facts.update(skip_prepare_dataset=self._skip_prepare_dataset, vision=self._is_vision_dataset)
        facts["label_smoothing"] = self.args.loss_type == "nll" and self.compute_loss_func is None
        return facts

    # ------------------------------------------------------------------------------------------------------------
    # Dataset preparation
    # ------------------------------------------------------------------------------------------------------------
    def _prepare_dataset(
        self,
        dataset: Dataset | IterableDataset,
        processing_class: Any,
        args: SFTConfig,
        packing: bool,
        formatting_func: Callable[[dict], str] | None,
        dataset_name: str,
    ) -> Dataset | IterableDataset:
        if isinstance(dataset, (DatasetDict, IterableDatasetDict)):
            raise ValueError(
                f"The {dataset_name} dataset is a DatasetDict with splits {list(dataset.keys())}; pass one split, for "
                f"example dataset['train']."
            )
        tokenizer = getattr(processing_class, "tokenizer", processing_class)
        is_iterable = isinstance(dataset, IterableDataset)
        map_kwargs: dict[str, Any] = {}
        if not is_iterable:
            map_kwargs["num_proc"] = args.dataset_num_proc
        first = next(iter(dataset), None)
        if first is None:
            raise ValueError(f"The {dataset_name} dataset is empty; SFTTrainer needs at least one example.")
        columns = list(get_dataset_column_names(dataset) or first.keys())
        # Raw columns stay beside the token columns, as in TRL (the collator and `remove_unused_columns` only pass
        # `input_ids`, `labels` and `seq_lengths` on to the model).

        # completion_only_loss=None: restrict the loss to the completion of prompt-completion data.
        completion_only = args.completion_only_loss
        if completion_only is None:
            completion_only = "prompt" in columns and "completion" in columns
        if formatting_func is not None and completion_only:
            raise ValueError(
                "A formatting function was provided while `completion_only_loss=True` (completion_only_loss="
                f"{args.completion_only_loss} on the {dataset_name} dataset with columns {columns}), which is "
                "incompatible: a formatting function turns each example into a single text, so there is no completion "
                "to restrict the loss to. Apply the formatting before passing the dataset, or set "
                "completion_only_loss=False."
            )
        if args.assistant_only_loss and not is_conversational(first):
            raise ValueError(
                "You set `assistant_only_loss=True`, but the dataset is not conversational. This option is only "
                f"supported for conversational datasets. The {dataset_name} dataset has columns {columns}; "
                "assistant_only_loss needs a `messages` column or conversational prompt/completion."
            )

        if "input_ids" in columns:
            # Already tokenized: trust the ids, but still build labels and truncate.
            if formatting_func is not None:
                logger.warning("formatting_func is ignored because the %s dataset is already tokenized.", dataset_name)
            tokenized = dataset
        else:
            if formatting_func is not None:
                dataset = dataset.map(
                    lambda ex: {"text": formatting_func(ex)}, **_desc(map_kwargs, f"Formatting {dataset_name} dataset")
                )
                columns = columns + ["text"] if "text" not in columns else columns
                first = next(iter(dataset))
            if is_conversational_from_value(first):
                dataset = dataset.map(
                    maybe_convert_to_chatml,
                    remove_columns=["conversations"],
                    **_desc(map_kwargs, f"Converting {dataset_name} dataset to ChatML"),
                )
                columns = [c for c in columns if c != "conversations"] + ["messages"]
                first = next(iter(dataset))
            data_format = self._detect_sft_format(columns, args, dataset_name)
            conversational = is_conversational(first)
            if conversational and getattr(tokenizer, "chat_template", None) is None:
                raise ValueError(
                    f"The {dataset_name} dataset is conversational but the tokenizer "
                    f"({type(tokenizer).__name__}, {getattr(tokenizer, 'name_or_path', '')!r}) has no chat template. "
                    "Set one with SFTConfig(chat_template_path=...) (a .jinja file or a tokenizer directory), or "
                    "assign tokenizer.chat_template before creating the trainer."
                )
            training_template = self._training_chat_template(processing_class) if args.assistant_only_loss else None
            if not conversational:
                # The EOS token is appended to the text column (or else to the completion) in the dataset itself.
                eos_field = args.dataset_text_field if args.dataset_text_field in columns else "completion"
                if eos_field in columns and tokenizer.eos_token:
                    dataset = dataset.map(
                        _AppendEOS(eos_field, tokenizer.eos_token),
                        **_desc(map_kwargs, f"Adding EOS to {dataset_name} dataset"),
                    )
            tokenize = _Tokenizer(
                processing_class=processing_class,
                data_format=data_format,
                conversational=conversational,
                text_field=args.dataset_text_field,
                assistant_only_loss=args.assistant_only_loss,
                chat_template=training_template,
            )
            tokenized = dataset.map(tokenize, **_desc(map_kwargs, f"Tokenizing {dataset_name} dataset"))
            columns = columns + [c for c in tokenize.output_columns() if c not in columns]

        # Labels: -100 where no loss is wanted. A `labels` column given by the user is used as is.
        if "labels" not in columns:
            consumed = [c for c in ("assistant_masks",) if c in columns]
            if completion_only and "completion_mask" in columns:
                consumed.insert(0, "completion_mask")
            build_labels = _LabelBuilder(completion_only=completion_only)
            tokenized = tokenized.map(
                build_labels,
                remove_columns=consumed or None,
                **_desc(map_kwargs, f"Building labels for {dataset_name}"),
            )
            columns = [c for c in columns if c not in consumed] + ["labels"]

        # Truncate (packing handles length itself) and drop rows left without any trainable token.
        max_length = args.max_length
        if not is_iterable:
            lengths = tokenized["input_ids"]
            n_before = len(tokenized)
            n_long = 0
            if max_length is not None and not packing:
                n_long = sum(len(ids) > max_length for ids in lengths)
                if n_long:
                    logger.warning(
                        "Truncating %d of %d %s examples longer than max_length=%d (truncation_mode=%r).",
                        n_long,
                        n_before,
                        dataset_name,
                        max_length,
                        args.truncation_mode,
                    )
            truncate = _Truncator(max_length if not packing else None, args.truncation_mode)
            tokenized = tokenized.map(truncate, **_desc(map_kwargs, "Truncating"))
            keep_mask = [any(label != -100 for label in labels[1:]) for labels in tokenized["labels"]]
            n_empty = keep_mask.count(False)
            # For the run report's data summary: exact counts instead of "rows reaching max_length".
            counts = {"truncated_rows": n_long, "rows_without_trainable_token": n_empty}
            self._preparation_counts = {**self._preparation_counts, dataset_name: counts}
            if n_empty == n_before:
                shortest_prompt = _shortest_prompt(tokenized)
                detail = (
                    f" The shortest prompt is {shortest_prompt} tokens long." if shortest_prompt is not None else ""
                )
                raise ValueError(
                    f"After preparation no {dataset_name} example has a token to train on (all labels are -100)."
                    f"{detail} With max_length={max_length} every completion was cut away or masked: raise "
                    "max_length, shorten the prompts, or check completion_only_loss/assistant_only_loss."
                )
            if n_empty:
                logger.warning(
                    "Dropping %d of %d %s examples that have no token to train on after truncation/masking.",
                    n_empty,
                    n_before,
                    dataset_name,
                )
                tokenized = tokenized.select([i for i, keep in enumerate(keep_mask) if keep])
        else:
            truncate = _Truncator(max_length if not packing else None, args.truncation_mode)
            tokenized = tokenized.map(truncate)

        if packing:
            if max_length is None:
                raise ValueError("packing=True needs max_length (the length of each packed row); got None.")
            # Packed rows hold several examples: only the token columns survive (as in TRL).
            extra = [c for c in get_dataset_column_names(tokenized) or columns if c not in ("input_ids", "labels")]
            if extra:
                tokenized = tokenized.remove_columns(extra)
            tokenized = pack_dataset(tokenized, max_length, args.packing_strategy, map_kwargs or None)
            if args.packing_strategy == "wrapped":
                logger.info("Packed %s dataset with the 'wrapped' strategy (sequences may cross rows).", dataset_name)

        if not is_iterable and len(tokenized) == 0:
            raise ValueError(f"The {dataset_name} dataset is empty after preparation.")
        if args.shuffle_dataset and dataset_name == "train":
            tokenized = tokenized.shuffle(seed=args.seed)
        return tokenized

    @staticmethod
    def _detect_sft_format(columns: list[str], args: SFTConfig, dataset_name: str) -> str:
        if "messages" in columns:
            return "messages"
        if "prompt" in columns and "completion" in columns:
            return "prompt_completion"
        if args.dataset_text_field in columns:
            return "text"
        raise ValueError(
            f"Could not find training data in the {dataset_name} dataset: it has columns {columns}. SFTTrainer expects "
            f"one of: a text column named {args.dataset_text_field!r} (set another with dataset_text_field=...), a "
            "conversational 'messages' column, 'prompt' + 'completion' columns, ShareGPT 'conversations', or "
            "pre-tokenized 'input_ids'. Rename your column (dataset.rename_column(old, new)) or pass a "
            "formatting_func."
        )

    @staticmethod
    def _training_chat_template(processing_class: Any) -> str | None:
        """The template to tokenize with for `assistant_only_loss`: None to keep the tokenizer's own (it already
        marks assistant turns), else TRL's training variant of the tokenizer's model family (the tokenizer itself is
        unchanged). The offline test tokenizers' own templates are not swapped automatically, as in TRL, which does
        not know them; the error names their bundled training variant."""
        from .. import chat_template_utils

        prefix = (
            "assistant_only_loss=True needs a chat template that marks assistant turns with "
            "{% generation %} ... {% endgeneration %}."
        )
        try:
            template = chat_template_utils.get_training_chat_template(processing_class)
        except ValueError as error:
            raise ValueError(f"{prefix} {error}") from error
        test_templates = {
            chat_template_utils.tiny_qwen2_5_training_chat_template: "tiny_qwen2_5_training.jinja",
            chat_template_utils.tiny_llama3_training_chat_template: "tiny_llama3_training.jinja",
        }
        if template in test_templates:
            path = os.path.join(
                os.path.dirname(chat_template_utils.__file__), "chat_templates", test_templates[template]
            )
            raise ValueError(
                "The chat template is not training-compatible (missing prefix-preservation or `{% generation %}` "
                "markers) and patching is not supported for this template. Please manually modify the chat template "
                f"for training. {prefix} This is the template of TRL's offline test tokenizers, which has no markers; "
                f"a training variant ships with TRL: set chat_template_path={path!r}."
            )
        return template

    def _prepare_eval_dataset(self, dataset: Any, name: str) -> Any:
        """A raw dataset given to `evaluate()` is prepared as the constructor's `eval_dataset` (`eval_packing`);
        an already prepared one (with `input_ids` and `labels`) and `skip_prepare_dataset` data stay unchanged."""
        if self._skip_prepare_dataset:
            return dataset
        first = next(iter(dataset), None) if isinstance(dataset, (Dataset, IterableDataset)) else None
        columns = get_dataset_column_names(dataset) if first is not None else []
        if not columns or ("input_ids" in columns and "labels" in columns):
            return dataset
        args = self.args
        packing = args.packing if args.eval_packing is None else args.eval_packing
        return self._prepare_dataset(dataset, self.processing_class, args, packing, self._formatting_func, name)

    def _check_skipped_dataset(self, dataset: Any, name: str) -> None:
        """With `skip_prepare_dataset`, data the collator cannot turn into `input_ids`/`labels` fails clearly."""
        if (
            not self._skip_prepare_dataset
            or self._is_vision_dataset
            or not isinstance(dataset, (Dataset, IterableDataset))
        ):
            return
        columns = dataset.column_names
        if columns is None:
            first = next(iter(dataset), None)
            columns = list(first) if first is not None else None
        if columns is not None and "input_ids" not in columns:
            raise ValueError(
                "No columns in the dataset match the model's forward method signature: (input_ids, labels, "
                f"seq_lengths). The following columns have been ignored: [{', '.join(columns)}]. Please check the "
                f"dataset and model. The {name} dataset has no `input_ids` column: with dataset_kwargs="
                "{'skip_prepare_dataset': True} SFTTrainer uses the dataset as given, so it must already be tokenized "
                "(`input_ids` and optionally `labels`, -100 where no loss is wanted, and `seq_lengths`). Tokenize "
                "the data first or drop skip_prepare_dataset."
            )

    def get_train_dataloader(self):
        self._check_skipped_dataset(self.train_dataset, "train")
        return super().get_train_dataloader()

    def get_eval_dataloader(self, eval_dataset=None):
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(dataset, str):
            dataset = self.eval_dataset[dataset]
        self._check_skipped_dataset(dataset, "eval")
        return super().get_eval_dataloader(eval_dataset)

    # ------------------------------------------------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------------------------------------------------
    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = list(_SIGNATURE_COLUMNS)
            if self._is_vision_dataset:  # raw rows reach the vision collator
                text_field = self.args.dataset_text_field
                self._signature_columns += ["messages", "prompt", "completion", "images", "image", text_field]

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
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        if self.compute_loss_func is not None:
            outputs = model(**inputs, use_cache=False)
            loss = self.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
            self._log_token_metrics(mode, inputs, None, None)
            return (loss, outputs) if return_outputs else loss
        if self.label_smoother is not None and self.args.loss_type == "nll":
            return self._label_smoothed_loss(model, inputs, labels, mode, return_outputs, num_items_in_batch)

        if self._num_virtual_tokens:
            # The virtual tokens have no target; the last one predicts the first real token.
            labels = F.pad(labels, (self._num_virtual_tokens, 0), value=-100)
        # Position t predicts token t + 1; only positions with a real target go through the output projection.
        shift_labels = labels[:, 1:]
        target_mask = shift_labels != -100
        forward_kwargs = dict(inputs)
        forward_kwargs["use_cache"] = False
        token_stats = None
        if not return_outputs and not self._num_virtual_tokens and fusable_lm_head(model) is not None:
            # Fused, chunked LM head + cross-entropy on the target tokens only: no batch x seq x vocab logits.
            forward_kwargs.pop("use_cache")
            packed = None
            if set(forward_kwargs) == {"input_ids", "attention_mask"} and not self._aux_loss_enabled:
                # A plain padded batch: its sequences packed, so no compute is spent on padding (same sums).
                packed = drop_padding(model, inputs["input_ids"], inputs["attention_mask"])
            if packed is not None:
                forward_kwargs = packed_forward_inputs(packed)
                shift_labels = packed.pack_next_token(shift_labels, -100)
                target_mask = shift_labels != -100
            # The loss is minus a sum of the target log-probs (then scaled): the fused head may compute its gradients
            # in the forward instead of recomputing the logits in the backward. DFT's weights depend on the log-probs.
            expected_grad = (
                None
                if self.args.loss_type == "dft"
                else torch.full(shift_labels.shape, -1.0, device=shift_labels.device)
            )
            # The entropy metric comes from the head's own log-softmax (no second one in the statistics).
            result = compute_token_logps(
                model, targets=shift_labels.clamp(min=0), target_mask=target_mask, upcast=True, compute_entropy=True,
                logits_stats_fn=_token_correct, expected_grad=expected_grad, **forward_kwargs,
            )  # fmt: skip
            outputs, token_logits, token_targets = result.outputs, None, None
            per_token_nll = -result.logps[target_mask]
            count = target_mask.sum().float()
            token_stats = (
                result.entropy.detach()[target_mask].sum(),
                result.stats["correct"][target_mask].sum(),
                count,
            )
            valid = target_mask
        elif self._forward_accepts_logits_to_keep and not return_outputs:
            positions = target_mask.any(dim=0).nonzero().squeeze(-1)
            forward_kwargs["logits_to_keep"] = positions
            with head_in_common_dtype(model):
                outputs = model(**forward_kwargs)
            logits = outputs.logits
            targets = shift_labels[:, positions]
        else:
            with head_in_common_dtype(model):  # evaluation: a bf16 `modules_to_save` head on an fp32 base
                outputs = model(**forward_kwargs)
            logits = outputs.logits[:, :-1]
            targets = shift_labels
        if token_stats is None:
            valid = targets != -100
            token_logits = logits[valid]
            token_targets = targets[valid]
            per_token_nll = F.cross_entropy(token_logits.float(), token_targets, reduction="none")
        if self.args.loss_type == "dft":
            # Dynamic Fine-Tuning: weight each token's loss by its (detached) probability.
            per_token_loss = per_token_nll * dft_token_weights(-per_token_nll)
        else:
            per_token_loss = per_token_nll
        loss_sum = per_token_loss.sum()
        if num_items_in_batch is not None and mode == "train":
            # Training: averaged over the target tokens of the whole (accumulated, all-process) batch. Evaluation
            # averages over this batch's target tokens, as TRL does.
            loss = loss_sum / num_items_in_batch
            loss = self._scale_for_token_average(loss, num_items_in_batch)
        else:
            loss = loss_sum / valid.sum().clamp(min=1)

        if self._aux_loss_enabled and getattr(outputs, "aux_loss", None) is not None:
            loss = loss + self._aux_loss_coef * outputs.aux_loss
            self._record_metric("aux_loss", outputs.aux_loss, mode)

        with torch.no_grad():
            self._log_token_metrics(mode, inputs, token_logits, token_targets, token_stats)
        return (loss, outputs) if return_outputs else loss

    def _label_smoothed_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        labels: torch.Tensor,
        mode: str,
        return_outputs: bool,
        num_items_in_batch: torch.Tensor | int | None,
    ):
        """The loss under `label_smoothing_factor` (a `TrainingArguments` field), as TRL computes it through
        `Trainer.compute_loss`: transformers' `LabelSmoother`, `(1 - ε)` times the NLL plus `ε` times minus the mean
        log-probability over the vocabulary, summed over the target tokens and divided by their count (of the
        accumulated batch where the installed transformers passes it, [`~trl._compat.label_smoothed_loss`]). It reads
        every logit, so the fused LM head steps aside."""
        if self._num_virtual_tokens:
            labels = F.pad(labels, (self._num_virtual_tokens, 0), value=-100)
        outputs = model(**inputs, use_cache=False)
        loss = label_smoothed_loss(self.label_smoother, outputs, labels, self._loss_shifts_labels, num_items_in_batch)
        if num_items_in_batch is not None and mode == "train":
            loss = self._scale_for_token_average(loss, num_items_in_batch)
        if self._aux_loss_enabled and getattr(outputs, "aux_loss", None) is not None:
            loss = loss + self._aux_loss_coef * outputs.aux_loss
            self._record_metric("aux_loss", outputs.aux_loss, mode)
        shift = 1 if self._loss_shifts_labels else 0
        logits, targets = outputs.logits[:, : outputs.logits.shape[1] - shift], labels[:, shift:]
        valid = targets != -100
        with torch.no_grad():
            self._log_token_metrics(mode, inputs, logits[valid], targets[valid])
        return (loss, outputs) if return_outputs else loss

    def _log_token_metrics(
        self,
        mode: str,
        inputs: dict[str, Any],
        token_logits: torch.Tensor | None,
        token_targets: torch.Tensor | None,
        token_stats: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        if "attention_mask" in inputs:
            num_tokens = inputs["attention_mask"].sum()
        else:
            num_tokens = torch.tensor(inputs["input_ids"].numel(), device=inputs["input_ids"].device)
        batch_tokens = self.accelerator.gather(num_tokens.reshape(1)).sum().item()
        if token_stats is not None:  # (entropy sum, correct count, count) of the fused head's target tokens
            token_logits = token_stats[0]
        if token_logits is not None:  # None: custom compute_loss_func, no token statistics (on every process alike)
            # Every process joins the gather, also one whose batch has no target token (skipping it would deadlock).
            if token_stats is not None:
                local = torch.stack([value.float() for value in token_stats])
            elif token_logits.numel() == 0:
                local = torch.zeros(3, device=token_logits.device)
            else:
                entropy_sum = entropy_from_logits(token_logits.float()).sum()
                correct = (token_logits.argmax(dim=-1) == token_targets).sum()
                count = torch.tensor(token_targets.numel(), device=token_logits.device)
                local = torch.stack([entropy_sum.float(), correct.float(), count.float()])
            stats = self.accelerator.gather(local.reshape(1, 3)).reshape(-1, 3).sum(dim=0)
            if stats[2] > 0:
                self._metrics[mode]["entropy"].append((stats[0] / stats[2]).item())
                self._metrics[mode]["mean_token_accuracy"].append((stats[1] / stats[2]).item())
        # Logged after entropy and accuracy, in TRL's key order.
        self._record_num_tokens(mode, batch_tokens)


def _token_correct(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token argmax hit of the target (the `mean_token_accuracy` metric)."""
    return {"correct": (logits.argmax(dim=-1) == targets).float()}


def _to_sft_config(args: TrainingArguments) -> SFTConfig:
    """Convert plain `TrainingArguments` to `SFTConfig`, keeping every value the user set (tokens included)."""
    values = {}
    for f in dataclasses.fields(args):
        if f.init and not f.name.startswith("_"):
            values[f.name] = getattr(args, f.name)
    values.pop("gradient_checkpointing", None) if values.get("activation_checkpointing") is not None else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return SFTConfig(**values)


def _num_virtual_tokens(model: Any) -> int:
    """Number of virtual tokens a PEFT prompt-learning adapter prepends to the logits (0 for prefix tuning, which
    extends the attention cache instead, and for every other model)."""
    config = getattr(model, "active_peft_config", None)
    if config is None or not getattr(config, "is_prompt_learning", False):
        return 0
    if str(getattr(config.peft_type, "value", config.peft_type)) in ("PREFIX_TUNING", "CARTRIDGE"):
        return 0
    return int(config.num_virtual_tokens) * int(getattr(config, "num_transformer_submodules", None) or 1)


def _make_added_tokens_trainable(peft_config: Any, added_tokens: list[int]) -> None:
    """With PEFT, new tokens from a cloned chat template need trainable embeddings and output rows."""
    if hasattr(peft_config, "trainable_token_indices"):
        indices = peft_config.trainable_token_indices or {}
        if isinstance(indices, list):
            indices = {"embed_tokens": indices}
        existing = list(indices.get("embed_tokens", []))
        indices["embed_tokens"] = sorted(set(existing) | set(added_tokens))
        peft_config.trainable_token_indices = indices
    modules = list(getattr(peft_config, "modules_to_save", None) or [])
    if "lm_head" not in modules:
        modules.append("lm_head")
    peft_config.modules_to_save = modules
