"""Selective activation checkpointing: gradient checkpointing that keeps the attention kernels' outputs and recomputes
everything else in the backward pass.

Plain gradient checkpointing recomputes a whole decoder layer, attention included. Attention is the costly part to
recompute and its output is small next to the MLP's intermediate activations, so saving it (and only it) keeps most
of the memory saving while removing most of the recompute cost. [`enable_selective_activation_checkpointing`] makes
every later `gradient_checkpointing_enable` call of a model (by the Trainer, by PEFT preparation) use such a policy
through `torch.utils.checkpoint.create_selective_checkpoint_contexts`.
"""

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn


# The aten scaled-dot-product attention kernels whose outputs are saved (those this torch build has).
_SDPA_OPS = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
)


def _saved_ops() -> set:
    return {getattr(torch.ops.aten, name).default for name in _SDPA_OPS if hasattr(torch.ops.aten, name)}


def _attention_saving_policy() -> Callable[..., Any]:
    """Checkpoint policy: MUST_SAVE the attention kernels (the aten SDPA ops and any op named like `flash_attn`),
    PREFER_RECOMPUTE the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    saved = _saved_ops()

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        if op in saved or "flash_attn" in str(op):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def enable_selective_activation_checkpointing(model: nn.Module) -> None:
    """Make the model's gradient checkpointing selective: attention outputs are saved, the rest is recomputed.

    The instance's `gradient_checkpointing_enable` is wrapped so that each later call (whoever makes it) copies its
    `gradient_checkpointing_kwargs`, drops the key `"selective"`, forces `use_reentrant=False` (selective contexts
    need the non-reentrant implementation) and adds the selective-checkpoint `context_fn`. Calling it again on the
    same model does nothing.

    Args:
        model: A model with a `gradient_checkpointing_enable` method (transformers models, PEFT models).

    Example:
    ```python
    >>> enable_selective_activation_checkpointing(model)
    >>> model.gradient_checkpointing_enable()  # attention outputs kept, MLPs and norms recomputed
    ```
    """
    original = getattr(model, "gradient_checkpointing_enable", None)
    if original is None:
        raise ValueError(
            f"{type(model).__name__} has no gradient_checkpointing_enable method, so its checkpointing cannot be made "
            "selective."
        )
    if getattr(original, "_is_sac_wrapped", False):
        return
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    context_fn = functools.partial(create_selective_checkpoint_contexts, _attention_saving_policy())

    @functools.wraps(original)
    def gradient_checkpointing_enable(gradient_checkpointing_kwargs: dict | None = None, **kwargs: Any) -> Any:
        options = dict(gradient_checkpointing_kwargs or {})
        options.pop("selective", None)
        options["use_reentrant"] = False
        options["context_fn"] = context_fn
        with warnings.catch_warnings():
            # transformers 5 deprecates this entry point; the wrapper is how every caller is reached, on purpose.
            warnings.filterwarnings("ignore", message=".*gradient_checkpointing_enable.*", category=FutureWarning)
            return original(gradient_checkpointing_kwargs=options, **kwargs)

    gradient_checkpointing_enable._is_sac_wrapped = True
    model.gradient_checkpointing_enable = gradient_checkpointing_enable


def apply_selective_checkpointing_option(model: nn.Module, args: Any, is_peft: bool) -> None:
    """SFT's `gradient_checkpointing_kwargs={"selective": True}` switch.

    When the key is truthy: checks that the combination can work (gradient checkpointing on, not reentrant, not PEFT
    with DeepSpeed ZeRO-3) and wraps `model`; the key stays in the config (the wrapper drops it). When it is falsy or
    absent it is removed from the kwargs, which go to `torch.utils.checkpoint` as they are.

    Args:
        model: The model to wrap (the base model, before PEFT; call again on the PEFT model).
        args: The trainer config (`gradient_checkpointing`, `gradient_checkpointing_kwargs`, DeepSpeed settings).
        is_peft: Whether the model is (or will be) a PEFT model.
    """
    kwargs = getattr(args, "gradient_checkpointing_kwargs", None)
    if not isinstance(kwargs, dict) or "selective" not in kwargs:
        return
    if not kwargs["selective"]:
        kwargs.pop("selective")
        return
    if not args.gradient_checkpointing:
        raise ValueError(
            "`gradient_checkpointing_kwargs={'selective': True}` requires `gradient_checkpointing=True`. Set "
            "gradient_checkpointing=True or drop the 'selective' key."
        )
    if kwargs.get("use_reentrant"):
        raise ValueError(
            "`gradient_checkpointing_kwargs={'selective': True}` requires non-reentrant gradient checkpointing. Set "
            "`use_reentrant` to `False`, or leave it unset."
        )
    from transformers.integrations import is_deepspeed_zero3_enabled

    if is_peft and is_deepspeed_zero3_enabled():
        raise ValueError(
            "Selective activation checkpointing cannot be combined with PEFT under DeepSpeed ZeRO-3. Drop the "
            "'selective' key, PEFT, or ZeRO-3."
        )
    enable_selective_activation_checkpointing(model)
