"""Configuration fields shared by the online (generate-then-score) trainers: GRPO, RLOO and the ones built on them.

`_OnlineConfig` holds everything about sampling prompts, generating completions (transformers or vLLM), calling
reward functions and logging completions. Method-specific fields (`beta`, loss options, ...) live in the subclasses.
The generation-batch arithmetic is in [`resolve_generation_batch`] so that other online configs can reuse it.
"""

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any

from .._compat import CONTINUOUS_BATCHING_REQUIREMENT, require_transformers_attribute
from .base_config import _BaseConfig, warn_trl_trains_anyway


_VLLM_MODES = ("colocate", "server")
_VLLM_MODEL_IMPLS = ("vllm", "transformers")


def _check_choice(name: str, value: Any, allowed: tuple, trl_message: str = "") -> None:
    """Raise a ValueError when `value` is not in `allowed`; `trl_message` (TRL's sentence for it) comes first."""
    if value not in allowed:
        prefix = f"{trl_message} " if trl_message else ""
        raise ValueError(f"{prefix}{name} must be one of {list(allowed)}; got {value!r}.")


def _method_name(args: Any) -> str:
    """The method a config belongs to as TRL's messages name it ("GRPO" for `GRPOConfig` and its subclasses)."""
    for cls in type(args).__mro__:
        if cls.__name__ in ("GRPOConfig", "RLOOConfig"):
            return cls.__name__.removesuffix("Config")
    return type(args).__name__.removesuffix("Config")


def check_sampling_temperature(temperature: float) -> None:
    """Refuse a sampling temperature <= 0 with the message transformers' generation gives (TRL's text for it).

    Args:
        temperature: The configured sampling temperature.

    Raises:
        ValueError: When `temperature <= 0` (the logits are divided by it).
    """
    if temperature <= 0:
        raise ValueError(
            f"`temperature` (={temperature}) has to be a strictly positive float, otherwise your next token scores "
            "will be invalid. If you're looking for greedy decoding strategies, set `do_sample=False`. The trainer "
            f"always samples, so temperature must be > 0; got {temperature}."
        )


def resolve_generation_batch(args: Any, min_generations: int = 2) -> None:
    """Derive `generation_batch_size` / `steps_per_generation` on `args` and check them against `num_generations`.

    Rules (as in TRL): when neither is set, `steps_per_generation = gradient_accumulation_steps` and
    `generation_batch_size = per_device_train_batch_size * world_size * steps_per_generation`; when only one is set
    the other follows (`generation_batch_size` must then be divisible by the global micro-batch size); setting both is
    an error. `generation_batch_size` must be a multiple of `num_generations`, `num_generations` must be at least 2,
    and with evaluation on, the global eval batch must be a multiple of the eval group size.

    Args:
        args: A config with the fields above (`GRPOConfig`, `RLOOConfig`, ...), after `TrainingArguments.__post_init__`.
        min_generations: Smallest accepted `num_generations` (self-distillation methods accept 1).
    """
    num_processes = args.world_size
    global_micro_batch = args.per_device_train_batch_size * num_processes

    if args.generation_batch_size is None and args.steps_per_generation is None:
        args.steps_per_generation = args.gradient_accumulation_steps
        args.generation_batch_size = global_micro_batch * args.steps_per_generation
    elif args.generation_batch_size is not None and args.steps_per_generation is None:
        if args.generation_batch_size % global_micro_batch != 0:
            raise ValueError(
                f"generation_batch_size ({args.generation_batch_size}) must be divisible by the global batch size "
                f"({global_micro_batch}). The global batch size is per_device_train_batch_size * num_processes = "
                f"{args.per_device_train_batch_size} * {num_processes}; pick a multiple of {global_micro_batch}."
            )
        args.steps_per_generation = args.generation_batch_size // global_micro_batch
    elif args.generation_batch_size is None and args.steps_per_generation is not None:
        if args.steps_per_generation < 1:
            raise ValueError(f"steps_per_generation must be a positive integer; got {args.steps_per_generation}.")
        args.generation_batch_size = global_micro_batch * args.steps_per_generation
    else:
        raise ValueError(
            "'generation_batch_size' and 'steps_per_generation' can not be both configured at the same time (one is "
            f"derived from the other); got generation_batch_size={args.generation_batch_size} and "
            f"steps_per_generation={args.steps_per_generation}. Set only one of them."
        )

    if args.num_generations is None or args.num_generations < min_generations:
        raise ValueError(
            f"{_method_name(args)} requires at least {min_generations} generations per prompt to calculate the "
            f"advantages. You provided {args.num_generations}, which is less than the minimum required. Set "
            f"num_generations >= {min_generations} (advantages compare completions of the same prompt)."
        )
    if args.generation_batch_size % args.num_generations != 0:
        raise ValueError(
            f"generation_batch_size ({args.generation_batch_size}) must be divisible by num_generations "
            f"({args.num_generations}). Every prompt needs a full group of completions: set "
            "generation_batch_size (or per_device_train_batch_size * num_processes * steps_per_generation) to a "
            f"multiple of {args.num_generations}, or change num_generations."
        )
    if args.num_generations_eval is not None and args.num_generations_eval < 0:
        raise ValueError(f"num_generations_eval must be a positive integer or None; got {args.num_generations_eval}.")
    if args.num_generations_eval == 0:
        warn_trl_trains_anyway(
            "num_generations_eval=0 is read as unset: evaluation generates num_generations completions per prompt.",
            "leave it None, or set a positive number.",
        )
    if args.eval_strategy != "no":
        eval_group = args.num_generations_eval or args.num_generations
        global_eval_batch = args.per_device_eval_batch_size * num_processes
        if global_eval_batch % eval_group != 0:
            raise ValueError(
                f"The global eval batch size ({args.per_device_eval_batch_size} * {num_processes}) must be divisible "
                f"by the number of generations used for evaluation ({eval_group}). The global eval batch size is "
                "per_device_eval_batch_size * num_processes; change per_device_eval_batch_size or "
                "num_generations_eval."
            )


@dataclass
class _RolloutFields:
    """Fields shared by every config whose trainer generates with the policy (GRPO, RLOO, distillation): model
    loading, prompts, sampling, vLLM and completion logging. A mixin placed before `_BaseConfig` in the bases, so that
    `output_dir` stays the first field and the overridden `TrainingArguments` defaults keep their positions."""

    learning_rate: float = field(default=1e-6, metadata={"help": "Initial learning rate for AdamW."})
    remove_unused_columns: bool | None = field(
        default=False,
        metadata={
            "help": "Keep the dataset columns other than `prompt`: reward functions and per-row options read them."
        },
    )

    # Model
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={"help": "Keyword arguments for `from_pretrained` when `model` is a string (dict or JSON string)."},
    )
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Allow custom modelling code from the model repository."}
    )
    disable_dropout: bool = field(
        default=False, metadata={"help": "Zero every dropout layer of the trained (and reference) model."}
    )

    # Data and generation
    max_completion_length: int | None = field(default=512, metadata={"help": "Maximum generated tokens."})
    ds3_gather_for_generation: bool = field(
        default=True,
        metadata={"help": "DeepSpeed ZeRO-3: gather the full weights for generation (faster, more memory)."},
    )
    shuffle_dataset: bool | None = field(default=True, metadata={"help": "Shuffle the training prompts."})
    pad_to_multiple_of: int | str | None = field(
        default="auto",
        metadata={"help": "Pad lengths to a multiple of this value. 'auto': 128 on Neuron devices, else None."},
    )

    # Logging
    log_completions: bool = field(
        default=False,
        metadata={"help": "Log a table of sampled prompts and completions (and rewards) at each log step."},
    )
    num_completions_to_print: int | None = field(
        default=None, metadata={"help": "Rows printed to the console. None: all."}
    )
    log_unique_prompts: bool = field(
        default=False, metadata={"help": "Show each prompt only once in the logged tables."}
    )

    # Sampling
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling probability mass, in (0, 1]."})
    top_k: int = field(default=0, metadata={"help": "Top-k filtering; 0 disables it."})
    min_p: float | None = field(
        default=None, metadata={"help": "Min-p sampling threshold relative to the top token's probability."}
    )
    generation_kwargs: dict | str | None = field(
        default=None,
        metadata={
            "help": "Extra generation arguments (GenerationConfig or vLLM SamplingParams); override the others."
        },
    )
    chat_template_kwargs: dict | str | None = field(
        default=None, metadata={"help": "Extra keyword arguments for `apply_chat_template` on prompts."}
    )
    repetition_penalty: float = field(
        default=1.0, metadata={"help": "Repetition penalty: > 1 discourages repeated tokens, < 1 encourages them."}
    )
    cache_implementation: str | None = field(
        default=None, metadata={"help": "transformers KV-cache implementation used by `generate` (not vLLM)."}
    )

    # vLLM
    use_vllm: bool = field(default=False, metadata={"help": "Generate with vLLM instead of `model.generate`."})
    vllm_mode: str = field(
        default="colocate",
        metadata={"help": "vLLM placement: inside the trainer processes or a remote server.", "choices": _VLLM_MODES},
    )
    vllm_model_impl: str = field(
        default="vllm",
        metadata={"help": "Model implementation used inside vLLM.", "choices": _VLLM_MODEL_IMPLS},
    )
    vllm_enable_sleep_mode: bool = field(
        default=False, metadata={"help": "Offload the colocated vLLM engine during the optimizer step."}
    )
    vllm_structured_outputs_regex: str | None = field(
        default=None, metadata={"help": "Regex constraining vLLM decoding; None disables it."}
    )
    vllm_server_base_url: str | None = field(
        default=None, metadata={"help": "Full URL of the vLLM server; overrides host and port."}
    )
    vllm_server_host: str = field(default="0.0.0.0", metadata={"help": "vLLM server host (server mode)."})
    vllm_server_port: int = field(default=8000, metadata={"help": "vLLM server port (server mode)."})
    vllm_server_timeout: float = field(
        default=240.0, metadata={"help": "Seconds to wait for the vLLM server before a ConnectionError."}
    )
    vllm_group_port: int = field(default=51216, metadata={"help": "Port of the weight-synchronisation group."})
    vllm_gpu_memory_utilization: float = field(
        default=0.3, metadata={"help": "Colocate mode: fraction of GPU memory given to vLLM."}
    )
    vllm_max_model_length: int | None = field(
        default=None, metadata={"help": "Colocate mode: vLLM context length. None: from the model config."}
    )
    vllm_tensor_parallel_size: int = field(
        default=1, metadata={"help": "Colocate mode: tensor-parallel size of the vLLM engine."}
    )

    def _prepare_rollout_fields(self) -> None:
        """Resolve `pad_to_multiple_of` and check `auto_find_batch_size` (called first in `__post_init__`)."""
        from .sft_config import _resolve_pad_to_multiple_of

        self.pad_to_multiple_of = _resolve_pad_to_multiple_of(self.pad_to_multiple_of)
        if not getattr(self, "auto_find_batch_size", False):
            return
        if "num_generations" in {f.name for f in dataclasses.fields(self)}:
            raise ValueError(
                f"auto_find_batch_size is not supported by {_method_name(self)}, because the generation batch must "
                "contain full prompt groups of num_generations completions, and reducing the batch size on "
                "out-of-memory breaks this invariant. Set auto_find_batch_size=False and lower "
                "per_device_train_batch_size instead."
            )
        # TRL accepts it here (no prompt groups to keep whole): warn, since a retry after out-of-memory restarts the
        # run with a smaller batch, which changes what one optimizer step sees.
        warnings.warn(
            f"auto_find_batch_size=True with {type(self).__name__}: on out-of-memory the run restarts with half the "
            "per_device_train_batch_size, so each optimizer step then sees fewer generated samples. Set "
            "per_device_train_batch_size yourself for reproducible runs.",
            UserWarning,
            stacklevel=4,
        )

    def _check_generation_fields(self) -> None:
        """Value checks of the fields above (called from `__post_init__`)."""
        _check_choice("vllm_mode", self.vllm_mode, _VLLM_MODES)
        _check_choice("vllm_model_impl", self.vllm_model_impl, _VLLM_MODEL_IMPLS)
        if self.max_completion_length is not None and self.max_completion_length < 1:
            raise ValueError(
                f"`max_new_tokens` must be greater than 0, but is {self.max_completion_length}. "
                "max_completion_length (the number of new tokens generated per completion) must be a positive integer."
            )
        check_sampling_temperature(self.temperature)
        if self.top_p <= 0.0:
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p}.")
        if self.top_p > 1.0:
            warn_trl_trains_anyway(
                f"top_p={self.top_p} is above 1, which keeps every token, as top_p=1.0 does.",
                "use a value in (0, 1] unless this is intended.",
            )
        if self.top_k < 0:
            raise ValueError(
                f"`top_k` has to be a strictly positive integer, but is {self.top_k}. Set top_k >= 1, or 0 to disable "
                "top-k filtering."
            )
        if not 0.0 < self.vllm_gpu_memory_utilization <= 1.0:
            raise ValueError(f"vllm_gpu_memory_utilization must be in (0, 1]; got {self.vllm_gpu_memory_utilization}.")
        if self.vllm_tensor_parallel_size < 1:
            raise ValueError(f"vllm_tensor_parallel_size must be >= 1; got {self.vllm_tensor_parallel_size}.")
        if self.num_completions_to_print is not None and self.num_completions_to_print < 0:
            warn_trl_trains_anyway(
                f"num_completions_to_print={self.num_completions_to_print} is negative: the completions table printed "
                "with log_completions drops that many rows from the end instead of showing a number of them.",
                "use a value >= 0 or None (all) unless this is intended.",
            )

    def _reject_context_parallelism(self) -> None:
        """Generation needs whole sequences on every process: context/sequence parallelism is refused."""
        parallelism = getattr(self, "parallelism_config", None)
        if parallelism is not None and (
            (getattr(parallelism, "cp_size", 1) or 1) > 1 or (getattr(parallelism, "sp_size", 1) or 1) > 1
        ):
            raise ValueError(
                f"Context/sequence parallelism is not supported by {type(self).__name__}; remove the cp_size/sp_size "
                "settings from parallelism_config."
            )


@dataclass
class _OnlineConfig(_RolloutFields, _BaseConfig):
    """Fields shared by online trainer configs (see the subclasses for the documentation of each field)."""

    _VALID_DICT_FIELDS = _BaseConfig._VALID_DICT_FIELDS + [
        "model_init_kwargs",
        "generation_kwargs",
        "chat_template_kwargs",
        "transformers_continuous_batching_config",
    ]

    # Model
    router_aux_loss_coef: float | None = field(
        default=None,
        metadata={"help": "Weight of the MoE load-balancing loss. None: model config value; 0.0 disables it."},
    )

    # Data and generation
    num_generations: int | None = field(
        default=8, metadata={"help": "Completions sampled per prompt (group size G). At least 2."}
    )
    num_generations_eval: int | None = field(
        default=None, metadata={"help": "Completions per prompt during evaluation. None: num_generations."}
    )
    generation_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Completions generated per round (prompts * num_generations). None: per_device_train_batch_size "
            "* num_processes * steps_per_generation. Exclusive with steps_per_generation."
        },
    )
    steps_per_generation: int | None = field(
        default=None,
        metadata={"help": "Micro-steps that consume one generation round. None: gradient_accumulation_steps."},
    )
    # Training
    num_iterations: int = field(default=1, metadata={"help": "Optimisation passes over each generated batch (mu)."})
    epsilon: float = field(default=0.2, metadata={"help": "Lower clipping epsilon of the importance ratio."})
    epsilon_high: float | None = field(
        default=None, metadata={"help": "Upper clipping epsilon of the importance ratio. None: epsilon."}
    )
    reward_weights: list[float] | None = field(
        default=None, metadata={"help": "One weight per reward function. None: all 1.0."}
    )
    mask_truncated_completions: bool = field(
        default=False, metadata={"help": "Leave completions that hit max_completion_length out of the loss."}
    )
    sync_ref_model: bool = field(
        default=False, metadata={"help": "Periodically blend the policy into the reference model (TR-DPO)."}
    )
    ref_model_mixup_alpha: float = field(
        default=0.6, metadata={"help": "Blend weight: ref <- alpha * policy + (1 - alpha) * ref."}
    )
    ref_model_sync_steps: int = field(default=512, metadata={"help": "Blend the reference every N global steps."})

    # Logging
    log_multimodal: bool = field(default=True, metadata={"help": "Include images in the completion logs."})

    # transformers continuous batching
    use_transformers_continuous_batching: bool = field(
        default=False, metadata={"help": "Generate with transformers continuous batching (`generate_batch`)."}
    )
    transformers_continuous_batching_config: dict | str | None = field(
        default=None, metadata={"help": "Keyword arguments for transformers' ContinuousBatchingConfig."}
    )
    use_transformers_paged: bool = field(
        default=False, metadata={"help": "Deprecated alias of use_transformers_continuous_batching."}
    )

    def __post_init__(self):
        self._prepare_rollout_fields()
        if self.use_transformers_paged:
            warnings.warn(
                "use_transformers_paged is deprecated; use use_transformers_continuous_batching=True instead.",
                FutureWarning,
                stacklevel=3,
            )
            self.use_transformers_continuous_batching = True
        super().__post_init__()

        self._reject_context_parallelism()
        resolve_generation_batch(self)

        # Value checks shared by every online trainer.
        self._check_generation_fields()
        if self.use_transformers_continuous_batching and not self.use_vllm:
            require_transformers_attribute(*CONTINUOUS_BATCHING_REQUIREMENT)
        if self.num_iterations < 1:
            raise ValueError(f"num_iterations must be a positive integer; got {self.num_iterations}.")
        if self.epsilon < 0 or (self.epsilon_high is not None and self.epsilon_high < 0):
            warn_trl_trains_anyway(
                f"epsilon={self.epsilon} / epsilon_high={self.epsilon_high}: a negative clipping range puts the lower "
                "clip bound of the importance ratio above the upper one.",
                "use values >= 0 unless this is intended.",
                stacklevel=3,
            )
        if self.reward_weights is not None:
            self.reward_weights = [float(w) for w in self.reward_weights]
