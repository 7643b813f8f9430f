"""Configuration of the Online DPO trainer (and of XPO and Nash-MD, which extend it)."""

import numbers
from dataclasses import dataclass, field
from typing import Any

from ...trainer.base_config import _BaseConfig
from ...trainer.online_config import check_sampling_temperature


_LOSS_TYPES = ("sigmoid", "ipo")
_VLLM_MODES = ("colocate", "server")
_VLLM_MODEL_IMPLS = ("vllm", "transformers")


def _resolve_schedule(name: str, values: Any) -> float | list[float]:
    """Validate a per-epoch schedule given as a number or a list of numbers.

    A one-element list collapses to its value (a constant schedule); longer lists are kept, one value per epoch with
    the last one reused once the list is exhausted.
    """
    if isinstance(values, numbers.Real) and not isinstance(values, bool):
        return float(values)
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"{name} must be a number or a list of numbers (one per epoch); got {values!r}.")
    if len(values) == 0:
        raise ValueError(f"{name} is an empty list; give at least one value (e.g. {name}=[0.1]).")
    for value in values:
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            raise ValueError(f"{name} must contain numbers only; got {value!r} in {list(values)!r}.")
    values = [float(value) for value in values]
    return values[0] if len(values) == 1 else values


def _schedule_values(values: float | list[float]) -> list[float]:
    return list(values) if isinstance(values, list) else [values]


@dataclass
class OnlineDPOConfig(_BaseConfig):
    r"""Configuration for [`experimental.online_dpo.OnlineDPOTrainer`]: DPO on pairs sampled from the policy during
    training and ranked by reward models, reward functions or a pairwise judge.

    Only the fields TRL adds or whose default differs from [`~transformers.TrainingArguments`] are listed here; every
    other `TrainingArguments` field works as usual. `per_device_train_batch_size` counts prompts: each prompt yields
    two completions.

    Args:
        learning_rate (`float`, defaults to `5e-07`):
            Initial learning rate for AdamW (the parent default is `5e-5`).
        remove_unused_columns (`bool`, defaults to `False`):
            Keep the dataset columns other than `prompt`: they are passed to the reward functions.
        reward_model_path (`str` or `None`, defaults to `None`):
            Path or hub id of a sequence-classification reward model, used when the trainer is given neither
            `reward_funcs` nor a judge.
        max_new_tokens (`int`, defaults to `64`):
            Maximum number of tokens generated per completion.
        max_length (`int`, defaults to `512`):
            Maximum length of prompt + completion in the log-probability passes; longer sequences lose their leftmost
            prompt tokens first.
        temperature (`float`, defaults to `0.9`):
            Sampling temperature (higher is more random). Log-probabilities are computed at temperature 1.
        top_p (`float`, defaults to `1.0`):
            Nucleus sampling: keep the smallest set of tokens whose probability mass reaches `top_p`, in (0, 1].
        top_k (`int`, defaults to `0`):
            Keep only the `top_k` most likely tokens; `0` disables the filter.
        min_p (`float` or `None`, defaults to `None`):
            Drop tokens whose probability is below `min_p` times that of the most likely token. `None` disables it.
        repetition_penalty (`float`, defaults to `1.0`):
            Penalty on tokens already present in the prompt and completion: above 1 discourages repeats, below 1
            encourages them.
        generation_kwargs (`dict` or `None`, defaults to `None`):
            Extra generation arguments (transformers `GenerationConfig` or vLLM `SamplingParams`); they override the
            named options above.
        cache_implementation (`str` or `None`, defaults to `None`):
            KV-cache implementation of transformers `generate` (not used by vLLM).
        missing_eos_penalty (`float` or `None`, defaults to `None`):
            Subtracted from the score of every completion that ends without an end-of-sequence token (it hit
            `max_new_tokens`), which pushes the model towards finishing its answers. Give a positive value. Applies
            to reward scores, not to judge verdicts.
        beta (`float` or `list[float]`, defaults to `[0.1]`):
            Strength of the implicit KL penalty towards the reference model (tau for IPO). A list gives one value per
            epoch, the last one being reused afterwards; a one-element list becomes that number.
        loss_type (`str`, defaults to `"sigmoid"`):
            `"sigmoid"` (DPO) or `"ipo"` (IPO), both on log-probabilities summed over the completion tokens.
        disable_dropout (`bool`, defaults to `True`):
            Set every dropout probability of the trained model (and of the reference model) to zero.
        use_vllm (`bool`, defaults to `False`):
            Generate the policy's completions with vLLM instead of transformers `generate` (needs `vllm`).
        vllm_model_impl (`str`, defaults to `"vllm"`):
            Model implementation inside vLLM: `"vllm"` or `"transformers"`.
        vllm_structured_outputs_regex (`str` or `None`, defaults to `None`):
            Regular expression constraining vLLM decoding; `None` disables it.
        vllm_gpu_memory_utilization (`float` or `None`, defaults to `0.55`):
            Colocate mode: fraction of the GPU memory given to vLLM.
        vllm_mode (`str`, defaults to `"colocate"`):
            `"colocate"` runs vLLM inside the training processes; `"server"` talks to a separate server (for example
            `trl vllm-serve`).
        vllm_server_base_url (`str` or `None`, defaults to `None`):
            Full URL of the vLLM server (server mode); overrides host and port.
        vllm_server_host (`str`, defaults to `"0.0.0.0"`):
            Host of the vLLM server (server mode).
        vllm_server_port (`int`, defaults to `8000`):
            Port of the vLLM server (server mode).
        vllm_server_timeout (`float`, defaults to `240.0`):
            Seconds to wait for the vLLM server to come up before raising a `ConnectionError`.
        vllm_group_port (`int`, defaults to `51216`):
            Port of the weight-synchronisation group between trainer and server.
        vllm_tensor_parallel_size (`int`, defaults to `1`):
            Colocate mode: tensor-parallel size of the vLLM engine.
        vllm_enable_sleep_mode (`bool`, defaults to `False`):
            Colocate mode: put the vLLM engine to sleep (offloading its memory) outside generation.
        ds3_gather_for_generation (`bool`, defaults to `True`):
            DeepSpeed ZeRO-3: gather the full weights for generation (fast, needs memory for the whole model). `False`
            allows models larger than one device, at a much lower generation speed (not with vLLM).
        model_init_kwargs (`dict[str, Any]`, `str` or `None`, defaults to `None`):
            Keyword arguments for `from_pretrained` when `model` (or `ref_model`, or a reward model) is a string (a
            dict, or a JSON string on the command line). Its `revision` is reused to load the processing class.
        trust_remote_code (`bool`, defaults to `False`):
            Allow custom modelling code from the model repository when the trainer loads models or processors.
        reward_weights (`list[float]` or `None`, defaults to `None`):
            One weight per reward function; the score of a completion is the weighted sum of its rewards. `None`
            weighs every function 1.0.
    """

    _VALID_DICT_FIELDS = _BaseConfig._VALID_DICT_FIELDS + ["model_init_kwargs", "generation_kwargs"]

    learning_rate: float = field(default=5e-7, metadata={"help": "Initial learning rate for AdamW."})
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Keep extra dataset columns: they are passed to the reward functions."}
    )
    reward_model_path: str | None = field(
        default=None,
        metadata={"help": "Reward model (path or hub id) used when neither reward_funcs nor a judge is given."},
    )
    max_new_tokens: int = field(default=64, metadata={"help": "Maximum number of tokens generated per completion."})
    max_length: int = field(
        default=512,
        metadata={"help": "Maximum prompt + completion length in the log-prob passes (left tokens dropped first)."},
    )
    temperature: float = field(default=0.9, metadata={"help": "Sampling temperature."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling probability mass, in (0, 1]."})
    top_k: int = field(default=0, metadata={"help": "Top-k filtering; 0 disables it."})
    min_p: float | None = field(
        default=None, metadata={"help": "Min-p sampling threshold relative to the top token's probability."}
    )
    repetition_penalty: float = field(
        default=1.0, metadata={"help": "Repetition penalty: > 1 discourages repeated tokens, < 1 encourages them."}
    )
    generation_kwargs: dict | None = field(
        default=None,
        metadata={
            "help": "Extra generation arguments (GenerationConfig or vLLM SamplingParams); override the others."
        },
    )
    cache_implementation: str | None = field(
        default=None, metadata={"help": "transformers KV-cache implementation used by `generate` (not vLLM)."}
    )
    missing_eos_penalty: float | None = field(
        default=None,
        metadata={"help": "Subtracted from the score of completions without an EOS token (a positive value)."},
    )
    beta: list[float] = field(
        default_factory=lambda: [0.1],
        metadata={"help": "KL strength (IPO tau). Several values: one per epoch, the last one reused."},
    )
    loss_type: str = field(
        default="sigmoid", metadata={"help": "Preference loss: sigmoid (DPO) or ipo.", "choices": list(_LOSS_TYPES)}
    )
    disable_dropout: bool = field(
        default=True, metadata={"help": "Disable dropout in the trained model and the reference model."}
    )
    use_vllm: bool = field(default=False, metadata={"help": "Generate with vLLM instead of `model.generate`."})
    vllm_model_impl: str = field(
        default="vllm",
        metadata={"help": "Model implementation used inside vLLM.", "choices": list(_VLLM_MODEL_IMPLS)},
    )
    vllm_structured_outputs_regex: str | None = field(
        default=None, metadata={"help": "Regex constraining vLLM decoding; None disables it."}
    )
    vllm_gpu_memory_utilization: float | None = field(
        default=0.55, metadata={"help": "Colocate mode: fraction of GPU memory given to vLLM."}
    )
    vllm_mode: str = field(
        default="colocate",
        metadata={
            "help": "vLLM placement: inside the trainer processes or a remote server.",
            "choices": list(_VLLM_MODES),
        },
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
    vllm_tensor_parallel_size: int = field(
        default=1, metadata={"help": "Colocate mode: tensor-parallel size of the vLLM engine."}
    )
    vllm_enable_sleep_mode: bool = field(
        default=False, metadata={"help": "Offload the colocated vLLM engine outside generation."}
    )
    ds3_gather_for_generation: bool = field(
        default=True,
        metadata={"help": "DeepSpeed ZeRO-3: gather the full weights for generation (faster, more memory)."},
    )
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={"help": "Keyword arguments for `from_pretrained` when `model` is a string (dict or JSON string)."},
    )
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Allow custom modelling code from the model repository."}
    )
    reward_weights: list[float] | None = field(
        default=None, metadata={"help": "One weight per reward function. None: all 1.0."}
    )

    def __post_init__(self):
        self.beta = _resolve_schedule("beta", self.beta)
        if self.loss_type not in _LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {list(_LOSS_TYPES)}; got {self.loss_type!r}.")
        if self.loss_type == "ipo" and any(value <= 0 for value in _schedule_values(self.beta)):
            raise ValueError(f"loss_type='ipo' divides by beta, so every beta must be > 0; got {self.beta}.")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer; got {self.max_new_tokens}.")
        if self.max_length < 2:
            raise ValueError(
                f"max_length must be at least 2 (a prompt token and a completion token); got {self.max_length}."
            )
        check_sampling_temperature(self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p}.")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it); got {self.top_k}.")
        if self.vllm_mode not in _VLLM_MODES:
            raise ValueError(f"vllm_mode must be one of {list(_VLLM_MODES)}; got {self.vllm_mode!r}.")
        if self.vllm_model_impl not in _VLLM_MODEL_IMPLS:
            raise ValueError(
                f"vllm_model_impl must be one of {list(_VLLM_MODEL_IMPLS)}; got {self.vllm_model_impl!r}."
            )
        if self.reward_weights is not None:
            self.reward_weights = [float(weight) for weight in self.reward_weights]
        super().__post_init__()
