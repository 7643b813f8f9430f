"""Helpers around the models a trainer handles: frozen reference copies, unwrapping for generation, preparing
eval-only models (reference, reward, teacher) for DeepSpeed or FSDP, turning dropout off, and hashing weights."""

import copy
import hashlib
import itertools
import warnings
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn

from .._compat import disable_activation_checkpointing, enable_activation_checkpointing, is_activation_checkpointing
from ..import_utils import is_deepspeed_available, is_peft_available


# Where decoder layers live in common architectures; `{layer}` is replaced by the layer number.
LAYER_PATTERNS = [
    "transformer.h.{layer}",
    "model.decoder.layers.{layer}",
    "gpt_neox.layers.{layer}",
    "model.layers.{layer}",
]


def _is_deepspeed_zero3() -> bool:
    try:
        from transformers.integrations import is_deepspeed_zero3_enabled
    except ImportError:
        return False
    return bool(is_deepspeed_zero3_enabled())


def _accelerator_zero_stage(accelerator: Any) -> int | None:
    plugin = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None)
    if plugin is None:
        return None
    return getattr(plugin, "zero_stage", None)


def _create_reference_model(
    model: nn.Module, num_shared_layers: int | None = None, pattern: str | None = None
) -> nn.Module:
    """Implementation of `create_reference_model` (see `trl.experimental.utils.create_reference_model`)."""
    if _is_deepspeed_zero3():
        raise ValueError(
            "DeepSpeed ZeRO-3 is enabled: a reference model cannot be created by copying the (sharded) model. Load "
            "the reference model with `from_pretrained` instead, or use ZeRO stage 0-2."
        )

    ref_model = copy.deepcopy(model)
    # Freeze every parameter of the copy, including tied ones that named_parameters() would list once.
    for param in ref_model.parameters():
        param.requires_grad_(False)

    if num_shared_layers is None:
        return ref_model.eval()

    names = [name for name, _ in model.named_parameters()]
    candidates = [pattern] if pattern is not None else LAYER_PATTERNS
    prefix = None
    for candidate in candidates:
        formatted = candidate.format(layer=num_shared_layers)
        if any(f"{formatted}." in name or name.startswith(f"{formatted}.") for name in names):
            prefix = formatted
            break
    if prefix is None:
        tried = [c.format(layer=num_shared_layers) for c in candidates]
        raise ValueError(
            f"Could not find layer {num_shared_layers} in the model parameters (looked for {tried}). Pass `pattern` "
            "with a `{layer}` placeholder matching your architecture, e.g. pattern='model.layers.{layer}'."
        )

    shared_names = list(itertools.takewhile(lambda n: f"{prefix}." not in n, names))

    # Point the reference model at the original parameter objects for the shared part. Matching by the identity of
    # the copied parameter keeps weight tying inside the copy intact.
    replacement = {}
    for name in shared_names:
        original = model.get_parameter(name)
        original.requires_grad_(False)
        replacement[id(ref_model.get_parameter(name))] = original
    for module in ref_model.modules():
        for attr, param in list(module._parameters.items()):
            if param is not None and id(param) in replacement:
                module._parameters[attr] = replacement[id(param)]

    return ref_model.eval()


def create_reference_model(
    model: nn.Module, num_shared_layers: int | None = None, pattern: str | None = None
) -> nn.Module:
    """Deprecated location of `trl.experimental.utils.create_reference_model`; emits a FutureWarning and delegates.

    Creates a frozen copy of `model` in eval mode. With `num_shared_layers`, parameters before layer
    `num_shared_layers` are shared (same tensors, frozen in both models) and the rest are copied and frozen.

    Args:
        model: Model to copy.
        num_shared_layers: Number of leading layers to share; None copies everything.
        pattern: Layer-name pattern with a `{layer}` placeholder; by default common layouts are tried.

    Returns:
        The reference model.
    """
    warnings.warn(
        "`trl.models.create_reference_model` is deprecated and will be removed; use "
        "`trl.experimental.utils.create_reference_model` instead.",
        FutureWarning,
        stacklevel=2,
    )
    return _create_reference_model(model, num_shared_layers=num_shared_layers, pattern=pattern)


# ---------------------------------------------------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------------------------------------------------


def _remove_deepspeed_hooks(engine: Any) -> None:
    """Detach ZeRO-3 parameter-fetching hooks so generation with gathered weights does not re-partition them."""
    offload = engine.optimizer.parameter_offload if engine.optimizer is not None else engine.parameter_offload
    if offload is None:
        return
    for param in offload.module.parameters(recurse=True):
        if hasattr(param, "ds_active_sub_modules"):
            param.ds_active_sub_modules.clear()
    for hook in list(getattr(offload, "forward_hooks", [])) + list(getattr(offload, "backward_hooks", [])):
        hook.remove()
    offload.forward_hooks = []
    offload.backward_hooks = []


def _add_deepspeed_hooks(engine: Any) -> None:
    offload = engine.optimizer.parameter_offload if engine.optimizer is not None else engine.parameter_offload
    if offload is None:
        return
    if hasattr(offload, "_register_deepspeed_module"):
        offload._register_deepspeed_module(offload.module)
    else:  # older DeepSpeed releases
        offload._register_hooks_recursively(offload.module)


@contextmanager
def disable_gradient_checkpointing(model: nn.Module, gradient_checkpointing_kwargs: dict | None = None):
    """Context manager that turns gradient checkpointing off for the duration of the block (generation needs the KV
    cache, which checkpointed layers do not keep) and back on afterwards, also when the block raises.

    A model without gradient checkpointing is left as it is.

    Args:
        model: A transformers model (or one exposing TRL-style `activation_checkpointing_*` methods).
        gradient_checkpointing_kwargs: Arguments passed to `gradient_checkpointing_enable` when it is turned back on.
    """
    was_checkpointing = is_activation_checkpointing(model)
    if was_checkpointing:
        disable_activation_checkpointing(model)
    try:
        yield
    finally:
        if was_checkpointing:
            enable_activation_checkpointing(model, gradient_checkpointing_kwargs)


@contextmanager
def unwrap_model_for_generation(
    model: nn.Module,
    accelerator: Any,
    gather_deepspeed3_params: bool = True,
    generation_kwargs: dict | None = None,
    gradient_checkpointing_kwargs: dict | None = None,
):
    """Context manager yielding the bare model, ready for `generate`, from an accelerate-prepared model.

    Inside the block gradient checkpointing is turned off and `use_cache` is on (both restored afterwards), and
    `generation_kwargs` are temporarily set on the model's `generation_config`. Under DeepSpeed ZeRO-3 the sharded
    parameters are gathered for the duration of the block when `gather_deepspeed3_params` is True (fast generation,
    needs memory for the full model); otherwise the model is yielded as is and parameters are fetched layer by layer.

    Args:
        model: Model prepared by `accelerator`.
        accelerator: The `accelerate.Accelerator` that prepared it.
        gather_deepspeed3_params: Gather all ZeRO-3 parameters before generating.
        generation_kwargs: Attributes set on `generation_config` inside the block.
        gradient_checkpointing_kwargs: Arguments used to turn gradient checkpointing back on afterwards.
    """
    unwrapped = accelerator.unwrap_model(model)
    with disable_gradient_checkpointing(unwrapped, gradient_checkpointing_kwargs):
        config = getattr(unwrapped, "config", None)
        previous_use_cache = getattr(config, "use_cache", None) if config is not None else None
        if config is not None and hasattr(config, "use_cache"):
            config.use_cache = True
        generation_config = getattr(unwrapped, "generation_config", None)
        previous_generation = {}
        if generation_kwargs and generation_config is not None:
            for key, value in generation_kwargs.items():
                previous_generation[key] = getattr(generation_config, key, None)
                setattr(generation_config, key, value)

        try:
            if _accelerator_zero_stage(accelerator) == 3:
                if gather_deepspeed3_params:
                    import deepspeed

                    with deepspeed.zero.GatheredParameters(list(model.parameters())):
                        _remove_deepspeed_hooks(model)
                        try:
                            yield unwrapped
                        finally:
                            _add_deepspeed_hooks(model)
                else:
                    yield unwrapped
            else:
                yield unwrapped
        finally:
            for key, value in previous_generation.items():
                setattr(generation_config, key, value)
            if config is not None and previous_use_cache is not None:
                config.use_cache = previous_use_cache


# ---------------------------------------------------------------------------------------------------------------------
# DeepSpeed / FSDP preparation of eval-only models
# ---------------------------------------------------------------------------------------------------------------------


def _hidden_size(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    if config is None:
        return None
    sizes = getattr(config, "hidden_sizes", None)
    if sizes:
        return max(sizes)
    size = getattr(config, "hidden_size", None)
    if size is None:
        text_config = getattr(config, "text_config", None)
        size = getattr(text_config, "hidden_size", None) if text_config is not None else None
    return size


def _drop_auto_values(config: dict) -> None:
    """Remove unresolved `"auto"` placeholders (valid only for accelerate's own engine) from a DeepSpeed config."""
    for key, value in list(config.items()):
        if value == "auto":
            config.pop(key)
        elif isinstance(value, dict):
            _drop_auto_values(value)


def prepare_deepspeed(model: nn.Module, accelerator: Any):
    """Wrap an eval-only model (reference, reward, teacher) in a DeepSpeed inference engine matching the trainer.

    The trainer's DeepSpeed config is copied without optimizer/scheduler. ZeRO-3 stays ZeRO-3 (the model is
    sharded like the policy), with bucket sizes derived from the hidden size; for stages 0-2 there is nothing to
    shard in a frozen model, so stage 0 is used.

    Args:
        model: Model to wrap.
        accelerator: The trainer's `accelerate.Accelerator` (configured for DeepSpeed).

    Returns:
        The DeepSpeed engine, in eval mode.
    """
    if not is_deepspeed_available():
        raise ImportError("`prepare_deepspeed` needs DeepSpeed. Install it with `pip install trl[deepspeed]`.")
    import deepspeed

    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        raise ValueError("`prepare_deepspeed` was called but the accelerator is not configured for DeepSpeed.")
    config = copy.deepcopy(plugin.deepspeed_config)
    zero = config.setdefault("zero_optimization", {})
    stage = zero.get("stage", 0)

    if stage == 3:
        hidden = _hidden_size(model)
        if hidden is not None:
            # Buckets proportional to one hidden x hidden matrix; tiny parameters stay unpartitioned.
            zero["reduce_bucket_size"] = hidden * hidden
            zero["stage3_param_persistence_threshold"] = 10 * hidden
            zero["stage3_prefetch_bucket_size"] = int(0.9 * hidden * hidden)
    else:
        zero["stage"] = 0
    config.pop("optimizer", None)
    config.pop("scheduler", None)
    _drop_auto_values(config)
    if "train_batch_size" not in config and "train_micro_batch_size_per_gpu" not in config:
        # An eval-only engine never steps, but DeepSpeed insists on a consistent batch configuration.
        config["train_micro_batch_size_per_gpu"] = 1
        config["gradient_accumulation_steps"] = 1

    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine


def prepare_fsdp(model: nn.Module, accelerator: Any):
    """Shard an eval-only model (reference, reward, teacher) with FSDP like the trainer's policy model.

    FSDP1 wraps with `FullyShardedDataParallel` using the plugin's auto-wrap policy, sharding strategy, CPU offload
    and mixed precision. FSDP2 applies `torch.distributed.fsdp.fully_shard` to every transformer block (the model's
    `_no_split_modules` or the plugin's `transformer_cls_names_to_wrap`) and then to the root module.

    Args:
        model: Model to shard.
        accelerator: The trainer's `accelerate.Accelerator` (configured for FSDP).

    Returns:
        The wrapped model (`FullyShardedDataParallel` or `FSDPModule`), in eval mode.
    """
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    if isinstance(model, (FullyShardedDataParallel, FSDPModule)):
        return model.eval()
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is None:
        raise ValueError("`prepare_fsdp` was called but the accelerator is not configured for FSDP.")

    if getattr(plugin, "fsdp_version", 1) == 2:
        from torch.distributed.fsdp import fully_shard

        layer_names = set(plugin.transformer_cls_names_to_wrap or getattr(model, "_no_split_modules", None) or [])
        shard_kwargs = {"reshard_after_forward": plugin.reshard_after_forward}
        if plugin.mixed_precision_policy is not None:
            shard_kwargs["mp_policy"] = plugin.mixed_precision_policy
        if plugin.cpu_offload is not None and not isinstance(plugin.cpu_offload, bool):
            shard_kwargs["offload_policy"] = plugin.cpu_offload
        for module in model.modules():
            if type(module).__name__ in layer_names:
                fully_shard(module, **shard_kwargs)
        fully_shard(model, **shard_kwargs)
        return model.eval()

    if plugin.auto_wrap_policy is None and hasattr(plugin, "set_auto_wrap_policy"):
        plugin.set_auto_wrap_policy(model)
    wrapped = FullyShardedDataParallel(
        model,
        sharding_strategy=plugin.sharding_strategy,
        cpu_offload=plugin.cpu_offload,
        auto_wrap_policy=plugin.auto_wrap_policy,
        mixed_precision=plugin.mixed_precision_policy,
        sync_module_states=plugin.sync_module_states,
        backward_prefetch=plugin.backward_prefetch,
        forward_prefetch=plugin.forward_prefetch,
        use_orig_params=plugin.use_orig_params,
        param_init_fn=plugin.param_init_fn,
        ignored_modules=plugin.ignored_modules,
        limit_all_gathers=plugin.limit_all_gathers,
        device_id=accelerator.device,
    )
    return wrapped.eval()


__all__ = [
    "LAYER_PATTERNS",
    "create_reference_model",
    "prepare_deepspeed",
    "prepare_fsdp",
    "unwrap_model_for_generation",
]


def disable_dropout_in_model(model: nn.Module) -> None:
    """Set the probability of every dropout layer of `model` to 0 (in place)."""
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0


def hash_module(module: nn.Module) -> str:
    """SHA-256 hex digest of a module's state dict, equal to TRL's.

    Entries are taken in sorted key order; each contributes its dtype name (`"torch.float32"`) and its values' bytes.
    Names and shapes are not hashed. bfloat16 tensors (which numpy cannot hold) contribute their float32 bytes.
    """
    digest = hashlib.sha256()
    state = module.state_dict()
    for key in sorted(state):
        tensor = state[key].detach().to("cpu").contiguous()
        digest.update(str(tensor.dtype).encode())
        if tensor.dtype == torch.bfloat16:
            tensor = tensor.float()
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


def _base_transformers_model(model: nn.Module) -> nn.Module:
    """The underlying transformers model of a (DDP-, accelerate- or PEFT-) wrapped model."""
    target = getattr(model, "module", model)
    if is_peft_available():
        from peft import PeftModel

        if isinstance(target, PeftModel):
            target = target.get_base_model()
    return target
