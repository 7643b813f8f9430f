"""PEFT preparation of the trained model: the LoRA config from `ModelConfig`, wrapping a model with an adapter (k-bit
preparation, gradient checkpointing, bf16 casting) and switching the active adapter."""

import warnings
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn
from transformers import PreTrainedModel

from .._compat import enable_activation_checkpointing
from ..import_utils import is_peft_available
from .utils import _is_deepspeed_zero3


def get_peft_config(model_args: Any):
    """Build a `peft.LoraConfig` from a [`ModelConfig`], or return None when `use_peft` is off.

    Args:
        model_args: Object with the LoRA fields of [`ModelConfig`] (`use_peft`, `lora_r`, `lora_alpha`, ...).

    Returns:
        `peft.LoraConfig | None`.
    """
    if not model_args.use_peft:
        return None
    if not is_peft_available():
        raise ValueError(
            "`use_peft=True` needs the PEFT library, which is not installed. Install it with `pip install trl[peft]`."
        )
    from peft import LoraConfig

    kwargs = dict(
        task_type=model_args.lora_task_type,
        r=model_args.lora_r,
        target_modules=model_args.lora_target_modules,
        lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout,
        bias="none",
        use_rslora=model_args.use_rslora,
        use_dora=model_args.use_dora,
        modules_to_save=model_args.lora_modules_to_save,
    )
    target_parameters = getattr(model_args, "lora_target_parameters", None)
    if target_parameters is not None:
        kwargs["target_parameters"] = target_parameters
    return LoraConfig(**kwargs)


def _is_kbit_model(model: nn.Module) -> bool:
    return bool(getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False))


def enable_gradient_checkpointing(model: nn.Module, gradient_checkpointing_kwargs: dict | None = None) -> None:
    """Turn on gradient (activation) checkpointing and make the embedding outputs require grad.

    The latter is what lets gradients reach adapters placed after frozen layers when checkpointing is on.

    Args:
        model: A transformers model (or a wrapper forwarding the checkpointing methods).
        gradient_checkpointing_kwargs: Extra arguments for `torch.utils.checkpoint.checkpoint`.
    """
    enable_activation_checkpointing(model, gradient_checkpointing_kwargs)
    if hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()


def peft_module_casting_to_bf16(model: nn.Module) -> None:
    """Cast a PEFT model for bf16 training on a quantized base: adapters and fp32 embeddings/heads to bf16, norms
    to fp32 (in place)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in model.named_modules():
        if isinstance(module, BaseTunerLayer):
            module.to(torch.bfloat16)
        elif isinstance(module, nn.LayerNorm) or "norm" in name.split(".")[-1].lower():
            module.to(torch.float32)
        elif any(key in name for key in ("lm_head", "embed_tokens", "wte", "wpe")):
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.Tensor) and weight.dtype == torch.float32:
                module.to(torch.bfloat16)


# How a trainer sets up adapters on a bitsandbytes-quantized (4- or 8-bit) base, as TRL 1.16's trainer of the same
# name does (observed: the dtypes of the frozen and trainable parameters after construction):
# - `KBIT_PREPARED`: peft's `prepare_model_for_kbit_training` first (frozen floating-point parameters to fp32); with
#   `bf16` and a 4-bit base, embeddings and heads are then cast to bf16 before the adapters are added (CPO, ORPO, BCO,
#   and the trainers not observed yet);
# - `AS_LOADED`: the base as loaded, fp32 adapters (Online DPO, XPO, Nash-MD, TPO, SDFT, SDPO, IW-OPD);
# - `BF16_ADAPTERS`: the base as loaded, every trainable parameter cast to bf16 whatever `bf16` says, also for a
#   `PeftModel` passed in (SFT, DPO, KTO, Reward, GRPO, RLOO, Distillation, GKD, GOLD).
KBIT_PREPARED, AS_LOADED, BF16_ADAPTERS = "kbit_prepared", "as_loaded", "bf16_adapters"


def is_quantized_peft_model(model: nn.Module) -> bool:
    """Whether `model` is a PEFT model on a bitsandbytes 4- or 8-bit base."""
    if not is_peft_available():
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel) and _is_kbit_model(model)


# The adapter that holds a copy of a passed-in `PeftModel`'s adapter, as the reference (see `add_reference_adapter`).
REFERENCE_ADAPTER = "ref"


def add_reference_adapter(model: nn.Module) -> str:
    """Copy the active adapter of the PEFT `model` into a frozen adapter named `REFERENCE_ADAPTER`, and return that
    name. TRL's preference and online trainers take a `PeftModel` passed in (its adapter maybe trained already, by SFT
    for instance) as its own reference with that adapter as it was when training started, rather than with the
    adapters disabled; the active adapter stays the trained one."""
    import copy

    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    active = model.active_adapter
    state = get_peft_model_state_dict(model, adapter_name=active)
    model.add_adapter(REFERENCE_ADAPTER, copy.deepcopy(model.peft_config[active]))
    set_peft_model_state_dict(model, state, adapter_name=REFERENCE_ADAPTER)
    model.set_adapter(active)
    for name, parameter in model.named_parameters():
        if f".{REFERENCE_ADAPTER}." in name:
            parameter.requires_grad_(False)
    return REFERENCE_ADAPTER


def cast_trainable_parameters_to_bf16(model: nn.Module) -> None:
    """Cast every trainable parameter of `model` (adapters, `modules_to_save` copies) to bf16, in place."""
    for parameter in model.parameters():
        if parameter.requires_grad and parameter.dtype != torch.bfloat16:
            parameter.data = parameter.data.to(torch.bfloat16)


def prepare_peft_model(
    model: PreTrainedModel, peft_config: Any, args: Any, quantized_base: str = KBIT_PREPARED
) -> nn.Module:
    """Wrap `model` with LoRA (or another PEFT method) the way every trainer does.

    Steps: validate inputs; a quantized (bitsandbytes) base is set up as `quantized_base` says (see
    `KBIT_PREPARED`, `AS_LOADED`, `BF16_ADAPTERS`); otherwise, with `args.gradient_checkpointing`, checkpointing is
    enabled and the embedding outputs are made to require grad (needed for adapters + checkpointing to train); the
    model is wrapped with `peft.get_peft_model` (adapter dtype autocast disabled under ZeRO-3).

    Args:
        model: Model to wrap.
        peft_config: A `peft.PeftConfig`; None returns `model` unchanged.
        args: Training arguments (`gradient_checkpointing`, `gradient_checkpointing_kwargs` and `bf16` are read).
        quantized_base: How a bitsandbytes 4- or 8-bit base is set up: `"kbit_prepared"` (default, the behaviour of
            `trl.experimental.utils.prepare_peft_model`), `"as_loaded"` or `"bf16_adapters"`.

    Returns:
        The `peft.PeftModel`.
    """
    if peft_config is None:
        return model
    if not is_peft_available():
        raise ImportError(
            "Training with a `peft_config` needs the PEFT library, which is not installed. Install it with "
            "`pip install trl[peft]`."
        )
    from peft import PeftConfig, PeftModel, get_peft_model, prepare_model_for_kbit_training

    if quantized_base not in (KBIT_PREPARED, AS_LOADED, BF16_ADAPTERS):
        raise ValueError(
            f"quantized_base must be one of {KBIT_PREPARED!r}, {AS_LOADED!r} or {BF16_ADAPTERS!r}, got "
            f"{quantized_base!r}."
        )
    if not isinstance(peft_config, PeftConfig):
        raise TypeError(
            f"`peft_config` must be a `peft.PeftConfig` (for example `peft.LoraConfig`), got "
            f"{type(peft_config).__name__}."
        )
    if isinstance(model, PeftModel):
        raise ValueError(
            "The model is already a `PeftModel` and a `peft_config` was also given. Pass either the base model with "
            "a `peft_config`, or the `PeftModel` without one."
        )

    gradient_checkpointing = bool(getattr(args, "gradient_checkpointing", False))
    if gradient_checkpointing and str(getattr(peft_config.peft_type, "value", "")) in ("PREFIX_TUNING", "CARTRIDGE"):
        # The prefix lives in the attention cache, which checkpointed layers cannot use (peft refuses the pair).
        warnings.warn(
            f"{peft_config.peft_type.value} does not work with gradient checkpointing; it is disabled.", stacklevel=3
        )
        gradient_checkpointing = False
        for name in ("gradient_checkpointing", "activation_checkpointing"):  # transformers 5 reads the latter
            if hasattr(args, name):
                setattr(args, name, False)
    gc_kwargs = dict(getattr(args, "gradient_checkpointing_kwargs", None) or {})
    zero3 = _is_deepspeed_zero3()
    if gradient_checkpointing and zero3:
        # Non-reentrant checkpointing does not see the parameters DeepSpeed gathers lazily.
        gc_kwargs["use_reentrant"] = True

    quantized = _is_kbit_model(model)
    if quantized and quantized_base == KBIT_PREPARED:
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=gradient_checkpointing, gradient_checkpointing_kwargs=gc_kwargs or None
        )
        if gradient_checkpointing and hasattr(model, "enable_input_require_grads"):
            model.enable_input_require_grads()
        if getattr(model, "is_loaded_in_4bit", False) and getattr(args, "bf16", False):
            peft_module_casting_to_bf16(model)  # before the adapters exist: they stay in fp32
    elif gradient_checkpointing:
        enable_gradient_checkpointing(model, gc_kwargs or None)

    with warnings.catch_warnings():
        # peft reads the attribute transformers renamed; the deprecation is not actionable for users.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        model = get_peft_model(model, peft_config, autocast_adapter_dtype=not zero3)

    if quantized and quantized_base == BF16_ADAPTERS:
        cast_trainable_parameters_to_bf16(model)
    return model


@contextmanager
def use_adapter(model: Any, adapter_name: str | None):
    """Temporarily switch the active adapter of a PEFT model.

    `adapter_name=None` disables all adapters inside the block (the base model is used, for example as a
    reference). The previous active adapter and the `requires_grad` flags of all parameters are restored on exit.

    Args:
        model: A `peft.PeftModel`.
        adapter_name: Adapter to activate, or None to disable adapters.
    """
    if adapter_name is None:
        with model.disable_adapter():
            yield model
        return
    previous = model.active_adapter
    flags = [(p, p.requires_grad) for p in model.parameters()]
    model.set_adapter(adapter_name)
    try:
        yield model
    finally:
        model.set_adapter(previous)
        for param, flag in flags:  # set_adapter makes the activated adapter trainable: undo that
            param.requires_grad_(flag)
