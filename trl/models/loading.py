"""Loading pretrained models the way the trainers do: class, dtype and device-map defaults for `from_pretrained`,
and the bitsandbytes quantization config and device map of k-bit models."""

from typing import Any

import torch
from accelerate import PartialState
from accelerate.utils import DistributedType
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

from .._local_paths import check_local_path


_DTYPE_NAMES = ("auto", "bfloat16", "float16", "float32")


def _resolve_dtype(dtype: Any) -> Any:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        if dtype == "auto":
            return "auto"
        if dtype in _DTYPE_NAMES:
            return getattr(torch, dtype)
    raise ValueError(
        f"Invalid `dtype` {dtype!r}: expected a torch.dtype or one of the strings {list(_DTYPE_NAMES)}. Pass for "
        "example dtype='bfloat16' in `model_init_kwargs`."
    )


def create_model_from_path(model_id: str, architecture: Any = None, **kwargs) -> PreTrainedModel:
    """Load a pretrained model from a hub id or a local directory with the defaults the trainers use.

    The class is `architecture` when given, else the class named in `config.architectures[0]`; for custom code not in
    transformers, `AutoModelForImageTextToText` when the config's `auto_map` has it, else `AutoModelForCausalLM`.
    `dtype` defaults to float32 (the strings `"bfloat16"`, `"float16"`, `"float32"` and `"auto"` are accepted).
    `device_map` defaults to `"auto"` when a GPU is available and to None otherwise, and is forced to None in
    multi-GPU (DDP) and DeepSpeed runs, where accelerate places the model.

    Args:
        model_id: Hub id or local path.
        architecture: Model class (or auto class) to load with; inferred from the config when None.
        **kwargs: Passed to `from_pretrained` (for example `dtype`, `revision`, `attn_implementation`).

    Returns:
        The loaded model.
    """
    import transformers

    check_local_path(model_id)
    kwargs = dict(kwargs)
    if "torch_dtype" in kwargs and "dtype" not in kwargs:  # older spelling
        kwargs["dtype"] = kwargs.pop("torch_dtype")
    kwargs["dtype"] = _resolve_dtype(kwargs.get("dtype"))

    if "device_map" not in kwargs:
        kwargs["device_map"] = "auto" if torch.cuda.is_available() else None
    distributed_type = PartialState().distributed_type
    if distributed_type in (DistributedType.MULTI_GPU, DistributedType.DEEPSPEED):
        kwargs["device_map"] = None

    if architecture is None:
        config = AutoConfig.from_pretrained(
            model_id,
            revision=kwargs.get("revision"),
            trust_remote_code=kwargs.get("trust_remote_code", False),
        )
        names = getattr(config, "architectures", None) or []
        architecture = getattr(transformers, names[0], None) if names else None
        if architecture is None:
            auto_map = getattr(config, "auto_map", None) or {}
            if "AutoModelForImageTextToText" in auto_map:
                architecture = transformers.AutoModelForImageTextToText
            else:
                architecture = transformers.AutoModelForCausalLM
    return architecture.from_pretrained(model_id, **kwargs)


def get_config_model_id(config: PretrainedConfig) -> str:
    """Model id or path a config was loaded from (its `_name_or_path`)."""
    return getattr(config, "_name_or_path", "")


def get_quantization_config(model_args: Any):
    """Build a `transformers.BitsAndBytesConfig` from a [`ModelConfig`], or None without 4/8-bit loading.

    Args:
        model_args: Object with `load_in_4bit`, `load_in_8bit`, `dtype`, `bnb_4bit_quant_type`,
            `use_bnb_nested_quant` and `bnb_4bit_quant_storage`.

    Returns:
        `BitsAndBytesConfig | None`.
    """
    from transformers import BitsAndBytesConfig

    if model_args.load_in_4bit:
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_compute_dtype=model_args.dtype,
            bnb_4bit_quant_type=model_args.bnb_4bit_quant_type,
            bnb_4bit_use_double_quant=model_args.use_bnb_nested_quant,
            bnb_4bit_quant_storage=model_args.bnb_4bit_quant_storage,
        )
    if model_args.load_in_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    return None


def get_kbit_device_map() -> dict[str, int] | None:
    """Device map that puts a quantized model entirely on this process's accelerator, or None without one."""
    cuda = torch.cuda.is_available()
    xpu = hasattr(torch, "xpu") and torch.xpu.is_available()
    if cuda or xpu:
        return {"": PartialState().local_process_index}
    return None
