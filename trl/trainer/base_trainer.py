"""The trainer base shared by every TRL trainer.

Mechanisms every trainer needs live here once: loading the model and processing class from a string, PEFT
wrapping, metric accumulation and logging (averaged per logging interval, train and eval kept apart), the model card,
and the default config when `args=None`. A trainer subclass adds only its data preparation and its loss.
"""

import contextlib
import copy
import logging
import os
import warnings
from collections import defaultdict
from typing import Any

import torch
import torch.nn as nn
from transformers import PreTrainedModel, Trainer, TrainingArguments
from transformers.utils import is_peft_available


if is_peft_available():
    from peft import PeftModel


logger = logging.getLogger(__name__)


class _BaseTrainer(Trainer):
    """Private base class of all TRL trainers (a [`~transformers.Trainer`] subclass).

    Class attributes a subclass sets:
        _tag_names: Tags added to the model card and to the model's hub tags.
        _name: Human-readable trainer name used in the model card ("SFT", "DPO", ...).
        _paper: Optional dict with `title`, `id` (arXiv id) and `citation` (BibTeX) of the method's paper.
        _template_file: Model card template under `trl/templates/`.
    """

    _tag_names: list[str] = []
    _name: str = "Base"
    _paper: dict[str, str] = {}
    _template_file: str = "lm_model_card.md"

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
    def _default_args(cls, config_class: type[TrainingArguments], model: Any, suffix: str) -> TrainingArguments:
        """Config used when `args=None`: `output_dir` is `<model name>-<suffix>`."""
        model_name = cls._model_id(model).rstrip("/").split("/")[-1]
        return config_class(f"{model_name}-{suffix}")

    @staticmethod
    def _load_model(
        model: "str | PreTrainedModel",
        args: TrainingArguments,
        architecture: Any = None,
        quantization_config: Any = None,
        **extra_init_kwargs: Any,
    ) -> PreTrainedModel:
        """Load `model` when it is a path or id, using `args.model_init_kwargs`; otherwise return it unchanged.

        A model instance combined with `model_init_kwargs` or `quantization_config` keeps the instance as is and warns
        that those options were ignored.
        """
        from .utils import create_model_from_path

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
            from ..models.activation_offloading import get_act_offloading_ctx_manager

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

    @staticmethod
    def _wrap_peft(model: PreTrainedModel, peft_config: Any, args: TrainingArguments) -> PreTrainedModel:
        """Wrap `model` with PEFT adapters from `peft_config` (no-op when None). See `prepare_peft_model`."""
        if peft_config is None:
            return model
        from .utils import prepare_peft_model

        return prepare_peft_model(model, peft_config, args)

    @staticmethod
    def _is_peft_model(model: Any) -> bool:
        return is_peft_available() and isinstance(model, PeftModel)

    @staticmethod
    def _check_train_dataset(train_dataset: Any, trainer_name: str) -> None:
        if train_dataset is None:
            raise ValueError(
                f"{trainer_name} needs a `train_dataset`; got None. Pass a datasets.Dataset or IterableDataset."
            )

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
                "`ref_model` is the same object as `model`. Pass a separate copy as ref_model, or leave it None to "
                "let the trainer create a frozen copy (or use the adapter-disabled model with PEFT)."
            )
        if isinstance(ref_model, str):
            ref_model = cls._load_model(ref_model, args)
        if ref_model is not None:
            return cls._freeze(ref_model)
        if not needed or cls._is_peft_model(policy):
            return None
        if isinstance(model, str):
            from .utils import create_model_from_path

            init_kwargs = dict(getattr(args, "model_init_kwargs", None) or {})
            init_kwargs["dtype"] = policy.dtype
            attn = getattr(policy.config, "_attn_implementation", None)
            if attn is not None:
                init_kwargs.setdefault("attn_implementation", attn)
            init_kwargs.pop("quantization_config", None)
            if getattr(args, "trust_remote_code", False):
                init_kwargs.setdefault("trust_remote_code", True)
            return cls._freeze(create_model_from_path(model, **init_kwargs))
        from ..models.utils import _create_reference_model

        return _create_reference_model(policy)

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
            from ..models.utils import prepare_deepspeed

            return prepare_deepspeed(ref_model, self.accelerator)
        if self.is_fsdp_enabled:
            from ..models.utils import prepare_fsdp

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
        from .callbacks import SyncRefModelCallback

        self.add_callback(SyncRefModelCallback(ref_model=ref_model, accelerator=self.accelerator))

    @contextlib.contextmanager
    def _reference_context(self, model: nn.Module, ref_model: nn.Module | None, ref_adapter_name: str | None = None):
        """Yield the module that computes reference outputs, in no-grad mode.

        With a separate reference model, that model. With a PEFT policy, the policy itself with the adapter named
        `ref_adapter_name` active, or with all adapters disabled when it is None.
        """
        with torch.no_grad():
            if ref_model is not None:
                yield ref_model
                return
            unwrapped = self.accelerator.unwrap_model(model)
            if not self._is_peft_model(unwrapped):
                raise ValueError("No reference model is available: pass ref_model, or use a PEFT policy.")
            from .utils import use_adapter

            with use_adapter(unwrapped, ref_adapter_name):
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

    def _record_sum_metric(self, name: str, value: "torch.Tensor | float", mode: str | None = None) -> None:
        """Store a metric summed across processes (counts such as `num_tokens`)."""
        mode = mode or self._mode
        if torch.is_tensor(value):
            value = value.detach().float().reshape(1).to(self.accelerator.device)
            value = self.accelerator.gather(value).sum().item()
        self._metrics[mode][name].append(float(value))

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        if not hasattr(self, "_metrics"):
            self._init_metrics()
        metrics = {}
        for key, values in self._metrics[mode].items():
            finite = [v for v in values if v == v]  # drop NaN entries (e.g. metrics undefined for a batch)
            metrics[key] = sum(finite) / len(finite) if finite else float("nan")
        if mode == "eval":
            metrics = {f"eval_{key}": value for key, value in metrics.items()}
        logs = {**logs, **metrics}
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
    def _save_checkpoint(self, model, trial):
        if self.args.hub_model_id is None:
            model_name = os.path.basename(os.path.normpath(self.args.output_dir))
        else:
            model_name = self.args.hub_model_id.split("/")[-1]
        self.create_model_card(model_name=model_name)
        super()._save_checkpoint(model, trial)

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
        from .utils import generate_model_card, get_comet_experiment_url, get_trackio_space_url

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

    # ------------------------------------------------------------------------------------------------------------
    # Chat template from `args.chat_template_path` (SFT, Reward, ...)
    # ------------------------------------------------------------------------------------------------------------
    @staticmethod
    def _apply_chat_template_path(model: Any, processing_class: Any, path: str) -> tuple[Any, Any, list[int]]:
        """Set the chat template named by a trainer's `chat_template_path` option.

        A `.jinja`/`.j2` file is read and used as the template as is. Anything else is taken as a tokenizer directory
        or id whose template is cloned with `clone_chat_template`, which may add tokens to the tokenizer and resize
        the model's embeddings.

        Args:
            model: The model (its embeddings may be resized).
            processing_class: Tokenizer or processor receiving the template.
            path: A template file or a tokenizer directory / id.

        Returns:
            `(model, processing_class, added_token_ids)`; `added_token_ids` is empty for a template file.
        """
        tokenizer = getattr(processing_class, "tokenizer", processing_class)
        if os.path.isfile(path) and path.endswith((".jinja", ".j2")):
            with open(path) as f:
                tokenizer.chat_template = f.read()
            if tokenizer is not processing_class:
                processing_class.chat_template = tokenizer.chat_template
            return model, processing_class, []
        if os.path.isfile(path):
            raise ValueError(
                f"chat_template_path={path!r} is a file but not a .jinja/.j2 template. Give a template file or a "
                "tokenizer directory whose chat template should be copied."
            )
        from ..chat_template_utils import clone_chat_template

        model, tokenizer, added_tokens = clone_chat_template(model, tokenizer, path)
        return model, tokenizer, added_tokens

    # ------------------------------------------------------------------------------------------------------------
    # Offline preference trainers (DPO, KTO, BCO, ...): MoE loss, adapters, batch layout, reference log-probs
    # computed on the fly or once before training, and batch metrics gathered in one collective
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

    @staticmethod
    def _choose_layout(model: nn.Module | None, padding_free: bool, warn: bool = False) -> str:
        """Batch layout of a forward pass: `padding_free` (one row), `packed` (short rows) or `padded`.

        See `trl.trainer.utils.compute_sequence_token_logps`. Packing is used whenever the model's attention can keep
        packed sequences apart; `padding_free=True` asks for a single row (a warning falls back to padded batches
        when the attention cannot handle it).
        """
        from .utils import packed_attention_kind

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
        if padding_free or kind == "varlen":
            return "padding_free"
        return "packed"

    @contextlib.contextmanager
    def _reference_module(self, model: nn.Module, ref_adapter_name: str | None = None):
        """Yield the module that computes reference log-probs for a batch, under no_grad.

        While reference log-probs are being precomputed without a separate reference model
        (`self._policy_is_reference`), the untrained policy itself; otherwise `_reference_context` (the reference
        model, or the PEFT policy with its adapters disabled / `ref_adapter_name` active). When the reference model
        was released after precomputation and the batch carries no precomputed values, a clear error.
        """
        with torch.no_grad():
            ref_model = getattr(self, "ref_model", None)
            if ref_model is None and getattr(self, "_policy_is_reference", False):
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

    def _precompute_reference_columns(
        self,
        compute_fn: Any,
        columns: tuple[str, ...],
        batch_size: int | None = None,
        eval_batch_size: int | None = None,
    ) -> None:
        """Score the train and eval datasets with the reference once, store the values as columns, drop the ref model.

        Args:
            compute_fn: `f(model, batch) -> {column: (n,) tensor}` computing the reference values of a collated batch
                (it receives the policy, which serves as the reference while `self._policy_is_reference` is set).
            columns: Names of the columns `compute_fn` returns; datasets that already have them are left as they are.
            batch_size: Examples per pre-pass batch for the train dataset (default: `per_device_train_batch_size`).
            eval_batch_size: Same for evaluation datasets (default: `per_device_eval_batch_size`).
        """
        import gc

        from datasets import Dataset

        from .utils import precompute_reference_logps

        args = self.args
        was_training = self.model.training
        self.model.eval()
        self._policy_is_reference = getattr(self, "ref_model", None) is None
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
        self.ref_model = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

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
            num_tokens: Tokens of this batch; in training they are added to the running `num_tokens` metric.
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
        if num_tokens is not None and mode == "train":
            self._total_train_tokens = getattr(self, "_total_train_tokens", 0) + int(summed[index])
            self._metrics[mode]["num_tokens"] = [float(self._total_train_tokens)]


# ----------------------------------------------------------------------------------------------------------------
# Offline preference trainers (DPO, KTO, experimental BCO): the construction steps, dataset checks, log-prob pass
# and train / evaluation steps they have in common
# ----------------------------------------------------------------------------------------------------------------
class _PreferenceTrainer(_BaseTrainer):
    """Private base of the trainers that learn from fixed preference data against a reference model.

    [`DPOTrainer`], [`KTOTrainer`] and the experimental `BCOTrainer` build themselves in the same order: checks of the
    options, the model, a tokenizer with a pad token, PEFT adapters, a reference model (unless the reference
    log-probs are precomputed on a single device), the collator and datasets, `Trainer.__init__`, then the reference
    prepared for the trainer's engine. The helpers of each step live here; a subclass keeps only what is its own.

    A subclass sets `pad_token_id` and `_layout` (and `_ref_layout`) before using [`_token_logps`], implements
    `compute_loss(..., return_outputs=True)` and [`_prediction_logits_and_labels`] for evaluation.
    """

    # ------------------------------------------------------------------------------------------------------------
    # Construction
    # ------------------------------------------------------------------------------------------------------------
    @staticmethod
    def _check_reference_options(args: TrainingArguments, trainer_name: str) -> None:
        """Reject options that cannot be combined, before anything is loaded."""
        if getattr(args, "sync_ref_model", False) and getattr(args, "precompute_ref_log_probs", False):
            raise ValueError(
                "sync_ref_model=True updates the reference model during training, but precompute_ref_log_probs=True "
                "fixes the reference log-probs before training (and drops the reference model). Use one of the two."
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
        if self._is_peft_model(model) and peft_config is not None:
            raise ValueError(
                "You passed a PeftModel together with a peft_config. Pass either a base model with peft_config, or "
                "the PeftModel alone."
            )
        will_be_peft = self._is_peft_model(model) or peft_config is not None
        if getattr(args, "sync_ref_model", False) and will_be_peft and ref_model is None:
            raise ValueError(
                "sync_ref_model=True needs a separate reference model, but with PEFT and ref_model=None the reference "
                "is the model with its adapters disabled, which cannot be blended. Pass a ref_model or set "
                "sync_ref_model=False."
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

    def _build_preference_ref_model(
        self, model_arg: Any, model: nn.Module, ref_model: Any, args: Any, needed: bool = True
    ) -> nn.Module | None:
        """The reference model (see `_build_ref_model`), with dropout disabled in it and in the policy when asked.

        With precomputed reference log-probs the untrained policy scores the data itself, so no copy is made, except
        under DeepSpeed / FSDP, where the policy is sharded later and a prepared reference is simpler.
        """
        from .utils import disable_dropout_in_model, uses_sharding_engine

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

        from ..data_utils import get_dataset_column_names

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
        from .utils import logits_statistics

        return logits_statistics(logits, targets)

    def _token_logps(self, model: nn.Module, inputs: dict[str, torch.Tensor], layout: str, with_stats: bool):
        """Per-token log-probs of the completion tokens of `inputs` (see `compute_sequence_token_logps`)."""
        from .utils import compute_sequence_token_logps

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
            loss, outputs = self.compute_loss(model, inputs, return_outputs=True)
        loss = loss.detach()
        if prediction_loss_only:
            return loss, None, None
        return (loss, *self._prediction_logits_and_labels(outputs))

    def _prediction_logits_and_labels(self, outputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Predictions and labels handed to `compute_metrics`, from the outputs of `compute_loss`."""
        raise NotImplementedError
