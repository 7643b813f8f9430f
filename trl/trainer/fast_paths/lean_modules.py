"""Memory-lean forwards for the decoder MLPs and RMSNorms of the trained model, in place while a trainer trains or
evaluates ([`lean_modules`]); which modules qualify is decided here once ([`lean_module_kernel`])."""

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn

from ...kernels.decoder_layers import rms_norm, swiglu_mlp
from ..utils.distributed import uses_sharding_engine


# Classes whose forward is exactly `down_proj(act_fn(gate_proj(x)) * up_proj(x))`, resp. the standard RMSNorm formula
# `weight * (x.float() * rsqrt(mean(x.float()^2) + variance_epsilon)).to(x.dtype)`; matched by name so that a
# subclass or a replacement (liger's, a hub kernel's) with other arithmetic never qualifies.
_SWIGLU_MLP_CLASSES = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP")
_RMS_NORM_CLASSES = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")


def _plain_weight(weight: Any) -> bool:
    """A dense floating-point parameter owned by this process (not quantized, not a DeepSpeed ZeRO-3 or FSDP shard)."""
    return type(weight) is nn.Parameter and weight.is_floating_point() and not hasattr(weight, "ds_id")


def _plain_linear(module: Any) -> bool:
    """An unwrapped `nn.Linear` without bias (PEFT's LoRA layers and quantized linears are other classes)."""
    return type(module) is nn.Linear and module.bias is None and _plain_weight(module.weight)


def _silu(module: Any) -> bool:
    return type(module) is nn.SiLU or type(module).__name__ == "SiLUActivation"


def is_lean_swiglu_mlp(module: Any) -> bool:
    """Whether `module` is a Llama / Mistral / Qwen2 / Qwen3 MLP that [`~trl.kernels.decoder_layers.swiglu_mlp`]
    computes exactly: plain bias-free `nn.Linear` gate, up and down projections and a SiLU activation."""
    if type(module).__name__ not in _SWIGLU_MLP_CLASSES:
        return False
    projections = [getattr(module, key, None) for key in ("gate_proj", "up_proj", "down_proj")]
    return all(_plain_linear(p) for p in projections) and _silu(getattr(module, "act_fn", None))


def _unhooked(module: Any) -> bool:
    return "forward" not in vars(module) and not (
        module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
    )


def is_unhooked_lean_swiglu_mlp(mlp: Any) -> bool:
    """A SwiGLU MLP the lean kernel computes exactly ([`is_lean_swiglu_mlp`]), with no hook or replaced forward on it
    or its projections: the kernel reads the weights directly, so the projections' own calls, and their hooks, would
    be skipped."""
    if mlp is None or not is_lean_swiglu_mlp(mlp) or not _unhooked(mlp):
        return False
    return all(_unhooked(getattr(mlp, key)) for key in ("gate_proj", "up_proj", "down_proj"))


@contextlib.contextmanager
def mlps_without_grad(model: nn.Module) -> Iterator[int]:
    """Within the block (a pass without gradients, such as a frozen reference's), every unhooked SwiGLU MLP of
    `model` ([`is_unhooked_lean_swiglu_mlp`]) runs [`~trl.kernels.decoder_layers.swiglu_mlp`], which computes the
    activation and the product in place when no gradient is recorded: the same values with one `tokens x
    intermediate` tensor fewer. Yields how many MLPs were switched."""
    kernels = [(module, _swiglu_forward(module)) for module in model.modules() if is_unhooked_lean_swiglu_mlp(module)]
    with switched_forwards(kernels) as switched:
        yield switched


@contextlib.contextmanager
def switched_forwards(kernels: list[tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor]]]) -> Iterator[int]:
    """Within the block, each module's instance `forward` is its kernel; yields how many modules were switched."""
    for module, kernel in kernels:
        module.forward = kernel
    try:
        yield len(kernels)
    finally:
        for module, _ in kernels:
            del module.forward


def _swiglu_forward(mlp: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    # Weights read at call time: an engine may swap the parameter objects after the switch.
    return lambda x: swiglu_mlp(x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)


def lean_module_kernel(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The memory-lean forward for `module` when it is a supported SwiGLU MLP or RMSNorm, else None.

    Supported: the Llama / Mistral / Qwen2 / Qwen3 MLP with plain bias-free `nn.Linear` gate, up and down
    projections and a SiLU activation ([`~trl.kernels.decoder_layers.swiglu_mlp`]), and these models' RMSNorm
    ([`~trl.kernels.decoder_layers.rms_norm`]), with dense floating-point weights.
    """
    if is_lean_swiglu_mlp(module):
        return _swiglu_forward(module)
    if type(module).__name__ in _RMS_NORM_CLASSES:
        weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
        if _plain_weight(weight) and weight.dim() == 1 and isinstance(eps, float):
            return lambda x: rms_norm(x, module.weight, module.variance_epsilon)
    return None


def lean_mlp_kernels(layer: nn.Module) -> list[tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor]]]:
    """The lean SwiGLU kernels for the unhooked MLPs inside one decoder layer ([`is_unhooked_lean_swiglu_mlp`]), to
    pass to [`switched_forwards`]: a layer that keeps its activations under gradient checkpointing keeps two of the
    four `tokens x intermediate` tensors, with gradients bitwise plain autograd's. (The RMSNorm kernel is left out:
    within a layer, its input gradient is summed in another order than plain autograd's.)"""
    return [(m, _swiglu_forward(m)) for m in layer.modules() if m is not layer and is_unhooked_lean_swiglu_mlp(m)]


def lean_modules_applicable(model: nn.Module, args: Any = None) -> bool:
    """Whether the model-wide conditions for [`lean_modules`] hold: no DeepSpeed or FSDP engine, and no gradient
    checkpointing (it already drops the activations these kernels save memory on), asked of the training arguments
    `args` (the trainer turns both on later) and of the model."""
    if args is not None and (uses_sharding_engine(args) or getattr(args, "gradient_checkpointing", False)):
        return False
    target = getattr(model, "module", model)
    return not any(getattr(m, "gradient_checkpointing", False) is True for m in target.modules())


@contextlib.contextmanager
def lean_modules(model: nn.Module, args: Any = None) -> Iterator[int]:
    """Within the block, every supported MLP and RMSNorm of `model` ([`lean_module_kernel`]) runs its memory-lean
    forward (same values and gradients, fewer saved activations). Only the modules' `forward` is replaced, on the
    instances: no parameter, buffer or state-dict key changes, and saving inside the block writes the same files.
    Yields how many modules were switched; re-entering the block leaves the outer one in charge."""
    if not lean_modules_applicable(model, args):
        yield 0
        return
    kernels = []
    for module in getattr(model, "module", model).modules():
        if "forward" in vars(module):  # already replaced (an outer block) or patched by someone else
            continue
        kernel = lean_module_kernel(module)
        if kernel is not None:
            kernels.append((module, kernel))
    with switched_forwards(kernels) as switched:
        yield switched
