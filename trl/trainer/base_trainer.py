"""The trainer base shared by every TRL trainer.

Mechanisms every trainer needs live here once: loading the model and processing class from a string, PEFT
wrapping, metric accumulation and logging (averaged per logging interval, train and eval kept apart), the model card,
and the default config when `args=None`. A trainer subclass adds only its data preparation and its loss.

The families of trainers add their shared machinery in their own bases: `preference_base.py` (DPO, KTO, BCO; with
`unpaired_preference_base.py` for KTO and BCO) and `online_base.py` (GRPO, RLOO, Online DPO, ...).
"""

import contextlib
import copy
import os
import warnings
from collections import defaultdict
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch
import torch.nn as nn
from transformers import PreTrainedModel, Trainer, TrainingArguments
from transformers.utils import is_peft_available

from .._compat import trainer_divides_scaled_loss
from .._data.formats import check_no_images, check_single_format, get_dataset_column_names
from ..chat_template_utils import apply_chat_template_path
from ..models.activation_offloading import get_act_offloading_ctx_manager
from ..models.peft import (
    BF16_ADAPTERS,
    KBIT_PREPARED,
    add_reference_adapter,
    cast_trainable_parameters_to_bf16,
    is_quantized_peft_model,
)
from ..models.utils import _create_reference_model, prepare_deepspeed, prepare_fsdp
from .callbacks import SyncRefModelCallback
from .fast_paths.cpu_allocator import keep_activation_memory
from .fast_paths.layer_checkpoints import CheckpointArena, lean_layer_checkpoints
from .fast_paths.lean_modules import lean_modules, mlps_without_grad
from .fast_paths.optimizer_in_backward import optimizer_steps_in_backward
from .fast_paths.tied_embedding_grad import sparse_tied_embedding_grad
from .run_report.callback import RunReportCallback
from .run_report.data_summary import describe_given_dataset
from .utils import (
    create_model_from_path,
    generate_model_card,
    get_comet_experiment_url,
    get_trackio_space_url,
    prepare_peft_model,
    use_adapter,
)
from .utils.checkpoints import (
    last_complete_checkpoint,
    load_reference_model,
    load_renamed_weights,
    load_trainer_state,
    save_checkpoint_atomically,
    save_reference_model,
    save_trainer_state,
)
from .utils.console_logs import note_offline_test_model, use_numeric_log_printers, warn_if_launch_dropped_processes
from .utils.distributed import guard_gloo_exit, uses_sharding_engine
from .utils.ignored_options import LABEL_SMOOTHING, IgnoredOption, warn_ignored_options
from .utils.packing import packed_sdpa_attention


if is_peft_available():
    from peft import PeftModel


def _seed_initialisations(args: TrainingArguments) -> None:
    """Seed every generator with `args.seed` (as `Trainer` does, full determinism included) before the trained
    model's random initialisations."""
    from transformers.trainer_utils import enable_full_determinism, set_seed

    seed = getattr(args, "seed", None)
    if seed is None:
        return
    if getattr(args, "full_determinism", False):
        enable_full_determinism(seed)
    else:
        set_seed(seed)


def _loss_already_scaled(*args: Any, **kwargs: Any) -> None:
    """Stands in for `compute_loss_func` during a step of a trainer whose loss is already scaled (transformers 4.x)."""
    raise RuntimeError("this trainer computes its own loss; compute_loss_func is never called")


class _BaseTrainer(Trainer):
    """Private base class of all TRL trainers (a [`~transformers.Trainer`] subclass).

    Class attributes a subclass sets:
        _tag_names: Tags added to the model card and to the model's hub tags.
        _name: Human-readable trainer name used in the model card ("SFT", "DPO", ...).
        _paper: Optional dict with `title`, `id` (arXiv id) and `citation` (BibTeX) of the method's paper.
        _template_file: Model card template under `trl/templates/`.
        _accepts_images: Whether the trainer trains vision-language models on image columns; the others refuse
            a dataset with images rather than dropping them.
        _ignored_options: The trainer's table of options that have no effect in some runs (see
            `trl/trainer/utils/ignored_options.py`), checked once when the trainer is built.
        _quantized_base: How adapters are set up on a bitsandbytes 4- or 8-bit base (`trl/models/peft.py`:
            `KBIT_PREPARED`, `AS_LOADED` or `BF16_ADAPTERS`), as TRL's trainer of the same name does.
    """

    _accepts_images: bool = False
    _tag_names: list[str] = []
    _name: str = "Base"
    # Suffix of the default `output_dir` (`<model name>-<suffix>`) when it differs from `_name`.
    _output_dir_suffix: str | None = None
    _quantized_base: str = KBIT_PREPARED
    # The adapter the reference passes of a PEFT policy activate when no `ref_adapter_name` is given (None: the
    # adapters disabled); see `_copy_given_adapter_as_reference`, which the trainers setting
    # `_reference_copies_given_adapter` call (TRL's DPO, KTO, GRPO and RLOO do this).
    _reference_adapter: str | None = None
    _reference_copies_given_adapter: bool = False
    # Instance state declared here with its default (set later, or only by some trainers) rather than probed.
    ref_model = None
    current_gradient_accumulation_steps: int | None = None
    _total_train_tokens = 0
    # Per dataset name ("train", "eval", ...): counts the data preparation knows exactly (rows truncated, rows dropped
    # and why), shown in the run report's data summary. Replaced (never mutated) by a trainer that records some.
    _preparation_counts: Mapping[str, dict[str, int]] = MappingProxyType({})
    _shared_prefix_passes = 0
    _policy_is_reference = False
    # Whether a reference model's pass may run between the policy's forward and backward passes (KTO). Trainers that
    # score with the reference before the policy's forward (DPO, the online trainers, A2PO) say False: the last
    # layers of the policy's forward may then keep their activations (`LayerBudget`).
    _reference_pass_after_policy_forward = True
    # With clipping, whether the backward pass runs twice so that the gradients never coexist (`optimizer_in_backward`)
    _clips_in_two_backward_passes = False
    _paper: dict[str, str] = {}
    _template_file: str = "lm_model_card.md"
    _ignored_options: tuple[IgnoredOption, ...] = ()
    # TRL 1.16 hooks this trainer does not call (name -> where TRL calls it): a subclass overriding one is told so at
    # construction, instead of its override silently never running.
    _uncalled_trl_hooks: dict[str, str] = {}
    # Logged for a metric none of whose recorded values is defined (all NaN) in the logging window.
    _undefined_metric_value: Any = float("nan")

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # Every trainer leaves metrics.jsonl and report.html in its output_dir (opt out: save_run_report=False).
        self.add_callback(RunReportCallback(self))
        use_numeric_log_printers(self)
        warn_if_launch_dropped_processes(self.accelerator.num_processes)
        if self.is_world_process_zero():
            note_offline_test_model(self.model)
        table = (*self._ignored_options, LABEL_SMOOTHING)
        warn_ignored_options(self.args, self._ignored_option_facts(), table, type(self).__name__)
        self._warn_uncalled_overrides()

    def _warn_uncalled_overrides(self) -> None:
        """Warn about each method a subclass defines that TRL 1.16 calls as a hook but this trainer never calls."""
        for name, where in self._uncalled_trl_hooks.items():
            if callable(getattr(type(self), name, None)):
                warnings.warn(
                    f"{type(self).__name__} overrides {name}, which TRL calls {where}; this implementation never calls "
                    f"{name}, so the override has no effect. Override the hook that this trainer does call instead "
                    "(see 'Writing a plugin' in the GRPO docs and docs/architecture.md).",
                    UserWarning,
                    stacklevel=3,
                )

    def _ignored_option_facts(self) -> dict[str, Any]:
        """What the conditions of `_ignored_options` read about this run: the format and columns of the training
        data as given, whether it streams, whether an evaluation set was given and whether the model is an
        encoder-decoder. Trainers add their own facts by extending this dict."""
        given = getattr(self, "_given_train_data", None) or {}
        config = getattr(getattr(self, "model", None), "config", None)
        return {
            "format": given.get("raw_format"),
            "columns": list(getattr(self, "_given_train_columns", None) or ()),
            "iterable": bool(getattr(self, "_given_train_iterable", False)),
            "eval_dataset": getattr(self, "eval_dataset", None) is not None,
            "encoder_decoder": bool(getattr(self, "is_encoder_decoder", getattr(config, "is_encoder_decoder", False))),
            "label_smoothing": False,  # whether the loss applies `label_smoothing_factor` (SFT's may)
        }

    # ------------------------------------------------------------------------------------------------------------
    # Construction helpers (called by subclasses before `Trainer.__init__`)
    # ------------------------------------------------------------------------------------------------------------
    @staticmethod
    def _model_id(model: "str | PreTrainedModel | nn.Module") -> str:
        """Identifier of a model given as a path/id or an instance (its `name_or_path`)."""
        if isinstance(model, str):
            return model
        config = getattr(model, "config", None)
        return getattr(config, "_name_or_path", None) or type(model).__name__

    @classmethod
    def _default_args(cls, config_class: type[TrainingArguments], model: Any) -> TrainingArguments:
        """Config used when `args=None`: `output_dir` is `<model name>-<suffix>`, the suffix being
        `_output_dir_suffix` or else the trainer's `_name` (as TRL names them: `Qwen2-0.5B-GRPO`, `...-OnlineDPO`)."""
        model_name = cls._model_id(model).rstrip("/").split("/")[-1]
        return config_class(f"{model_name}-{cls._output_dir_suffix or cls._name}")

    def _overridden_since(self, base: type, *names: str) -> bool:
        """Whether the trainer's class overrides any of the methods `names` that `base` defines (a subclass written
        for TRL replacing a hook): fast paths that would bypass such a hook step aside."""
        cls = type(self)
        return any(getattr(cls, name) is not getattr(base, name) for name in names)

    @classmethod
    def _load_trained_model(cls, model: Any, args: TrainingArguments, peft_config: Any, **load_kwargs: Any) -> Any:
        """The model to train: loaded when `model` is a path or id (`_load_model`, with `load_kwargs`), refused when
        it is already a PeftModel and a `peft_config` asks to wrap it again."""
        model = cls._load_model(model, args, **load_kwargs)
        cls._reject_peft_model_with_config(model, peft_config)
        return model

    @classmethod
    def _reject_peft_model_with_config(cls, model: Any, peft_config: Any) -> None:
        if cls._is_peft_model(model) and peft_config is not None:
            raise ValueError(
                "You passed a PeftModel together with a peft_config. Pass either a base model with peft_config, or "
                "the PeftModel alone."
            )

    @staticmethod
    def _load_model(
        model: "str | PreTrainedModel",
        args: TrainingArguments,
        architecture: Any = None,
        quantization_config: Any = None,
        seed_initialisations: bool = True,
        **extra_init_kwargs: Any,
    ) -> PreTrainedModel:
        """Load `model` when it is a path or id, using `args.model_init_kwargs`; otherwise return it unchanged.

        A model instance combined with `model_init_kwargs` or `quantization_config` keeps the instance as is and warns
        that those options were ignored.

        The trained model's random initialisations (weights a checkpoint lacks, such as a new score head, then the
        PEFT adapters) draw from the generators seeded with `args.seed`, as in TRL: the same seed, the same model
        (`seed_initialisations=False` for a reference model, loaded after the trained one).
        """

        if seed_initialisations:
            _seed_initialisations(args)
        init_kwargs = dict(getattr(args, "model_init_kwargs", None) or {})
        if isinstance(model, str):
            if quantization_config is not None:
                if "quantization_config" in init_kwargs:
                    raise ValueError(
                        "quantization_config was given both to the trainer and in args.model_init_kwargs; pass it "
                        "in one place only."
                    )
                init_kwargs["quantization_config"] = quantization_config
            if getattr(args, "trust_remote_code", False):
                init_kwargs.setdefault("trust_remote_code", True)
            for key, value in extra_init_kwargs.items():
                init_kwargs.setdefault(key, value)
            return create_model_from_path(model, architecture=architecture, **init_kwargs)
        if init_kwargs:
            warnings.warn(
                "args.model_init_kwargs is only used when `model` is a string (a path or hub id); the model you "
                "passed is already instantiated, so these kwargs are ignored.",
                UserWarning,
                stacklevel=3,
            )
        if quantization_config is not None:
            warnings.warn(
                "quantization_config is only used when `model` is a string; the model you passed is already "
                "instantiated, so it is ignored.",
                UserWarning,
                stacklevel=3,
            )
        return model

    @staticmethod
    def _ensure_pad_token(processing_class: Any) -> Any:
        """The tokenizer of `processing_class`, given the eos token as pad token when it has none."""
        tokenizer = getattr(processing_class, "tokenizer", processing_class)
        if getattr(tokenizer, "pad_token", None) is None:
            if getattr(tokenizer, "eos_token", None) is None:
                raise ValueError(
                    "The processing class has neither a pad_token nor an eos_token; set tokenizer.pad_token before "
                    "creating the trainer."
                )
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer

    def _init_activation_offloading(self) -> None:
        """Set `maybe_activation_offload_context`, entered around the forward/backward of each training step: it
        moves saved activations to CPU when `args.activation_offloading` is on, and does nothing otherwise."""
        if getattr(self.args, "activation_offloading", False):
            self.maybe_activation_offload_context = get_act_offloading_ctx_manager(self.model)
        else:
            self.maybe_activation_offload_context = contextlib.nullcontext()

    @staticmethod
    def _load_processing_class(
        model_id: str, args: TrainingArguments, padding_side: str | None = None, tokenizer_only: bool = False
    ):
        """Load the processing class from the model's path/id and make sure it has a pad token.

        Args:
            model_id: Path or hub id of the model.
            args: The trainer config (its `model_init_kwargs["revision"]` and `trust_remote_code` are honoured).
            padding_side: Force this padding side when given (online trainers generate with left padding).
            tokenizer_only: Load with `AutoTokenizer` instead of `AutoProcessor`.
        """
        from transformers import AutoProcessor, AutoTokenizer

        init_kwargs = getattr(args, "model_init_kwargs", None) or {}
        kwargs = {"trust_remote_code": getattr(args, "trust_remote_code", False)}
        if init_kwargs.get("revision") is not None:
            kwargs["revision"] = init_kwargs["revision"]
        if padding_side is not None:
            kwargs["padding_side"] = padding_side
        loader = AutoTokenizer if tokenizer_only else AutoProcessor
        try:
            processing_class = loader.from_pretrained(model_id, **kwargs)
        except Exception as error:
            raise ValueError(
                f"Could not load a processing class for {model_id!r} ({type(error).__name__}: {error}). Pass "
                "`processing_class=` explicitly (for example AutoTokenizer.from_pretrained(<local dir>))."
            ) from error
        tokenizer = getattr(processing_class, "tokenizer", processing_class)
        if getattr(tokenizer, "pad_token", None) is None and getattr(tokenizer, "eos_token", None) is not None:
            tokenizer.pad_token = tokenizer.eos_token
        if padding_side is not None and hasattr(tokenizer, "padding_side"):
            tokenizer.padding_side = padding_side
        return processing_class

    def _wrap_peft(self, model: PreTrainedModel, peft_config: Any, args: TrainingArguments) -> PreTrainedModel:
        """Wrap `model` with PEFT adapters from `peft_config` (see `prepare_peft_model`). Without one, a `PeftModel`
        on a quantized base passed in still gets its trainable parameters in bf16 where `_quantized_base` says so."""
        if peft_config is not None:
            return prepare_peft_model(model, peft_config, args, quantized_base=self._quantized_base)
        if self._quantized_base == BF16_ADAPTERS and is_quantized_peft_model(model):
            cast_trainable_parameters_to_bf16(model)
        return model

    @staticmethod
    def _is_peft_model(model: Any) -> bool:
        return is_peft_available() and isinstance(model, PeftModel)

    def _check_train_dataset(self, train_dataset: Any, trainer_name: str) -> None:
        if train_dataset is None:
            unless = " unless an `environment_factory` is provided" if trainer_name == "GRPOTrainer" else ""
            raise ValueError(
                f"`train_dataset` is required{unless}. {trainer_name} needs a `train_dataset`; got None. Pass a "
                "datasets.Dataset or IterableDataset."
            )

        check_single_format(train_dataset, "train")
        self._given_train_data = describe_given_dataset(train_dataset)
        from datasets import Dataset, IterableDataset

        if isinstance(train_dataset, (Dataset, IterableDataset)):
            self._given_train_columns = get_dataset_column_names(train_dataset)
            self._given_train_iterable = isinstance(
                train_dataset, IterableDataset
            )  # for the run report's data summary
        if not self._accepts_images:  # trainers that take images check the processor themselves
            check_no_images(train_dataset, "train")

    @staticmethod
    def _first_example(dataset: Any) -> dict | None:
        """First row of a `Dataset` / `IterableDataset`, or None (other inputs are checked elsewhere); used to detect
        image columns."""
        from datasets import Dataset, IterableDataset

        if not isinstance(dataset, (Dataset, IterableDataset)):
            return None
        first = next(iter(dataset), None)
        return first if isinstance(first, dict) else None

    @staticmethod
    def _prepare_iterable_args(args: TrainingArguments, train_dataset: Any) -> None:
        """Streaming datasets: batches cannot be dispatched from the main process, and a step count is required."""
        from datasets import IterableDataset

        if isinstance(train_dataset, IterableDataset):
            if args.max_steps is None or args.max_steps <= 0:
                raise ValueError(
                    "A streaming (IterableDataset) train_dataset has no length, so the number of steps is unknown; "
                    "set args.max_steps to a positive value."
                )
            if args.accelerator_config is not None:
                args.accelerator_config.dispatch_batches = False

    # ------------------------------------------------------------------------------------------------------------
    # Reference model (DPO, KTO, GRPO, RLOO, ...): one implementation for every trainer
    # ------------------------------------------------------------------------------------------------------------
    @classmethod
    def _build_ref_model(
        cls,
        model: "str | PreTrainedModel",
        policy: PreTrainedModel,
        ref_model: "str | PreTrainedModel | None",
        args: TrainingArguments,
        needed: bool = True,
    ) -> PreTrainedModel | None:
        """Reference model for a trainer, created before `Trainer.__init__`.

        Returns None when no separate reference is needed: `needed=False` (e.g. `beta == 0` or precomputed reference
        log-probs) or a PEFT policy, whose reference is the same model with its adapters disabled. Otherwise the
        given `ref_model` (loaded when it is a string), or a fresh frozen copy of the policy loaded from the
        policy's path with `model_init_kwargs` and the policy's dtype.

        Args:
            model: What the user passed as `model` (a string or an instance).
            policy: The loaded policy (before PEFT wrapping it may still be a plain model).
            ref_model: What the user passed as `ref_model`.
            args: The trainer config.
            needed: Whether the method needs a reference at all.
        """
        if ref_model is not None and ref_model is policy:
            raise ValueError(
                "`model` and `ref_model` cannot be the same object. In most cases you should omit `ref_model` and "
                "we'll initialize it to a copy of `model` for you. (`ref_model` is the same object as `model`: pass a "
                "separate copy as ref_model, or leave it None; with PEFT the adapter-disabled model is the reference.)"
            )
        if isinstance(ref_model, str):
            ref_model = cls._load_model(ref_model, args, seed_initialisations=False)
        if ref_model is not None:
            return cls._freeze(ref_model)
        if not needed or cls._is_peft_model(policy):
            return None
        if isinstance(model, str):
            init_kwargs = dict(getattr(args, "model_init_kwargs", None) or {})
            init_kwargs["dtype"] = policy.dtype
            attn = getattr(policy.config, "_attn_implementation", None)
            if attn is not None:
                init_kwargs.setdefault("attn_implementation", attn)
            init_kwargs.pop("quantization_config", None)
            if getattr(args, "trust_remote_code", False):
                init_kwargs.setdefault("trust_remote_code", True)
            return cls._freeze(create_model_from_path(model, **init_kwargs))

        return _create_reference_model(policy)

    def _copy_given_adapter_as_reference(self, model_arg: Any, policy: nn.Module, needed: bool) -> None:
        """When the user passed a `PeftModel` (not a `peft_config`) and the method needs a reference, its adapter as
        it is when training starts is the reference, as in TRL: copied into a frozen adapter that the reference
        passes activate (`add_reference_adapter`)."""
        if self._reference_copies_given_adapter and needed and model_arg is policy and self._is_peft_model(policy):
            self._reference_adapter = add_reference_adapter(policy)

    @staticmethod
    def _freeze(model: nn.Module) -> nn.Module:
        for param in model.parameters():
            param.requires_grad_(False)
        return model.eval()

    def _prepare_ref_model(self, ref_model: nn.Module | None) -> nn.Module | None:
        """Place the reference model for evaluation under the trainer's engine (DeepSpeed, FSDP or plain)."""
        if ref_model is None:
            return None
        if self.is_deepspeed_enabled:
            return prepare_deepspeed(ref_model, self.accelerator)
        if self.is_fsdp_enabled:
            return prepare_fsdp(ref_model, self.accelerator)
        return self.accelerator.prepare_model(ref_model, evaluation_mode=True)

    def _add_sync_ref_model_callback(self, ref_model: nn.Module | None) -> None:
        """TR-DPO style reference refresh (`sync_ref_model=True`): ref <- alpha * policy + (1 - alpha) * ref."""
        if not getattr(self.args, "sync_ref_model", False):
            return
        if ref_model is None:
            raise ValueError(
                "sync_ref_model=True needs a separate reference model, but none exists here (a PEFT policy uses its "
                "adapter-disabled self, and precomputed reference log-probs drop the model). Set "
                "sync_ref_model=False or train without PEFT / precompute_ref_log_probs."
            )

        self.add_callback(SyncRefModelCallback(ref_model=ref_model, accelerator=self.accelerator))

    @contextlib.contextmanager
    def _reference_context(self, model: nn.Module, ref_model: nn.Module | None, ref_adapter_name: str | None = None):
        """Yield the module that computes reference outputs, in no-grad mode.

        With a separate reference model, that model. With a PEFT policy, the policy itself with the adapter named
        `ref_adapter_name` active, or with all adapters disabled when it is None.
        """
        with torch.no_grad():
            if ref_model is not None:
                with mlps_without_grad(ref_model):
                    yield ref_model
                return
            unwrapped = self.accelerator.unwrap_model(model)
            if not self._is_peft_model(unwrapped):
                raise ValueError("No reference model is available: pass ref_model, or use a PEFT policy.")

            with use_adapter(unwrapped, ref_adapter_name if ref_adapter_name is not None else self._reference_adapter):
                yield model

    # ------------------------------------------------------------------------------------------------------------
    # Metrics: accumulated per mode, averaged at log time
    # ------------------------------------------------------------------------------------------------------------
    def _init_metrics(self) -> None:
        self._metrics: dict[str, defaultdict[str, list[float]]] = {
            "train": defaultdict(list),
            "eval": defaultdict(list),
        }

    @property
    def _mode(self) -> str:
        return "train" if self.model.training else "eval"

    def _record_metric(self, name: str, value: "torch.Tensor | float", mode: str | None = None) -> None:
        """Store a scalar metric for the current logging interval (averaged across processes first)."""
        mode = mode or self._mode
        if torch.is_tensor(value):
            value = value.detach().float().reshape(1).to(self.accelerator.device)
            value = self.accelerator.gather(value).mean().item()
        self._metrics[mode][name].append(float(value))

    def _record_num_tokens(self, mode: str, batch_tokens: float | None = None) -> None:
        """Log TRL's `num_tokens`: the running count of training tokens (already summed over processes).

        A training batch adds its `batch_tokens`; evaluation logs the count reached so far, unchanged (so
        `eval_num_tokens` says how much the evaluated model was trained on).
        """
        if mode == "train" and batch_tokens is not None:
            self._total_train_tokens = self._total_train_tokens + int(batch_tokens)
        self._metrics[mode]["num_tokens"] = [float(self._total_train_tokens)]

    def _record_sum_metric(self, name: str, value: "torch.Tensor | float", mode: str | None = None) -> None:
        """Store a metric summed across processes (counts such as `num_tokens`)."""
        mode = mode or self._mode
        if torch.is_tensor(value):
            value = value.detach().float().reshape(1).to(self.accelerator.device)
            value = self.accelerator.gather(value).sum().item()
        self._metrics[mode][name].append(float(value))

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = self._mode
        if not hasattr(self, "_metrics"):
            self._init_metrics()
        metrics = {}
        for key, values in self._metrics[mode].items():
            finite = [v for v in values if v == v]  # drop NaN entries (e.g. metrics undefined for a batch)
            metrics[key] = sum(finite) / len(finite) if finite else self._undefined_metric_value
        if mode == "eval":
            metrics = {f"eval_{key}": value for key, value in metrics.items()}
        # In place: `evaluate()`, best-model tracking and callbacks read this same dict after `log()` returns.
        logs.update(metrics)
        super().log(logs, start_time)
        self._metrics[mode].clear()

    # ------------------------------------------------------------------------------------------------------------
    # Loss normalisation shared by token-level losses
    # ------------------------------------------------------------------------------------------------------------
    def _scale_for_token_average(self, loss: torch.Tensor, num_items_in_batch: Any) -> torch.Tensor:
        """Undo the across-device averaging of gradients when the loss was divided by a global token count.

        `num_items_in_batch` is summed over all processes when `average_tokens_across_devices` is on, while DDP
        averages gradients over processes, so the per-process loss must be multiplied by the process count.
        """
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * self.accelerator.num_processes
        return loss

    # ------------------------------------------------------------------------------------------------------------
    # Files
    # ------------------------------------------------------------------------------------------------------------
    # ------------------------------------------------------------------------------------------------------------
    # Evaluation on datasets passed to `evaluate()`
    # ------------------------------------------------------------------------------------------------------------
    def _prepare_eval_dataset(self, dataset: Any, name: str) -> Any:
        """Hook: prepare a dataset given to `evaluate(eval_dataset=...)` exactly as the constructor prepares its
        `eval_dataset` (tokenisation, reference log-probs, ...). Must leave an already prepared dataset unchanged.
        The default returns `dataset` as is."""
        return dataset

    def evaluate(
        self,
        eval_dataset: Any = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> dict[str, float]:
        """Evaluate as [`~transformers.Trainer.evaluate`] does, preparing a raw `eval_dataset` first.

        A dict of datasets is evaluated one by one with the prefix `f"{metric_key_prefix}_{name}"` (transformers'
        convention); a string names one of the constructor's evaluation datasets.
        """
        if isinstance(eval_dataset, dict):
            metrics = {}
            for name, dataset in eval_dataset.items():
                metrics.update(self.evaluate(dataset, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        if eval_dataset is not None and not isinstance(eval_dataset, str):
            eval_dataset = self._prepare_eval_dataset(eval_dataset, metric_key_prefix)
        with self._training_kernels():
            return super().evaluate(eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)

    def predict(
        self,
        test_dataset: Any,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "test",
    ) -> Any:
        """Predict as [`~transformers.Trainer.predict`] does, preparing a raw `test_dataset` first (as `evaluate`
        does) and with the trainer's faster, leaner kernels in place (see `_training_kernels`)."""
        test_dataset = self._prepare_eval_dataset(test_dataset, metric_key_prefix)
        with self._training_kernels():
            return super().predict(test_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)

    def _training_kernels(self) -> contextlib.AbstractContextManager:
        """Faster, leaner stand-ins for parts of the model, in place while training or evaluating and removed
        afterwards (the model given and the ones saved keep their own): per-sequence causal attention on padding-free
        batches ([`~trl.trainer.utils.packing.packed_sdpa_attention`]) and the MLPs and RMSNorms that keep fewer
        activations ([`~trl.trainer.fast_paths.lean_modules.lean_modules`]), and tied input embeddings that add their
        gradient sparsely into the head's ([`~trl.trainer.fast_paths.tied_embedding_grad.sparse_tied_embedding_grad`])."""

        stack = contextlib.ExitStack()
        stack.enter_context(packed_sdpa_attention(self.model))
        stack.enter_context(lean_modules(self.model, self.args))
        stack.enter_context(sparse_tied_embedding_grad(self.model, self.args))
        return stack

    def _save_checkpoint(self, model, trial):
        if self.args.hub_model_id is None:
            model_name = os.path.basename(os.path.normpath(self.args.output_dir))
        else:
            model_name = self.args.hub_model_id.split("/")[-1]
        self.create_model_card(model_name=model_name)

        save_checkpoint_atomically(self, model, trial, super()._save_checkpoint)

    # ------------------------------------------------------------------------------------------------------------
    # Resuming: state outside transformers' checkpoint, and only complete checkpoints
    # ------------------------------------------------------------------------------------------------------------
    def _checkpoint_state(self) -> dict[str, Any]:
        """Hook: this process's trainer state that transformers does not checkpoint but an exact resume needs.

        Values must be tensors, numbers, strings, or lists/dicts of them (the file is read with `weights_only=True`).
        A subclass extends the dict of `super()._checkpoint_state()` and reads its keys back in
        `_restore_checkpoint_state`.
        """
        return {"total_train_tokens": self._total_train_tokens}

    def _restore_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Hook: restore what `_checkpoint_state` saved (called when training resumes from a checkpoint)."""
        if "total_train_tokens" in state:
            self._total_train_tokens = int(state["total_train_tokens"])

    def _state_from_log_history(self) -> dict[str, Any] | None:
        """What `_checkpoint_state` would have held, recovered from the resumed `trainer_state.json` when the
        checkpoint has no `trl_state_<rank>.pt` (one written by TRL): the token count logged at the checkpoint's step
        (None when no log entry falls on that step, and the count restarts from zero as in TRL)."""
        step = self.state.global_step
        for entry in reversed(self.state.log_history):
            if entry.get("step") == step and "num_tokens" in entry:
                return {"total_train_tokens": entry["num_tokens"]}
        return None

    def _save_checkpoint_extras(self, checkpoint_dir: str) -> None:
        """Hook: write extra files into a checkpoint while it is still being assembled (before it becomes visible
        under its final name). The default writes this process's `_checkpoint_state`."""

        save_trainer_state(checkpoint_dir, self.args.process_index, self._checkpoint_state())
        if self._reference_model_changes() and self.is_world_process_zero():
            save_reference_model(checkpoint_dir, self._synced_reference_model())
        # Callbacks with state of their own (BEMA's averages) write it into the same staged checkpoint.
        for callback in self.callback_handler.callbacks:
            if hasattr(callback, "save_checkpoint_files"):
                callback.save_checkpoint_files(checkpoint_dir, self.is_world_process_zero())

    def _reference_model_changes(self) -> bool:
        """Hook: whether the reference model is updated during training, so that checkpoints must hold it."""
        return bool(getattr(self.args, "sync_ref_model", False))

    def _synced_reference_model(self) -> nn.Module | None:
        # SyncRef updates the reference model during training, so a resumed run needs it back from the checkpoint.
        ref_model = self.ref_model
        return self.accelerator.unwrap_model(ref_model) if ref_model is not None else None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        # transformers (5.24) reloads a checkpoint with a plain `load_state_dict`, but `save_pretrained` wrote the
        # weights of models with a conversion mapping (vision-language models) under their original names: every
        # renamed weight would silently keep its initial value. Map the names back for a bare model; PEFT adapters
        # and FSDP load as transformers does (DeepSpeed resumes through its own checkpoint, not this method).
        if (
            (model is None or model is self.model)
            and isinstance(self.model, PreTrainedModel)
            and not self.is_fsdp_enabled
        ):
            result = load_renamed_weights(self.model, resume_from_checkpoint)
            if result is not None:
                self._issue_warnings_after_load(result)
                return
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # accelerate keeps the first Accelerator's mixed precision for the whole process, and transformers 4.x
        # exports `bf16`/`fp16` to os.environ: a later trainer asking for another precision silently gets the first.
        requested = "bf16" if self.args.bf16 else "fp16" if self.args.fp16 else "no"
        actual = str(getattr(self.accelerator, "mixed_precision", requested))
        if actual != requested and not self.is_deepspeed_enabled:
            warnings.warn(
                f"This trainer's config asks for mixed precision {requested!r} (bf16={self.args.bf16}, "
                f"fp16={self.args.fp16}), but {actual!r} is in force: it was set earlier in this process (by "
                "`accelerate launch --mixed_precision`, ACCELERATE_MIXED_PRECISION, or an earlier trainer's config "
                "under transformers 4.x). Start a new process, or call "
                "`accelerate.state.AcceleratorState._reset_state()` before creating the trainer.",
                UserWarning,
                stacklevel=2,
            )

    def _load_optimizer_and_scheduler(self, checkpoint):
        # Called on every resume (plain, DeepSpeed and FSDP alike) with the checkpoint directory that was resolved;
        # transformers before 5.3 also calls it with None on every `train()` that does not resume.
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return

        state = load_trainer_state(checkpoint, self.args.process_index)
        if state is None:  # a checkpoint written by TRL itself, which keeps no state of its own
            state = self._state_from_log_history()
        if state is not None:
            self._restore_checkpoint_state(state)
        if self._reference_model_changes():
            load_reference_model(checkpoint, self._synced_reference_model())
        for callback in self.callback_handler.callbacks:
            if hasattr(callback, "load_checkpoint_files"):
                callback.load_checkpoint_files(checkpoint)

    def train(self, resume_from_checkpoint: "str | bool | None" = None, *args, **kwargs):
        """Train as [`~transformers.Trainer.train`] does; `resume_from_checkpoint=True` resumes from the latest
        *complete* checkpoint in `output_dir` (a checkpoint cut short by a crash is never picked)."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir)

        guard_gloo_exit()
        # On the CPU, freed activation memory stays in the heap for the next step instead of being faulted in anew.
        parameter = next(self.model.parameters(), None)
        keep_activation_memory(parameter.device.type if parameter is not None else self.args.device.type)
        with self._training_kernels():
            try:
                return super().train(resume_from_checkpoint, *args, **kwargs)
            finally:
                self._checkpoint_arena = None  # the kept layer outputs' chunks, until the next `train()`

    def compute_loss_context_manager(self) -> contextlib.ExitStack:
        """transformers' context around `compute_loss` (autocast), plus, when training on the CPU in one process with
        gradient checkpointing, checkpointed decoder layers whose kept outputs live outside the C heap
        ([`~trl.trainer.fast_paths.layer_checkpoints.lean_layer_checkpoints`])."""

        stack = super().compute_loss_context_manager()
        args = self.args
        if (
            self.model.training
            and args.gradient_checkpointing
            and (args.gradient_checkpointing_kwargs or {}) in ({}, {"use_reentrant": False})
            and self.accelerator.num_processes == 1
            and not uses_sharding_engine(args)
        ):
            arena = self.__dict__.get("_checkpoint_arena")
            if arena is None:
                # A trainer that also holds a reference model trades one more attention forward per layer for a
                # backward pass that never holds a whole layer's activations (see `CheckpointArena`).
                split_layers = self.ref_model is not None
                arena = self._checkpoint_arena = CheckpointArena(split_layers=split_layers)
            # Layers kept uncheckpointed within the gradient budget (`LayerBudget`) unless a reference model's pass
            # runs between the policy's forward and backward, on top of the kept activations.
            keep = not (self.ref_model is not None and self._reference_pass_after_policy_forward)
            stack.enter_context(lean_layer_checkpoints(self.model, arena, keep_activations=keep))
        return stack

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        """transformers' training step; the last micro-batch's backward pass may step each parameter as soon as its
        gradient is complete ([`~trl.trainer.fast_paths.optimizer_in_backward.optimizer_steps_in_backward`])."""
        with optimizer_steps_in_backward(self, model) as steps:
            loss = self._transformers_training_step(model, inputs, num_items_in_batch)
        self._steps_in_backward = steps
        return loss

    def _transformers_training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any
    ) -> torch.Tensor:
        if not trainer_divides_scaled_loss(self):
            return super().training_step(model, inputs, num_items_in_batch)
        # transformers 4.x divides the loss by the accumulation steps unless `compute_loss_func` is set, and only
        # reads it there (this trainer's `compute_loss` never calls it): set for the step, the loss stays as
        # `compute_loss` scaled it, as transformers 5 leaves it given `loss_is_scaled_for_ga`.
        previous, self.compute_loss_func = self.compute_loss_func, _loss_already_scaled
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            self.compute_loss_func = previous

    def _clip_grad_norm(self, model: nn.Module) -> Any:
        """transformers' clipping; after two backward passes (the second stepped each parameter clipped), the first
        pass's global norm, with the gradients left clipped as the others were."""
        steps = self.__dict__.get("_steps_in_backward")
        if steps is not None and steps.clip_coef is not None:
            return steps.clip_held(model.parameters())
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        """The norm transformers logs as `grad_norm`; when the backward pass stepped the parameters (and freed their
        gradients), the norm of the gradients they were stepped with."""
        steps = self.__dict__.pop("_steps_in_backward", None)
        if grad_norm is None and steps is not None:
            return steps.total_norm()
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def create_model_card(
        self,
        model_name: str | None = None,
        dataset_name: str | None = None,
        tags: str | list[str] | None = None,
    ) -> None:
        """Write a `README.md` model card to `args.output_dir` (main process only).

        Args:
            model_name: Name of the trained model.
            dataset_name: Name of the dataset used for training.
            tags: Extra tags for the card, on top of the trainer's own.
        """
        if not self.is_world_process_zero():
            return

        config = getattr(self.model, "config", None)
        base_model = getattr(config, "_name_or_path", None)
        if base_model is not None and os.path.isdir(base_model):
            base_model = None  # a local directory is not a hub link
        tag_list: list[str] = [tags] if isinstance(tags, str) else list(tags or [])
        tag_list = list(dict.fromkeys([*tag_list, "trl", *self._tag_names]))
        wandb_url = None
        try:
            import wandb

            if wandb.run is not None:
                wandb_url = wandb.run.url
        except ImportError:
            pass
        card = generate_model_card(
            base_model=base_model,
            model_name=model_name,
            hub_model_id=self.hub_model_id if getattr(self, "hub_model_id", None) else model_name,
            dataset_name=dataset_name,
            tags=tag_list,
            wandb_url=wandb_url,
            trackio_url=get_trackio_space_url(),
            comet_url=get_comet_experiment_url(),
            trainer_name=self._name,
            trainer_citation=self._paper.get("citation"),
            template_file=os.path.join(os.path.dirname(os.path.dirname(__file__)), "templates", self._template_file),
            paper_title=self._paper.get("title"),
            paper_id=self._paper.get("id"),
        )
        card.save(os.path.join(self.args.output_dir, "README.md"))

    def _add_model_tags(self, model: Any) -> None:
        if hasattr(model, "add_model_tags"):
            model.add_model_tags(self._tag_names)

    # ------------------------------------------------------------------------------------------------------------
    # Classification heads with PEFT (reward and process reward models)
    # ------------------------------------------------------------------------------------------------------------
    @staticmethod
    def _with_trainable_head(
        peft_config: Any,
        model: nn.Module,
        head_names: tuple[str, ...] = ("score", "classifier"),
        task_type: str | None = None,
    ):
        """Copy of `peft_config` fit for a classification model: its head trains, and the task type matches.

        A sequence/token-classification head is usually freshly initialised, so it must be trained (and saved with
        the adapter) even though the rest of the base model stays frozen: any top-level child module named in
        `head_names` is added to `modules_to_save`. When `task_type` is given and the config names another one (for
        example the `CAUSAL_LM` default of the CLI's `--lora_task_type`, whose PEFT wrapper expects a generative
        model), it is replaced with a warning. The config is returned unchanged when nothing needs fixing.

        Args:
            peft_config: A `peft.PeftConfig` (not modified), or None.
            model: The model about to be wrapped.
            head_names: Names of head modules to look for among the model's direct children.
            task_type: PEFT task type the trainer needs (`"SEQ_CLS"`, `"TOKEN_CLS"`), or None to keep any.
        """
        if peft_config is None:
            return None
        current = getattr(peft_config, "task_type", None)
        current = getattr(current, "value", current)
        fix_task = task_type is not None and current is not None and current != task_type
        heads = [name for name, _ in model.named_children() if name in head_names]
        modules = list(getattr(peft_config, "modules_to_save", None) or [])
        missing = [name for name in heads if name not in modules] if hasattr(peft_config, "modules_to_save") else []
        if not missing and not fix_task:
            return peft_config
        peft_config = copy.copy(peft_config)
        if missing:
            peft_config.modules_to_save = modules + missing
        if fix_task:
            warnings.warn(
                f"peft_config.task_type={current!r} does not fit this trainer's {type(model).__name__}; using "
                f"task_type={task_type!r} instead (pass --lora_task_type {task_type} on the command line).",
                UserWarning,
                stacklevel=3,
            )
            peft_config.task_type = task_type
        return peft_config

    _apply_chat_template_path = staticmethod(apply_chat_template_path)  # `args.chat_template_path` (SFT, Reward)

    # ------------------------------------------------------------------------------------------------------------
    # Shared by offline and online trainers: the MoE router loss, and batch metrics gathered in one collective
    # ------------------------------------------------------------------------------------------------------------
    @staticmethod
    def _resolve_aux_loss(model: nn.Module, args: TrainingArguments) -> tuple[bool, float]:
        """Whether to add the mixture-of-experts router loss, and its weight.

        `args.router_aux_loss_coef=None` uses the model config's coefficient when the config asks for router logits
        (`output_router_logits=True`); a number turns the loss on with that weight (0.0 turns it off). Setting it on a
        model without a router is an error.
        """
        model_config = getattr(model, "config", None)
        requested = getattr(args, "router_aux_loss_coef", None)
        if requested is None and not getattr(model_config, "output_router_logits", False):
            return False, 0.0
        is_moe = model_config is not None and hasattr(model_config, "router_aux_loss_coef")
        if requested is not None and not is_moe:
            raise ValueError(
                f"router_aux_loss_coef={requested} was set, but {type(model).__name__} has no mixture-of-experts "
                "router. Leave router_aux_loss_coef=None for dense models."
            )
        coef = requested if requested is not None else model_config.router_aux_loss_coef
        if is_moe and coef:
            model_config.output_router_logits = True
            return True, float(coef)
        return False, 0.0

    def _record_batch_metrics(
        self,
        mode: str,
        means: dict[str, torch.Tensor] | None = None,
        ratios: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
        sums: dict[str, torch.Tensor] | None = None,
        num_tokens: torch.Tensor | None = None,
    ) -> None:
        """Gather every metric of a batch across processes in one collective and store it for logging.

        Args:
            mode: `"train"` or `"eval"`.
            means: Scalars averaged over processes.
            ratios: `(numerator, denominator)` pairs, each summed over processes, stored as their ratio (NaN when the
                denominator is 0, e.g. token-level means over an empty selection).
            sums: Scalars summed over processes.
            num_tokens: Tokens of this batch (see [`_record_num_tokens`]).
        """
        means, ratios, sums = means or {}, ratios or {}, sums or {}
        values = [torch.as_tensor(v).detach().float().reshape(()) for v in means.values()]
        for numerator, denominator in ratios.values():
            values.append(torch.as_tensor(numerator).detach().float().reshape(()))
            values.append(torch.as_tensor(denominator).detach().float().reshape(()))
        values.extend(torch.as_tensor(v).detach().float().reshape(()) for v in sums.values())
        if num_tokens is not None:
            values.append(torch.as_tensor(num_tokens).detach().float().reshape(()))
        if not values:
            return
        stacked = torch.stack([v.to(self.accelerator.device) for v in values])
        gathered = self.accelerator.gather(stacked.unsqueeze(0)).reshape(-1, stacked.numel())
        averaged = gathered.mean(dim=0).tolist()
        summed = gathered.sum(dim=0).tolist()
        index = 0
        for name in means:
            self._metrics[mode][name].append(averaged[index])
            index += 1
        for name in ratios:
            numerator, denominator = summed[index], summed[index + 1]
            self._metrics[mode][name].append(numerator / denominator if denominator > 0 else float("nan"))
            index += 2
        for name in sums:
            self._metrics[mode][name].append(summed[index])
            index += 1
        if num_tokens is not None:
            self._record_num_tokens(mode, summed[index])
