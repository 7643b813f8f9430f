"""Configuration fields shared by SDFT and SDPO: model loading, rollouts (transformers or vLLM) and the teacher."""

from dataclasses import dataclass, field
from typing import Any

from ...trainer.base_config import _BaseConfig
from ...trainer.online_config import resolve_generation_batch


@dataclass
class _SelfSampledRolloutConfig(_BaseConfig):
    """Fields and checks of the methods that train on the model's own samples: SDFT, SDPO and SSD (documented on
    [`SDFTConfig`] and [`SSDConfig`]): model loading and rollouts (transformers or vLLM).

    The online rollout machinery reads a few settings these methods do not expose; they are fixed as plain class
    attributes (not fields), so they never appear among the config's arguments.
    """

    _VALID_DICT_FIELDS = _BaseConfig._VALID_DICT_FIELDS + [
        "model_init_kwargs",
        "generation_kwargs",
        "chat_template_kwargs",
    ]

    # Fixed settings of the shared rollout core (not configurable for these methods).
    beta = 0.0
    log_completions = False
    log_unique_prompts = False
    num_completions_to_print = None
    pad_to_multiple_of = None
    reward_weights = None
    router_aux_loss_coef = None
    sync_ref_model = False
    use_transformers_continuous_batching = False
    transformers_continuous_batching_config = None
    use_transformers_paged = False
    vllm_importance_sampling_correction = False
    vllm_structured_outputs_regex = None
    log_multimodal = False
    mask_truncated_completions = False

    model_init_kwargs: dict[str, Any] | None = field(
        default=None, metadata={"help": "Keyword arguments for `from_pretrained` when `model` is a string."}
    )
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow custom modelling code."})
    disable_dropout: bool = field(default=True, metadata={"help": "Zero every dropout layer of the student."})
    max_prompt_length: int | None = field(
        default=512, metadata={"help": "Keep at most this many prompt tokens (the last ones)."}
    )
    max_completion_length: int | None = field(default=256, metadata={"help": "Maximum generated tokens."})
    ds3_gather_for_generation: bool = field(
        default=True, metadata={"help": "DeepSpeed ZeRO-3: gather the weights for generation."}
    )
    shuffle_dataset: bool = field(default=True, metadata={"help": "Shuffle the training prompts."})
    generation_batch_size: int | None = field(
        default=None, metadata={"help": "Completions per generation round; exclusive with steps_per_generation."}
    )
    steps_per_generation: int | None = field(
        default=None,
        metadata={"help": "Micro-steps served by one generation round; None: gradient_accumulation_steps."},
    )
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling probability mass."})
    top_k: int = field(default=0, metadata={"help": "Top-k filtering; 0 disables it."})
    min_p: float | None = field(default=None, metadata={"help": "Minimum token probability relative to the top one."})
    generation_kwargs: dict[str, Any] | None = field(
        default=None, metadata={"help": "Extra generation keyword arguments (override the ones above)."}
    )
    chat_template_kwargs: dict[str, Any] | None = field(
        default=None, metadata={"help": "Extra keyword arguments of the chat template."}
    )
    repetition_penalty: float = field(default=1.0, metadata={"help": "Repetition penalty of generation."})
    cache_implementation: str | None = field(default=None, metadata={"help": "KV cache implementation of generate."})
    use_vllm: bool = field(default=False, metadata={"help": "Generate with vLLM."})
    vllm_mode: str = field(default="colocate", metadata={"help": "'colocate' or 'server'."})
    vllm_model_impl: str = field(default="vllm", metadata={"help": "'vllm' or 'transformers'."})
    vllm_enable_sleep_mode: bool = field(default=False, metadata={"help": "Offload vLLM weights between rounds."})
    vllm_server_base_url: str | None = field(default=None, metadata={"help": "vLLM server URL (server mode)."})
    vllm_server_host: str = field(default="0.0.0.0", metadata={"help": "vLLM server host (server mode)."})
    vllm_server_port: int = field(default=8000, metadata={"help": "vLLM server port (server mode)."})
    vllm_group_port: int = field(default=51216, metadata={"help": "Port of the weight-synchronisation group."})
    vllm_server_timeout: float = field(default=240.0, metadata={"help": "Seconds to wait for the vLLM server."})
    vllm_tensor_parallel_size: int = field(default=1, metadata={"help": "Tensor parallel size (colocate mode)."})
    vllm_gpu_memory_utilization: float = field(default=0.3, metadata={"help": "GPU memory share of vLLM (colocate)."})
    vllm_max_model_length: int | None = field(default=None, metadata={"help": "vLLM context length (colocate)."})
    num_iterations: int = field(default=1, metadata={"help": "Optimisation passes over each generated batch."})

    def __post_init__(self):
        super().__post_init__()
        resolve_generation_batch(self, min_generations=1)


@dataclass
class _SelfDistillationConfig(_SelfSampledRolloutConfig):
    """Fields and checks SDFT and SDPO share (documented on [`SDFTConfig`])."""

    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Keep dataset columns other than `prompt` (the teacher context needs them)."}
    )
    num_generations: int = field(default=8, metadata={"help": "Completions sampled per prompt."})
    num_generations_eval: int | None = field(
        default=None, metadata={"help": "Completions per prompt in evaluation; None: num_generations."}
    )
    temperature: float = field(
        default=1.0, metadata={"help": "Sampling temperature (also applied to both models' logits in the loss)."}
    )
    use_teacher_server: bool = field(
        default=False,
        metadata={"help": "Score the teacher with the vLLM generation server (server mode, live teacher)."},
    )

    def __post_init__(self):
        super().__post_init__()
        if self.distillation_mode not in ("sampled_token", "full_logits", "topk_logits"):
            raise ValueError(
                "distillation_mode must be 'sampled_token', 'full_logits' or 'topk_logits'; got "
                f"{self.distillation_mode!r}."
            )
        if self.distillation_mode == "sampled_token" and self.distillation_alpha != 1.0:
            raise ValueError(
                "`distillation_mode='sampled_token'` only supports reverse KL, so it requires `distillation_alpha=1.0`"
                f", got {self.distillation_alpha}."
            )
