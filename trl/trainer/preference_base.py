"""The private base of the offline preference trainers (DPO, KTO, experimental BCO).

They learn from fixed preference data against a reference model and build themselves in the same steps (see
[`_PreferenceTrainer`]). On top of [`_BaseTrainer`] this module holds what only they share: option checks, policy
and adapter loading, the reference model, the batch layout of a forward pass (padded / packed / padding-free),
reference log-probabilities computed on the fly or precomputed once before training, dataset checks, the log-prob
pass of a collated batch and the train / evaluation steps. The unpaired trainers (KTO, BCO) add theirs in
`unpaired_preference_base.py`.
"""

import contextlib
import logging
import warnings
from typing import Any

import torch
import torch.nn as nn
from transformers import TrainingArguments

from ..data_utils import get_dataset_column_names
from .base_trainer import _BaseTrainer
from .fast_paths.prefix_sharing import (
    MIN_SHARED_SAVING,
    share_prefixes,
    shared_prefix_token_logps,
    sharing_possible_now,
)
from .fast_paths.reference_cache import (
    ReferenceCache,
    row_digests,
    training_revisits_examples,
)
from .utils import (
    compute_sequence_token_logps,
    disable_dropout_in_model,
    logits_statistics,
    packed_attention_kind,
    precompute_reference_logps,
    uses_sharding_engine,
)
from .utils.forward_randomness import forward_is_deterministic
from .utils.packing import packed_sdpa_applicable, packed_sdpa_attention
from .utils.vision import check_image_columns, check_vision_processing_class, is_vision_example, vision_forward_inputs


logger = logging.getLogger(__name__)


class _PreferenceTrainer(_BaseTrainer):
    """Private base of the trainers that learn from fixed preference data against a reference model.

    [`DPOTrainer`], [`KTOTrainer`] and the experimental `BCOTrainer` build themselves in the same order: checks of the
    options, the model, a tokenizer with a pad token, PEFT adapters, a reference model (unless the reference
    log-probs are precomputed on a single device), the collator and datasets, `Trainer.__init__`, then the reference
    prepared for the trainer's engine. The helpers of each step live here; a subclass keeps only what is its own.

    A subclass sets `pad_token_id` and `_layout` (and `_ref_layout`) before using [`_token_logps`], implements
    `compute_loss(..., return_outputs=True)` and [`_prediction_logits_and_labels`] for evaluation.
    """

    # Set by a subclass whose train dataset has images: the collator processes raw rows, forward passes stay padded.
    _is_vision_dataset: bool = False

    # ------------------------------------------------------------------------------------------------------------
    # Construction
    # ------------------------------------------------------------------------------------------------------------
    @staticmethod
    def _check_reference_options(args: TrainingArguments, trainer_name: str) -> None:
        """Reject options that cannot be combined, before anything is loaded."""
        if getattr(args, "sync_ref_model", False) and getattr(args, "precompute_ref_log_probs", False):
            raise ValueError(
                "You cannot use `sync_ref_model=True` together with `precompute_ref_log_probs=True`. "
                "`precompute_ref_log_probs=True` assumes a fixed reference model, but with `sync_ref_model=True` the "
                "reference model is periodically updated during training, making any precomputed reference log-probs "
                "stale. Set `precompute_ref_log_probs=False` or disable `sync_ref_model`."
            )
        if args.n_gpu > 1:
            raise ValueError(
                f"{trainer_name} does not support torch.nn.DataParallel over {args.n_gpu} GPUs in one process. Launch "
                "one process per GPU with `accelerate launch` (or torchrun), or restrict CUDA_VISIBLE_DEVICES to one "
                "GPU."
            )

    @staticmethod
    def _warn_liger_kernel_deprecated(args: TrainingArguments, trainer_name: str) -> None:
        if getattr(args, "use_liger_kernel", False):
            warnings.warn(
                f"use_liger_kernel is deprecated in {trainer_name} and has no effect: pass "
                "model_init_kwargs={'use_kernels': True} to use hub kernels instead.",
                FutureWarning,
                stacklevel=3,
            )

    def _check_peft_arguments(self, model: nn.Module, peft_config: Any, ref_model: Any, args: Any) -> None:
        """A PeftModel cannot take a second `peft_config`; `sync_ref_model` needs a reference that can be blended."""
        self._reject_peft_model_with_config(model, peft_config)
        will_be_peft = self._is_peft_model(model) or peft_config is not None
        if getattr(args, "sync_ref_model", False) and will_be_peft and ref_model is None:
            raise NotImplementedError(
                "You passed `sync_ref_model=True` while using a PEFT model, which is currently not supported. With "
                f"PEFT, {type(self).__name__} does not keep a separate reference model in memory; instead, it recovers "
                "reference behavior by temporarily disabling the adapter. As a result, there is no standalone "
                "`ref_model` instance to synchronize. Use `sync_ref_model=False`, or opt for full fine-tuning if you "
                "need a synced reference model. (Passing a separate `ref_model` also works.)"
            )

    def _load_policy(
        self,
        model: Any,
        ref_model: Any,
        processing_class: Any,
        args: Any,
        peft_config: Any,
        quantization_config: Any = None,
    ) -> tuple[nn.Module, Any, Any]:
        """Load the policy and its processing class (with a pad token), set up the MoE router loss, wrap PEFT.

        Returns:
            `(policy, processing_class, tokenizer)`.
        """
        model_id = self._model_id(model)
        policy = self._load_model(model, args, quantization_config=quantization_config)
        self._check_peft_arguments(policy, peft_config, ref_model, args)
        if processing_class is None:
            processing_class = self._load_processing_class(model_id, args)
        tokenizer = self._ensure_pad_token(processing_class)
        self._aux_loss_enabled, self._aux_loss_coef = self._resolve_aux_loss(policy, args)
        policy = self._wrap_peft(policy, peft_config, args)
        return policy, processing_class, tokenizer

    def _select_adapters(self, model: nn.Module, model_adapter_name: str | None, ref_adapter_name: str | None) -> None:
        """Check the adapters named for training / as the reference (PEFT only) and activate the trained one."""
        if not self._is_peft_model(model):
            if model_adapter_name or ref_adapter_name:
                raise ValueError(
                    "model_adapter_name / ref_adapter_name select adapters of a PeftModel holding several adapters, "
                    f"but the model is a {type(model).__name__}. Pass a PeftModel with those adapters loaded, or "
                    "leave both options None."
                )
            return
        self._check_adapter_names(model, model_adapter_name, ref_adapter_name)
        if model_adapter_name is not None:
            model.set_adapter(model_adapter_name)

    @staticmethod
    def _check_adapter_names(model: nn.Module, model_adapter_name: str | None, ref_adapter_name: str | None) -> None:
        """Validate the adapters named for training and as the reference in a multi-adapter PEFT model."""
        available = list(getattr(model, "peft_config", {}) or {})
        for option, name in (("model_adapter_name", model_adapter_name), ("ref_adapter_name", ref_adapter_name)):
            if name is not None and name not in available:
                raise ValueError(
                    f"{option}={name!r} is not an adapter of the PEFT model; it has {available}. Load it first (e.g. "
                    f"PeftModel.load_adapter(path, adapter_name={name!r})) or fix the name."
                )
        if model_adapter_name is not None and model_adapter_name == ref_adapter_name:
            raise ValueError(
                f"model_adapter_name and ref_adapter_name are both {model_adapter_name!r}; the reference adapter must "
                "differ from the trained one."
            )

    def _build_preference_ref_model(
        self, model_arg: Any, model: nn.Module, ref_model: Any, args: Any, needed: bool = True
    ) -> nn.Module | None:
        """The reference model (see `_build_ref_model`), with dropout disabled in it and in the policy when asked.

        With precomputed reference log-probs the untrained policy scores the data itself, so no copy is made, except
        under DeepSpeed / FSDP, where the policy is sharded later and a prepared reference is simpler.
        """

        if not getattr(args, "ref_adapter_name", None):
            self._copy_given_adapter_as_reference(model_arg, model, needed)
        needed = needed and (not getattr(args, "precompute_ref_log_probs", False) or uses_sharding_engine(args))
        ref_model = self._build_ref_model(model_arg, model, ref_model, args, needed=needed)
        if getattr(args, "disable_dropout", False):
            disable_dropout_in_model(model)
            if ref_model is not None:
                disable_dropout_in_model(ref_model)
        return ref_model

    @staticmethod
    def _prepare_eval_datasets(eval_dataset: Any, prepare: Any) -> Any:
        """Apply `prepare(dataset, name)` to an evaluation dataset or to each dataset of a dict of them."""
        from datasets import Dataset, IterableDataset

        if eval_dataset is None:
            return None
        if isinstance(eval_dataset, dict) and not isinstance(eval_dataset, (Dataset, IterableDataset)):
            return {key: prepare(dataset, f"eval ({key})") for key, dataset in eval_dataset.items()}
        return prepare(eval_dataset, "eval")

    def _init_trainer(self, ref_model: nn.Module | None, **trainer_kwargs: Any) -> None:
        """`Trainer.__init__`, then the reference model prepared for the engine and the options that need a trainer.

        The losses are averaged per pair / example, so the Trainer scales them for gradient accumulation itself
        (`model_accepts_loss_kwargs=False`).
        """
        self._init_metrics()
        self._total_train_tokens = 0
        self._policy_is_reference = False
        super().__init__(**trainer_kwargs)
        self.model_accepts_loss_kwargs = False
        self.ref_model = self._prepare_ref_model(ref_model)
        self._add_sync_ref_model_callback(self.ref_model)
        self._init_activation_offloading()

    def _training_kernels(self) -> contextlib.ExitStack:
        """The base's training kernels, plus the per-sequence attention for a separate reference model, which runs
        in the same layout as the policy (`_choose_layout`)."""

        stack = super()._training_kernels()
        ref_model = self.ref_model
        if ref_model is not None and ref_model is not self.model:
            stack.enter_context(packed_sdpa_attention(ref_model))
        return stack

    # ------------------------------------------------------------------------------------------------------------
    # Batch layout, and reference log-probs computed on the fly or once before training
    # ------------------------------------------------------------------------------------------------------------
    @staticmethod
    def _choose_layout(model: nn.Module | None, padding_free: bool, warn: bool = False) -> str:
        """Batch layout of a forward pass: `padding_free` (one row), `packed` (short rows) or `padded`.

        See `trl.trainer.utils.compute_sequence_token_logps`. Packing is used whenever the model's attention can keep
        packed sequences apart; `padding_free=True` asks for a single row (a warning falls back to padded batches
        when the attention cannot handle it). A model whose SDPA attention the trainer swaps for the per-sequence
        kernel while it trains and evaluates (`packed_sdpa_applicable`, see `_training_kernels`) gets one row too:
        rows capped at the longest sequence rarely fit two sequences of similar lengths, so they would keep most of
        the padding, while one row costs exactly the tokens and the per-sequence attention the sequences need.
        """

        kind = packed_attention_kind(model) if model is not None else None
        if kind is None:
            if padding_free and warn:
                implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
                warnings.warn(
                    f"padding_free=True, but the model ({type(model).__name__}, attention {implementation!r}) cannot "
                    "attend within packed sequences; falling back to padded batches.",
                    UserWarning,
                    stacklevel=3,
                )
            return "padded"
        if padding_free or kind == "varlen" or packed_sdpa_applicable(model):
            return "padding_free"
        return "packed"

    def _reference_may_run_first(
        self, owner: type, hooks: tuple[str, ...] = ("_compute_loss", "compute_ref_log_probs")
    ) -> bool:
        """Whether `owner`'s step, which scores the batch with the reference before the policy's forward pass (none
        of the reference's memory then sits on the policy's activations, whose last layers may be kept, see
        `LayerBudget`), may do so. Not when a subclass replaced one of `owner`'s `hooks` that make up the step (TRL
        runs the reference after the policy's forward), nor when a forward pass draws random numbers (dropout in
        train mode: the numbers depend on the order)."""
        cls = type(self)
        if any(getattr(cls, name) is not getattr(owner, name) for name in hooks):
            return False
        passes = [self.accelerator.unwrap_model(self.model), self.ref_model]
        return all(forward_is_deterministic(module) for module in passes if module is not None)

    @contextlib.contextmanager
    def _reference_module(self, model: nn.Module, ref_adapter_name: str | None = None):
        """Yield the module that computes reference log-probs for a batch, under no_grad.

        While reference log-probs are being precomputed without a separate reference model
        (`self._policy_is_reference`), the untrained policy itself; otherwise `_reference_context` (the reference
        model, or the PEFT policy with its adapters disabled / `ref_adapter_name` active). When the reference model
        was released after precomputation and the batch carries no precomputed values, a clear error.
        """
        with torch.no_grad():
            ref_model = self.ref_model
            if ref_model is None and self._policy_is_reference:
                yield model
                return
            if ref_model is None and not self._is_peft_model(self.accelerator.unwrap_model(model)):
                raise ValueError(
                    "This batch has no precomputed reference log-probs and the trainer holds no reference model (it "
                    "was released after precompute_ref_log_probs). Evaluate on the datasets given to the trainer, "
                    "whose reference log-probs were precomputed, or create the trainer with "
                    "precompute_ref_log_probs=False."
                )
            with self._reference_context(model, ref_model, ref_adapter_name) as reference:
                yield reference

    def train(self, resume_from_checkpoint: "str | bool | None" = None, *args: Any, **kwargs: Any):
        """Train as [`~transformers.Trainer.train`] does. When the run sees examples again (several epochs) against a
        reference that stays fixed, each example's reference values are computed once and reused
        ([`~trl.trainer.fast_paths.reference_cache.ReferenceCache`])."""
        self._reference_cache = ReferenceCache() if self._reference_cache_applies() else None
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _reference_cache_applies(self) -> bool:
        """Whether this training run keeps reference values per example: the run revisits examples, the reference
        stays fixed (no `sync_ref_model`), the values are not precomputed already, rows are token ids only (no
        images) and the reference forward never runs in lockstep across processes (a sharding engine's gathers, or
        the buffers DDP broadcasts when the wrapped PEFT policy is its own reference): a process that skipped it would
        leave the others waiting."""
        args = self.args
        if getattr(args, "precompute_ref_log_probs", False) or getattr(args, "sync_ref_model", False):
            return False
        if self._is_vision_dataset or uses_sharding_engine(args):
            return False
        if self.accelerator.num_processes > 1 and self.ref_model is None:
            return False
        dataset = self.train_dataset
        size = len(dataset) if hasattr(dataset, "__len__") else None
        return training_revisits_examples(args, size, self.accelerator.num_processes)

    def _reference_values(
        self,
        model: nn.Module,
        compute: Any,
        parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
        num_examples: int,
    ) -> dict[str, torch.Tensor]:
        """`compute()` (the batch's reference values), or the values remembered for its examples when every one was
        scored before and the reference draws no random numbers.

        Args:
            model: The policy (the reference itself when it is a PEFT model with adapters disabled).
            compute: Computes `{column: (num_examples,) tensor}` for the batch.
            parts: The batch's `(input_ids, attention_mask, completion_mask)` row groups (see
                [`~trl.trainer.fast_paths.reference_cache.row_digests`]).
            num_examples: Examples in the batch.
        """
        cache = self.__dict__.get("_reference_cache")
        ref_model = self.ref_model
        if cache is None or not forward_is_deterministic(ref_model if ref_model is not None else model):
            return compute()
        return cache.values_for(row_digests(parts, num_examples), parts[0][0].device, compute)

    def _precompute_reference_columns(
        self,
        compute_fn: Any,
        columns: tuple[str, ...],
        batch_size: int | None = None,
        eval_batch_size: int | None = None,
        release_reference: bool = True,
    ) -> None:
        """Score the train and eval datasets with the reference once, store the values as columns, drop the ref model.

        Args:
            compute_fn: `f(model, batch) -> {column: (n,) tensor}` computing the reference values of a collated batch
                (it receives the policy, which serves as the reference while `self._policy_is_reference` is set).
            columns: Names of the columns `compute_fn` returns; datasets that already have them are left as they are.
            batch_size: Examples per pre-pass batch for the train dataset (default: `per_device_train_batch_size`).
            eval_batch_size: Same for evaluation datasets (default: `per_device_eval_batch_size`).
            release_reference: Drop the reference model afterwards (False keeps it, e.g. one the user passed, so that
                datasets given to `evaluate()` later can still be scored).
        """
        import gc

        from datasets import Dataset

        args = self.args
        was_training = self.model.training
        self.model.eval()
        self._policy_is_reference = self.ref_model is None
        sharded = self.is_deepspeed_enabled or self.is_fsdp_enabled
        model = self.model if sharded else self.model.to(args.device)

        def compute(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            with self.compute_loss_context_manager():
                return compute_fn(model, batch)

        def score(dataset: Any, size: int, name: str) -> Any:
            if isinstance(dataset, Dataset) and all(c in dataset.column_names for c in columns):
                return dataset  # already scored (e.g. by the user)
            return precompute_reference_logps(
                dataset,
                self.data_collator,
                compute,
                batch_size=size,
                accelerator=self.accelerator,
                num_workers=args.dataloader_num_workers,
                desc=f"Computing reference log-probs of the {name} dataset",
            )

        try:
            with self._training_kernels():  # the layout chosen for training assumes its attention kernels
                self.train_dataset = score(self.train_dataset, batch_size or args.per_device_train_batch_size, "train")
                if self.eval_dataset is not None:
                    size = eval_batch_size or args.per_device_eval_batch_size
                    if isinstance(self.eval_dataset, dict):
                        self.eval_dataset = {
                            key: score(ds, size, f"eval ({key})") for key, ds in self.eval_dataset.items()
                        }
                    else:
                        self.eval_dataset = score(self.eval_dataset, size, "eval")
        finally:
            self._policy_is_reference = False
            self.model.train(was_training)
        # The values are stored with the data: the reference model is no longer needed.
        if release_reference:
            self.ref_model = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _precompute_reference_columns_for_eval(
        self, dataset: Any, compute_fn: Any, columns: tuple[str, ...], batch_size: int | None = None
    ) -> Any:
        """Reference columns for a dataset passed to `evaluate()` when the reference log-probs are precomputed.

        Scored by the reference model (kept when the user passed one) or the PEFT policy with its adapters disabled;
        without either, by the policy itself as long as training has not started, and a clear error afterwards. A
        dataset that already has the columns, or a streaming one (scored on the fly), is returned as is.
        """
        from datasets import Dataset

        if not isinstance(dataset, Dataset) or all(c in dataset.column_names for c in columns):
            return dataset
        policy_is_reference = self.ref_model is None and not self._is_peft_model(
            self.accelerator.unwrap_model(self.model)
        )
        if policy_is_reference and self.state.global_step > 0:
            raise ValueError(
                "Cannot compute reference log-probs for a dataset passed to `evaluate()` after training has started: "
                "precompute_ref_log_probs=True and no ref_model was given, so the reference model is not kept. Pass "
                "this dataset as eval_dataset when creating the trainer, pass an explicit ref_model, or set "
                "precompute_ref_log_probs=False."
            )
        was_training = self.model.training
        self.model.eval()
        self._policy_is_reference = policy_is_reference
        model = self.model if (self.is_deepspeed_enabled or self.is_fsdp_enabled) else self.model.to(self.args.device)

        def compute(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            with self.compute_loss_context_manager():
                return compute_fn(model, batch)

        try:
            with self._training_kernels():  # re-entered under evaluate(): the outer block stays in charge
                return precompute_reference_logps(
                    dataset,
                    self.data_collator,
                    compute,
                    batch_size=batch_size or self.args.per_device_eval_batch_size,
                    accelerator=self.accelerator,
                    num_workers=self.args.dataloader_num_workers,
                    desc="Computing reference log-probs of the evaluation dataset",
                )
        finally:
            self._policy_is_reference = False
            self.model.train(was_training)

    # ------------------------------------------------------------------------------------------------------------
    # Dataset preparation
    # ------------------------------------------------------------------------------------------------------------
    @staticmethod
    def _open_dataset(
        dataset: Any, args: Any, dataset_name: str, legacy_columns: dict[str, str], empty_message: str
    ) -> tuple[Any, dict[str, Any], list[str], dict[str, Any], bool]:
        """First look at a dataset to prepare: one split, not empty, legacy tokenized column names renamed.

        Args:
            dataset: The dataset as given.
            args: The trainer config (`dataset_num_proc`).
            dataset_name: `"train"`, `"eval"`, ... for the messages.
            legacy_columns: `{old: new}` column names of older TRL releases to rename (when `new` is absent).
            empty_message: Error message for an empty dataset.

        Returns:
            `(dataset, first_example, column_names, map_kwargs, is_iterable)`.
        """
        from datasets import DatasetDict, IterableDataset, IterableDatasetDict

        if isinstance(dataset, (DatasetDict, IterableDatasetDict)):
            raise ValueError(
                f"The {dataset_name} dataset is a DatasetDict with splits {list(dataset.keys())}; pass one split, for "
                f"example dataset['train']."
            )
        is_iterable = isinstance(dataset, IterableDataset)
        map_kwargs: dict[str, Any] = {} if is_iterable else {"num_proc": args.dataset_num_proc}
        first = next(iter(dataset), None)
        if first is None:
            raise ValueError(empty_message)
        columns = list(get_dataset_column_names(dataset) or first.keys())
        legacy = {old: new for old, new in legacy_columns.items() if old in columns and new not in columns}
        if legacy:
            dataset = dataset.rename_columns(legacy)
            columns = [legacy.get(c, c) for c in columns]
        return dataset, first, columns, map_kwargs, is_iterable

    def _setup_vision(self, train_dataset: Any, processing_class: Any, args: Any) -> bool:
        """Detect an image dataset and check what it needs: a processor, and no precomputed reference log-probs."""

        first_example = self._first_example(train_dataset)
        check_image_columns(first_example, type(self).__name__)
        self._is_vision_dataset = is_vision_example(first_example)
        if self._is_vision_dataset:
            check_vision_processing_class(processing_class, type(self).__name__)
            if getattr(args, "precompute_ref_log_probs", False):
                raise ValueError(
                    "`precompute_ref_log_probs=True` is not supported for vision datasets: their rows are processed "
                    "on the fly by the collator, so there is no tokenized dataset to store reference log-probs in. "
                    "Set `precompute_ref_log_probs=False`."
                )
        return self._is_vision_dataset

    @staticmethod
    def _check_chat_template(processing_class: Any, dataset_name: str) -> None:
        """Conversational data needs a chat template on the processing class."""
        if getattr(processing_class, "chat_template", None) is None:
            tokenizer = getattr(processing_class, "tokenizer", processing_class)
            raise ValueError(
                f"The {dataset_name} dataset is conversational but the processing class "
                f"({type(processing_class).__name__}, {getattr(tokenizer, 'name_or_path', '')!r}) has no chat "
                "template. Assign tokenizer.chat_template (or use trl.clone_chat_template) before creating the "
                "trainer."
            )

    @staticmethod
    def _keep_flagged(
        dataset: Any, flags: list[bool], dataset_name: str, unit: str, max_length: int | None, none_left: str
    ) -> Any:
        """Keep the rows whose flag is True, warning about the others; `none_left` is the error when none is.

        Args:
            dataset: A map-style dataset.
            flags: One bool per row: whether the row has a completion token left to train on.
            dataset_name: `"train"`, `"eval"`, ... for the messages.
            unit: What a row is (`"pairs"`, `"examples"`), for the warning.
            max_length: The length limit that left rows without completion tokens, for the warning.
            none_left: Error message when no row is kept.
        """
        n_drop = flags.count(False)
        if n_drop == len(flags):
            raise ValueError(none_left)
        if n_drop:
            logger.warning(
                "Dropping %d of %d %s %s whose prompt leaves no completion token within max_length=%s.",
                n_drop,
                len(flags),
                dataset_name,
                unit,
                max_length,
            )
            dataset = dataset.select([i for i, keep in enumerate(flags) if keep])
        return dataset

    # ------------------------------------------------------------------------------------------------------------
    # Log-probabilities of a collated batch
    # ------------------------------------------------------------------------------------------------------------
    @staticmethod
    def _target_mask(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Next-token positions to score: the target token is a real completion token."""
        return (inputs["completion_mask"][:, 1:] * inputs["attention_mask"][:, 1:]).bool()

    def _logits_stats(self, logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-token statistics of the full distribution, computed where the LM head runs."""

        return logits_statistics(logits, targets)

    def _token_logps(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor],
        layout: str,
        with_stats: bool,
        prefix_groups: list[list[int]] | None = None,
        **forward_kwargs: Any,
    ):
        """Per-token log-probs of the completion tokens of `inputs` (see `compute_sequence_token_logps`); extra
        keyword arguments go to the model's forward. With `prefix_groups` (rows that start alike, for a model that
        `supports_prefix_sharing`), each group's common prefix runs once when that saves enough tokens."""

        if layout != "padded" and not forward_is_deterministic(model):
            # A forward that draws random numbers (dropout, NEFTune's noise) sees the padded rows, as under TRL (whose
            # DPO falls back to padded batches under `padding_free=True` too).
            layout = "padded"
        # (A model wrapped or sharded for distributed training keeps whole-row passes.)
        if prefix_groups is not None and not forward_kwargs and sharing_possible_now(model):
            shared = share_prefixes(inputs["input_ids"], inputs["attention_mask"], prefix_groups, self.pad_token_id)
            if shared.saved_share >= MIN_SHARED_SAVING:
                self._shared_prefix_passes = self._shared_prefix_passes + 1
                return shared_prefix_token_logps(
                    model,
                    inputs["input_ids"],
                    shared,
                    self._target_mask(inputs),
                    compute_entropy=with_stats,
                    logits_stats_fn=self._logits_stats if with_stats else None,
                )
        # Batches with images carry pixel values (and per-token image ids) for the forward pass.
        forward_kwargs = {**vision_forward_inputs(inputs), **forward_kwargs}
        return compute_sequence_token_logps(
            model,
            inputs["input_ids"],
            inputs["attention_mask"],
            self._target_mask(inputs),
            layout=layout,
            pad_token_id=self.pad_token_id,
            pad_to_multiple_of=getattr(self.args, "pad_to_multiple_of", None),
            compute_entropy=with_stats,
            logits_stats_fn=self._logits_stats if with_stats else None,
            **forward_kwargs,
        )

    # ------------------------------------------------------------------------------------------------------------
    # Training and evaluation steps
    # ------------------------------------------------------------------------------------------------------------
    def training_step(self, *args, **kwargs):
        with self.maybe_activation_offload_context:
            return super().training_step(*args, **kwargs)

    def prediction_step(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            # As TRL: outputs are asked for only when predictions are (a `compute_loss` override sees the same call).
            result = self.compute_loss(model, inputs, return_outputs=not prediction_loss_only)
        if prediction_loss_only:
            return result.detach(), None, None
        loss, outputs = result
        return (loss.detach(), *self._prediction_logits_and_labels(model, inputs, outputs, ignore_keys or []))

    def _prediction_logits_and_labels(
        self, model: nn.Module, inputs: dict[str, Any], outputs: dict[str, torch.Tensor], ignore_keys: list[str]
    ) -> tuple[Any, Any]:
        """Predictions and labels of a batch for `compute_metrics` and `predict()`. As in TRL: the policy's logits
        `(rows, T, V)` over the batch's padded sequences, with their token ids `(rows, T)` as labels (a forward pass
        of its own, run only when predictions are asked for)."""

        with torch.no_grad(), self.compute_loss_context_manager():
            logits = model(
                input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], **vision_forward_inputs(inputs)
            ).logits
        return logits.detach(), inputs["input_ids"]
