"""TRL's fused LM head as a model patch: `add_fused_lm_head(model)` gives the model's `forward` a `fused_lm_head=True`
mode that returns per-token log-probabilities (and statistics) of the labels through
[`trl.kernels.ChunkedLogProbFunction`] instead of the full `(batch, length, vocabulary)` logits.

The trainers of this project reach the same kernel through `compute_token_logps`; this module is the public entry
point of TRL 1.16 for code that calls a patched model directly.
"""

import contextlib
import functools
import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from transformers.utils import ModelOutput

from ...kernels.chunked_logprob import OPTIONAL_OUTPUTS, ChunkedLogProbFunction
from ...kernels.linear_log_softmax import in_common_dtype


# Vocabulary entries per tile given to the kernel (TRL's `_CHUNKED_LOGPROB_CHUNK_SIZE`).
_CHUNKED_LOGPROB_CHUNK_SIZE = 32768
_FUSED_OUTPUTS = ("log_probs", *OPTIONAL_OUTPUTS)


@dataclass
class FusedCausalLMOutput(ModelOutput):
    """Output of a model's forward with `fused_lm_head=True` (see [`add_fused_lm_head`]).

    Per-token fields have shape `(batch, length - 1)` (`(batch, length)` with `shift_labels`) and hold 0 (False) where
    the label is -100.

    Args:
        loss: `-sum(log_probs) / (num_items_in_batch or number of labelled tokens)`, plus the router loss when asked.
        log_probs: Log-probability of each label token.
        entropy: Entropy of each next-token distribution (when requested).
        log_sum_sq_probs: `log sum_v p_v**2` of each distribution (when requested).
        mean_logits: Mean over the vocabulary of the (transformed) logits (when requested).
        is_top1: Whether the label is the distribution's first argmax (when requested).
        label_mask: Where the label is not -100.
        aux_loss: Mixture-of-experts load-balancing loss (when router logits were requested).
    """

    loss: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None
    label_mask: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


@contextlib.contextmanager
def maybe_gather_lm_head_ctx(*params: nn.Parameter):
    """Gather the given parameters for the duration of the block when DeepSpeed ZeRO-3 partitions them.

    `None` entries are ignored, duplicates counted once and parameters already available locally left alone; without
    ZeRO-3 partitioned parameters this is a null context.
    """
    unique: dict[int, nn.Parameter] = {}
    for param in params:
        if param is not None and hasattr(param, "ds_id") and id(param) not in unique:
            status = getattr(param, "ds_status", None)
            if getattr(status, "name", None) != "AVAILABLE":
                unique[id(param)] = param
    if not unique:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(unique.values())):
        yield


def _text_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def resolve_logit_scale(text_config: Any) -> float:
    """The factor the model's head applies to its logits: `logit_scale`, `output_multiplier`, `lm_head_multiplier`,
    or the reciprocal of `logits_scaling` (HyperCLOVA X multiplies by it), the first one the config sets; else 1."""
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        value = getattr(text_config, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    scaling = getattr(text_config, "logits_scaling", None)
    if isinstance(scaling, (int, float)) and not isinstance(scaling, bool) and scaling:
        return float(scaling) if getattr(text_config, "model_type", None) == "hyperclovax" else 1.0 / float(scaling)
    return 1.0


def _backbone(model: nn.Module) -> nn.Module:
    """The decoder without its head: `model.base_model`, or `model.model` for a vision-language model under
    transformers 4 (whose `base_model` is the whole model)."""
    backbone = getattr(model, "base_model", None)
    if backbone is None or backbone is model:
        backbone = getattr(model, "model", model)
    return backbone


def _router_aux_loss(router_logits: Any, text_config: Any, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """Mixtral-style load-balancing loss of the router logits, or None when the model returned none."""
    if not router_logits:
        return None
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    num_experts = getattr(text_config, "num_local_experts", None) or getattr(text_config, "num_experts", None)
    top_k = getattr(text_config, "num_experts_per_tok", 2)
    return load_balancing_loss_func(router_logits, num_experts, top_k, attention_mask)


def add_fused_lm_head(
    model: nn.Module,
    temperature: float = 1.0,
    cast_lm_head_to_fp32: bool = False,
    outputs: tuple[str, ...] = ("log_probs",),
) -> None:
    """Give `model.forward` a fused mode computing label log-probabilities without materialising the logits.

    The patched forward accepts the extra keywords `fused_lm_head=False, labels=None, shift_labels=None,
    num_items_in_batch=None`. With `fused_lm_head=False` the original forward runs unchanged. With
    `fused_lm_head=True` only the backbone runs (`use_cache=False`), and the head and log-softmax are applied at the
    labelled positions by [`~trl.kernels.ChunkedLogProbFunction`]; the result is a [`FusedCausalLMOutput`]. Without
    `shift_labels`, hidden state `t` scores `labels[:, t + 1]`; with `shift_labels`, hidden state `t` scores
    `shift_labels[:, t]`. The model's logit scale and soft cap are honoured. Apply it before wrapping the model with
    PEFT. The forward's signature is kept, so `generate` still validates its keyword arguments.

    Args:
        model: A causal language model (or a vision-language model with a language head).
        temperature: The logits are divided by it before the softmax.
        cast_lm_head_to_fp32: Run the head in float32 (hidden states and weights cast, autocast off).
        outputs: Per-token results to compute among `"log_probs"` (always computed), `"entropy"`,
            `"log_sum_sq_probs"`, `"mean_logits"` and `"is_top1"`.
    """
    unknown = set(outputs) - set(_FUSED_OUTPUTS)
    if unknown:
        raise ValueError(f"outputs must be taken from {_FUSED_OUTPUTS}; got {sorted(unknown)}.")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0; got {temperature}.")
    original_forward = model.forward
    stats = tuple(name for name in OPTIONAL_OUTPUTS if name in outputs)

    @functools.wraps(getattr(original_forward, "__func__", original_forward))
    def forward(
        self: nn.Module,
        *args: Any,
        fused_lm_head: bool = False,
        labels: torch.Tensor | None = None,
        shift_labels: torch.Tensor | None = None,
        num_items_in_batch: Any = None,
        **kwargs: Any,
    ) -> Any:
        if not fused_lm_head:
            passed = {"labels": labels, "shift_labels": shift_labels, "num_items_in_batch": num_items_in_batch}
            kwargs.update({key: value for key, value in passed.items() if value is not None})
            return original_forward(*args, **kwargs)
        return _fused_forward(
            self, args, kwargs, labels, shift_labels, num_items_in_batch, temperature, cast_lm_head_to_fp32, stats
        )

    model.forward = types.MethodType(forward, model)


def _fused_forward(
    model: nn.Module,
    args: tuple,
    kwargs: dict[str, Any],
    labels: torch.Tensor | None,
    shift_labels: torch.Tensor | None,
    num_items_in_batch: Any,
    temperature: float,
    cast_lm_head_to_fp32: bool,
    stats: tuple[str, ...],
) -> FusedCausalLMOutput:
    if labels is None and shift_labels is None:
        raise ValueError("fused_lm_head=True needs `labels` (or `shift_labels`) to score.")
    text_config = _text_config(model)
    kwargs["use_cache"] = False
    want_router = bool(getattr(text_config, "output_router_logits", False))
    if want_router:
        kwargs.setdefault("output_router_logits", True)
    backbone_out = _backbone(model)(*args, **kwargs)
    hidden = backbone_out[0]
    if shift_labels is None:
        hidden, targets = hidden[:, :-1], labels[:, 1:]
    else:
        targets = shift_labels
    label_mask = targets != -100

    head = model.get_output_embeddings()
    weight, bias = head.weight, getattr(head, "bias", None)
    if hasattr(weight, "full_tensor"):  # FSDP2 shards the head as a DTensor
        weight = weight.full_tensor()
        bias = bias.full_tensor() if bias is not None and hasattr(bias, "full_tensor") else bias
    selected = hidden[label_mask]
    autocast = contextlib.nullcontext()
    if cast_lm_head_to_fp32:
        selected, weight = selected.float(), weight.float()
        bias = bias.float() if bias is not None else None
        autocast = torch.autocast(device_type=selected.device.type, enabled=False)
    elif not torch.is_autocast_enabled(selected.device.type):
        selected, weight, bias = in_common_dtype(selected, weight, bias)
    with maybe_gather_lm_head_ctx(head.weight, getattr(head, "bias", None)), autocast:
        values = ChunkedLogProbFunction.apply(
            selected,
            weight,
            bias,
            targets[label_mask],
            temperature,
            _CHUNKED_LOGPROB_CHUNK_SIZE,
            getattr(text_config, "final_logit_softcapping", None),
            resolve_logit_scale(text_config),
            stats,
        )

    def scatter(value: torch.Tensor | None) -> torch.Tensor | None:
        if value is None:
            return None
        full = value.new_zeros(targets.shape)
        return full.masked_scatter(label_mask, value)

    per_token = dict(zip(_FUSED_OUTPUTS, (scatter(value) for value in values)))
    count = num_items_in_batch if num_items_in_batch is not None else label_mask.sum().clamp(min=1)
    loss = -per_token["log_probs"].sum() / count
    aux_loss = None
    if want_router or kwargs.get("output_router_logits"):
        aux_loss = _router_aux_loss(
            getattr(backbone_out, "router_logits", None), text_config, kwargs.get("attention_mask")
        )
        if aux_loss is not None:
            loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux_loss.to(loss.device)
    return FusedCausalLMOutput(loss=loss, label_mask=label_mask, aux_loss=aux_loss, **per_token)
