"""Whether a model's forward pass draws random numbers.

Dropout in train mode and NEFTune's noise on the input embeddings draw random numbers per position. A fast path that
runs such a forward on another layout (padding dropped, rows packed, prefixes shared, prompts prefilled once), another
number of times or in another order than the plain path draws other numbers, and every later random number differs:
it steps aside when [`forward_is_deterministic`] says no.
"""

import torch.nn as nn

from ...models.utils import _base_transformers_model


# Hooks on the input embeddings that act the same whatever the batch's layout: the one
# `PreTrainedModel.enable_input_require_grads` registers (by name), and those of the engines that gather or place
# parameters around a forward pass (by the package that defines them).
_REQUIRE_GRADS_HOOK = "make_inputs_require_grads"
_ENGINE_HOOK_PACKAGES = ("deepspeed", "torch.distributed", "accelerate")


def has_dropout(module: nn.Module, active_only: bool = True) -> bool:
    """Whether a dropout module inside `module` (PEFT's `lora_dropout`, ...) draws random numbers: in train mode
    with `active_only`, in either mode otherwise. A forward run on other positions, or not run at all, would draw other
    numbers than the plain forward, and every later random number would differ.

    Args:
        module: The module to search.
        active_only: Count only dropouts in train mode.
    """
    return any(
        isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 and (m.training or not active_only)
        for m in module.modules()
    )


def input_embeddings_hooked(model: nn.Module) -> bool:
    """Whether `model`'s input embeddings run forward hooks, as NEFTune's noise (`neftune_noise_alpha`) or a plugin's.

    Such a hook sees the batch in the shape the forward pass lays it out: NEFTune draws its noise per position and
    scales it by the padded sequence length. Hooks that act the same whatever the layout do not count: transformers'
    `enable_input_require_grads` (gradient checkpointing, adapters) and those of DeepSpeed, torch.distributed and
    accelerate.
    """
    get = getattr(_base_transformers_model(model), "get_input_embeddings", None)
    try:
        embeddings = get() if callable(get) else None
    except NotImplementedError:
        return False
    if not isinstance(embeddings, nn.Module):
        return False
    for hook in (*embeddings._forward_hooks.values(), *embeddings._forward_pre_hooks.values()):
        function = getattr(hook, "func", hook)  # a `functools.partial`'s function
        package = getattr(function, "__module__", None) or ""
        if getattr(function, "__name__", None) == _REQUIRE_GRADS_HOOK:
            continue
        if any(package == name or package.startswith(name + ".") for name in _ENGINE_HOOK_PACKAGES):
            continue
        return True
    return False


def forward_is_deterministic(model: nn.Module) -> bool:
    """Whether a forward pass of `model` draws no random numbers: no active dropout module ([`has_dropout`]), no
    attention dropout in a layer in train mode, and no hook on its input embeddings ([`input_embeddings_hooked`]).

    Args:
        model: The module whose forward is run (a policy, a reference model, or a PEFT policy whose adapters are
            disabled to serve as the reference).
    """
    if has_dropout(model, active_only=True) or input_embeddings_hooked(model):
        return False
    return not any(
        module.training and float(getattr(module, "attention_dropout", 0.0) or 0.0) > 0 for module in model.modules()
    )
