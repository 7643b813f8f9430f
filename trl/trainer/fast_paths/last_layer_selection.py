"""The last decoder layer computed only where its output is read.

A reward model reads the final hidden state at one token per sequence; DPO, KTO and the online trainers read it at the
completion tokens only. Every other position of the last decoder layer is needed only for its keys and values, which
the read positions attend to: its query projection, attention output, output projection and MLP (about 95 % of the
layer's FLOPs in a Llama-style decoder) are dead work there, in the forward pass, the checkpoint recompute and the
backward pass alike.

[`last_layer_at`] swaps in, for the duration of one forward call, a forward of the last decoder layer that computes
keys and values on every position and everything else on the selected positions only, then writes those into an
otherwise zero hidden-state tensor of the usual shape (the final RMSNorm maps zero to zero; callers read only the
selected positions). Values equal the full layer's up to float rounding (matrix products over fewer rows); gradients
flow to every position through the keys and values. Gradient checkpointing stays on: the swapped forward checkpoints
itself exactly as transformers' layer does, with the selection bound into the recomputed function.

[`last_layer_selection_fallback_reason`] says which models qualify; anything else (and any call with a cache, or a
packed row without a dense mask) runs the layer as is, with the same output contract.
"""

import contextlib
import functools
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from ..._compat import CACHE_KEYWORDS, attention_interface, layer_call_is_checkpointed
from ...kernels.packed_attention import PACKED_SDPA
from ...models.utils import _base_transformers_model
from ..utils.distributed import parameters_sharded
from ..utils.forward_randomness import has_dropout


# Decoder layers whose forward is the Llama one (pre-norm attention with rotary embeddings, pre-norm MLP); Qwen3 adds
# per-head RMSNorms on queries and keys. Matched by exact class name and modeling module.
_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
_CLASS_PREFIX = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
_ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager", PACKED_SDPA)
# Below this share of positions read, the saving outweighs the gathers (at 1, nothing is saved).
_MAX_SELECTED_SHARE = 0.9


def _last_layer(model: nn.Module) -> tuple[nn.Module | None, str | None]:
    """The last decoder layer of `model` (a transformers causal LM or sequence classifier, possibly PEFT-wrapped) and
    its family, or `(None, reason)`."""
    base = _base_transformers_model(model)
    backbone = getattr(base, getattr(base, "base_model_prefix", ""), None)
    layers = getattr(backbone, "layers", None)
    config = getattr(base, "config", None)
    if not isinstance(layers, nn.ModuleList) or config is None or len(layers) == 0:
        return None, "no decoder layer list"
    count = getattr(config, "num_hidden_layers", len(layers))
    if count != len(layers):
        return None, "num_hidden_layers differs from the layer list"
    layer = layers[-1]
    module = type(layer).__module__
    family = module.rsplit("_", 1)[-1] if module.startswith("transformers.models.") else None
    if family not in _FAMILIES or module != f"transformers.models.{family}.modeling_{family}":
        return None, f"decoder layer {module}.{type(layer).__name__} is not a Llama-style one"
    return layer, family


def last_layer_selection_fallback_reason(model: nn.Module) -> str | None:
    """Why [`last_layer_at`] cannot compute `model`'s last decoder layer on selected positions, or None when it can.

    Qualify: transformers' own Llama / Mistral / Qwen2 / Qwen3 decoder layers (inside a causal LM or a sequence
    classifier, PEFT-wrapped or not: LoRA or quantized projections are called as the layer calls them) whose last
    layer has full causal attention through SDPA, eager or packed SDPA, no dropout that would draw random numbers in
    train mode, no hooks, and parameters that are not sharded.

    Args:
        model: The model whose forward is about to run.

    Returns:
        A short reason, or None.
    """
    layer, family = _last_layer(model)
    if layer is None:
        return family
    prefix = _CLASS_PREFIX[family]
    attn = getattr(layer, "self_attn", None)
    if type(layer).__name__ != f"{prefix}DecoderLayer" or "forward" in vars(layer):
        return "decoder layer class or forward replaced"
    if type(attn).__name__ != f"{prefix}Attention" or type(attn).__module__ != type(layer).__module__:
        return "attention class replaced"
    if "forward" in vars(attn):
        return "attention forward replaced"
    config = _base_transformers_model(model).config
    if getattr(config, "_attn_implementation", None) not in _ATTENTION_IMPLEMENTATIONS:
        return f"attention implementation {getattr(config, '_attn_implementation', None)!r}"
    if not getattr(config, "is_causal", True) or not getattr(attn, "is_causal", True):
        return "bidirectional attention"
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    if layer_types[-1] != "full_attention" or getattr(attn, "sliding_window", None) is not None:
        return "sliding-window attention in the last layer"
    if not all(isinstance(getattr(attn, name, None), nn.Module) for name in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return "attention projections are not modules"
    if (attn.training and getattr(attn, "attention_dropout", 0.0) > 0) or has_dropout(layer):
        return "dropout in train mode in the last layer"
    if any(m._forward_hooks or m._forward_pre_hooks or hasattr(m, "_hf_hook") for m in layer.modules()):
        return "hooks on the last decoder layer"
    if parameters_sharded(model):
        return "parameters sharded (DeepSpeed ZeRO-3 / FSDP)"
    return None


@contextlib.contextmanager
def last_layer_at(model: nn.Module, flat_index: torch.Tensor, length: int) -> Iterator[bool]:
    """Within the block, one forward of `model` computes its last decoder layer only at the selected positions.

    The layer's output is zero at every other position, so callers must read the final hidden states (or whatever
    is computed from them position by position) at the selected positions only. Runs the layer as is (and yields
    False) when the model does not qualify ([`last_layer_selection_fallback_reason`]) or the selection covers most
    positions anyway.

    Args:
        model: The model about to run (causal LM or sequence classifier).
        flat_index: `(n,)` positions to compute, as `row * length + column` of the `(rows, length)` inputs.
        length: Sequence length of the inputs.

    Yields:
        Whether the selection is in place.
    """
    layer = _last_layer(model)[0]
    if flat_index.numel() == 0 or layer is None or last_layer_selection_fallback_reason(model) is not None:
        yield False
        return
    # A position read twice (rows sharing a prefix read its last token) is computed once: a repeated index would
    # receive its gradient twice.
    flat_index = torch.unique(flat_index)
    rows, columns = flat_index // length, flat_index % length
    num_rows = int(rows.max()) + 1
    counts = torch.bincount(rows, minlength=num_rows)
    most = int(counts.max())
    if most > _MAX_SELECTED_SHARE * length:
        yield False
        return
    # Slot k of row r holds the row's k-th selected column (ascending); unused slots repeat column 0 and are dropped.
    starts = torch.cumsum(counts, 0) - counts
    slots = torch.arange(rows.numel(), device=rows.device) - starts[rows]
    grid_columns = torch.zeros((num_rows, most), dtype=torch.long, device=rows.device)
    grid_columns[rows, slots] = columns
    used = torch.zeros((num_rows, most), dtype=torch.bool, device=rows.device)
    used[rows, slots] = True
    selection = _Selection(grid_columns, used, length, checkpoint=getattr(layer, "gradient_checkpointing", False))
    # Before transformers 5 the layer's `__call__` checkpoints, and its recompute would run whatever `forward` is
    # installed by then (the class's, once this block is left): the layer is called plainly and checkpoints here.
    call_checkpointed = selection.checkpoint and layer_call_is_checkpointed()
    if call_checkpointed:
        layer.gradient_checkpointing = False
    layer.forward = functools.partial(_selective_forward, layer, selection)
    try:
        yield True
    finally:
        del layer.forward
        if call_checkpointed:
            layer.gradient_checkpointing = True


def last_layer_before_end(
    model: nn.Module, input_ids: torch.Tensor, count: int
) -> contextlib.AbstractContextManager[bool]:
    """[`last_layer_at`] the `count` positions before each row's last one: those that predict the last `count`
    tokens of every row (a completion after its prompt, read through `logits_to_keep=count + 1`)."""
    rows, length = input_ids.shape
    columns = torch.arange(length - count - 1, length - 1, device=input_ids.device)
    read = (torch.arange(rows, device=input_ids.device).unsqueeze(1) * length + columns).flatten()
    return last_layer_at(model, read, length)


class _Selection:
    """Per row, the selected columns padded to the row with the most (`columns`, `used`: `(rows, most)`)."""

    def __init__(self, columns: torch.Tensor, used: torch.Tensor, length: int, checkpoint: bool = False):
        self.columns, self.used, self.length = columns, used, length
        self.checkpoint = checkpoint  # the layer is gradient-checkpointed
        self.rows = torch.arange(columns.shape[0], device=columns.device)[:, None].expand_as(columns)


def _selective_forward(
    layer: nn.Module,
    selection: _Selection,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    use_cache: bool | None = False,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """The decoder layer's forward with the selection applied, or the class's own forward where it cannot be.

    The KV cache comes in `kwargs` under whichever name the installed transformers uses (see `trl._compat`)."""
    own = functools.partial(
        type(layer).forward.__get__(layer), attention_mask=attention_mask, position_ids=position_ids,
        use_cache=use_cache, position_embeddings=position_embeddings, **kwargs,
    )  # fmt: skip
    checkpoint = selection.checkpoint and layer.training and torch.is_grad_enabled()

    def full_call() -> torch.Tensor:
        if checkpoint and layer_call_is_checkpointed():  # the class's forward does not checkpoint itself there
            return layer._gradient_checkpointing_func(own, hidden_states)
        return own(hidden_states)

    batch, length = hidden_states.shape[:2]
    if (
        use_cache
        or any(kwargs.get(name) is not None for name in CACHE_KEYWORDS)
        or position_embeddings is None
        or length != selection.length
        or batch != selection.columns.shape[0]
        or (
            attention_mask is not None and (attention_mask.dim() != 4 or attention_mask.shape[-2:] != (length, length))
        )
        or (attention_mask is None and not _plain_causal(position_ids, length))
    ):
        return full_call()
    compute = functools.partial(_selected_layer, layer, selection, attention_mask, position_embeddings, kwargs)
    if checkpoint:
        return layer._gradient_checkpointing_func(compute, hidden_states)
    return compute(hidden_states)


def _plain_causal(position_ids: torch.Tensor | None, length: int) -> bool:
    """Without a dense mask, the layer attends causally by column: true unless the positions restart (packed row)."""
    if position_ids is None:
        return True
    expected = torch.arange(length, device=position_ids.device)
    return bool((position_ids == expected).all())


def _selected_layer(
    layer: nn.Module,
    selection: _Selection,
    attention_mask: torch.Tensor | None,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    kwargs: dict[str, Any],
    hidden_states: torch.Tensor,
) -> torch.Tensor:

    modeling = sys.modules[type(layer).__module__]
    attn = layer.self_attn
    rows, columns, used = selection.rows, selection.columns, selection.used
    batch, length, _ = hidden_states.shape
    residual = hidden_states[rows, columns]
    normed = layer.input_layernorm(hidden_states)
    query = attn.q_proj(normed[rows, columns]).view(*columns.shape, -1, attn.head_dim)
    key = attn.k_proj(normed).view(batch, length, -1, attn.head_dim)
    value = attn.v_proj(normed).view(batch, length, -1, attn.head_dim).transpose(1, 2)
    if hasattr(attn, "q_norm"):
        query, key = attn.q_norm(query), attn.k_norm(key)
    query, key = query.transpose(1, 2), key.transpose(1, 2)
    cos, sin = position_embeddings
    cos_q, sin_q = (t.expand(batch, -1, -1)[rows, columns] for t in (cos, sin))
    query = modeling.apply_rotary_pos_emb(query, query, cos_q, sin_q)[0]
    key = modeling.apply_rotary_pos_emb(key, key, cos, sin)[1]
    if attention_mask is None:
        keys = torch.arange(length, device=columns.device)
        mask = (keys[None, None, :] <= columns[:, :, None])[:, None]
    else:
        full = attention_mask.expand(batch, -1, -1, -1)[:, 0]
        mask = full[rows, columns][:, None]
    interface = attention_interface(attn.config._attn_implementation, modeling.eager_attention_forward)
    skipped = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", *CACHE_KEYWORDS)
    extra = {k: v for k, v in kwargs.items() if k not in skipped}
    output, _ = interface(
        attn, query, key, value, mask, dropout=0.0 if not attn.training else attn.attention_dropout,
        scaling=attn.scaling, sliding_window=None, **extra,
    )  # fmt: skip
    output = attn.o_proj(output.reshape(*columns.shape, -1).contiguous())
    hidden = residual + output
    hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    flat_rows, flat_columns = rows[used], columns[used]
    return hidden_states.new_zeros(hidden_states.shape).index_put((flat_rows, flat_columns), hidden[used])
