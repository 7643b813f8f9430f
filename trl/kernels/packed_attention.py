"""Causal attention over packed sequences without a dense block-diagonal mask.

A padding-free batch is one row holding several sequences, with their boundaries in `cu_seq_lens_q` /
`cu_seq_lens_k` (the keys FlashAttention's variable-length kernels read). Transformers' SDPA path ignores those
boundaries and instead builds an `L x L` block-diagonal mask from the restarting `position_ids`, then runs the masked
kernel over the whole row: for 8 rows of 512 tokens packed into one row of 4096, that is ~14x the attention work the
sequences need (the sum of their squared lengths), and the masked kernel is slower per element than the causal one.

[`packed_sdpa_attention_forward`] runs `scaled_dot_product_attention(..., is_causal=True)` on each sequence of the
row instead (torch's fused causal kernel, no mask), and is plain SDPA attention whenever no sequence boundaries are
given. Within [`attend_after_prefixes`], a packed row of continuations attends each sequence to the keys/values of
its own prefix (recorded from an earlier pass by [`capture_keys_values`]) and causally to itself, so that
continuations of different prefixes run together without padding or a cache. [`register_packed_sdpa`] makes it
available to transformers under the name [`PACKED_SDPA`] (with SDPA's mask builder), so a model switched to it
computes exactly what SDPA computes, up to float rounding.
"""

import contextlib
import contextvars
from collections.abc import Iterator

import torch
import torch.nn.functional as F


PACKED_SDPA = "trl_packed_sdpa"
# Set by [`capture_keys_values`]: receives `(module, key, value)` of every call of the attention function.
_KEY_VALUE_SINK: contextvars.ContextVar = contextvars.ContextVar("trl_key_value_sink", default=None)
# Set by [`attend_after_prefixes`]: the prefixes the sequences of a packed row continue.
_PREFIXES: contextvars.ContextVar = contextvars.ContextVar("trl_prefixes", default=None)


@contextlib.contextmanager
def capture_keys_values() -> Iterator[dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """Within the block, [`packed_sdpa_attention_forward`] records the key and value states it receives (after the
    rotary embedding, before grouped-query repetition; detached, not copied) under the layer's `layer_idx`.

    Only a layer's first call is kept, so a gradient-checkpointing recompute (which runs in backward, normally after
    the block anyway) cannot overwrite what the forward pass saw. Layers without a `layer_idx` are not recorded.

    Yields:
        `{layer_idx: (key, value)}`, filled while the block runs; each `(batch, kv_heads, seq_len, head_dim)`.
    """
    captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def sink(module: torch.nn.Module, key: torch.Tensor, value: torch.Tensor) -> None:
        layer = getattr(module, "layer_idx", None)
        if layer is not None and layer not in captured:
            captured[layer] = (key.detach(), value.detach())

    token = _KEY_VALUE_SINK.set(sink)
    try:
        yield captured
    finally:
        _KEY_VALUE_SINK.reset(token)


@contextlib.contextmanager
def attend_after_prefixes(
    prefixes: dict[int, tuple[torch.Tensor, torch.Tensor]], prefix_lengths: list[int], bounds: list[int]
) -> Iterator[None]:
    """Within the block, [`packed_sdpa_attention_forward`] treats a one-row call of `bounds[-1]` tokens as packed
    continuations: sequence `i` (tokens `bounds[i]:bounds[i + 1]` of the row) attends to the first
    `prefix_lengths[i]` keys/values of row `i` of `prefixes[layer_idx]` and causally to itself, as it would in a
    forward pass over prefix and continuation together. No cache, no padding and no dense mask are involved.

    Args:
        prefixes: `{layer_idx: (key, value)}`, each `(sequences, kv_heads, max_prefix_len, head_dim)`, post-RoPE
            (as [`capture_keys_values`] records them, gathered per sequence).
        prefix_lengths: The prefix length of each sequence.
        bounds: Start offsets of the sequences in the row, plus the total.
    """
    token = _PREFIXES.set((prefixes, prefix_lengths, bounds))
    try:
        yield
    finally:
        _PREFIXES.reset(token)


def _attend_after_prefixes(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    dropout: float,
) -> torch.Tensor:
    """Each packed sequence attends to its prefix and causally to itself (see [`attend_after_prefixes`])."""
    from transformers.integrations.sdpa_attention import repeat_kv

    prefixes, lengths, bounds = _PREFIXES.get()
    prefix_keys, prefix_values = prefixes[module.layer_idx]
    groups = getattr(module, "num_key_value_groups", 1)
    pieces = []
    # Split, not sliced (see `packed_sdpa_attention_forward`).
    owns = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    splits = zip(query.split(owns, dim=2), key.split(owns, dim=2), value.split(owns, dim=2))
    for row, (own, (own_query, own_key, own_value)) in enumerate(zip(owns, splits)):
        if own == 0:
            continue
        past = lengths[row]
        keys = torch.cat([prefix_keys[row : row + 1, :, :past], own_key], dim=2)
        values = torch.cat([prefix_values[row : row + 1, :, :past], own_value], dim=2)
        grouped = groups > 1 and _grouped_query_attention_applies(query, keys, values)
        if groups > 1 and not grouped:
            keys, values = repeat_kv(keys, groups), repeat_kv(values, groups)
        # Query t sees the whole prefix and its own tokens up to t.
        allowed = torch.ones(own, past + own, dtype=torch.bool, device=query.device).tril(diagonal=past)
        pieces.append(
            F.scaled_dot_product_attention(
                own_query,
                keys,
                values,
                attn_mask=allowed,
                dropout_p=dropout,
                scale=scaling,
                enable_gqa=grouped,
            )
        )
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2)


_GROUPED_QUERY_MATCHES_EXPANDED: bool | None = None


def _grouped_query_matches_expanded() -> bool:
    """Whether this torch build's CPU SDPA gives, in grouped-query mode (`enable_gqa`), bitwise the outputs it gives
    over keys and values repeated per query head, causal and with a mask (checked once per process)."""
    global _GROUPED_QUERY_MATCHES_EXPANDED
    if _GROUPED_QUERY_MATCHES_EXPANDED is None:
        generator = torch.Generator().manual_seed(0)
        query = torch.randn(1, 8, 37, 16, generator=generator)
        key, value = torch.randn(2, 1, 2, 45, 16, generator=generator)
        expanded_key, expanded_value = key.repeat_interleave(4, dim=1), value.repeat_interleave(4, dim=1)
        allowed = torch.ones(37, 45, dtype=torch.bool).tril(diagonal=8)
        same = True
        with torch.no_grad():
            for keys, values, expanded_keys, expanded_values, mask, causal in (
                (key[:, :, :37], value[:, :, :37], expanded_key[:, :, :37], expanded_value[:, :, :37], None, True),
                (key, value, expanded_key, expanded_value, allowed, False),
            ):
                grouped = F.scaled_dot_product_attention(
                    query, keys, values, attn_mask=mask, is_causal=causal, enable_gqa=True
                )
                plain = F.scaled_dot_product_attention(
                    query, expanded_keys, expanded_values, attn_mask=mask, is_causal=causal
                )
                same = same and torch.equal(grouped, plain)
        _GROUPED_QUERY_MATCHES_EXPANDED = same
    return _GROUPED_QUERY_MATCHES_EXPANDED


def _grouped_query_attention_applies(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether to attend with SDPA's grouped-query mode instead of keys and values repeated per query head: for CPU
    tensors without gradients (no reference or rollout pass keeps the repeated copies then), when this build gives
    bitwise the same outputs. With gradients, the keys' and values' gradients would differ in the last bits from the
    repeated copies' summed ones, so training passes repeat them as transformers does."""
    if query.device.type != "cpu":
        return False
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return False
    return _grouped_query_matches_expanded()


def _sequence_bounds(query: torch.Tensor, key: torch.Tensor, kwargs: dict) -> list[int] | None:
    """The start offsets (plus the total) of the packed sequences, or None when the call is not a packed one."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None or cu_k is None or query.shape[0] != 1:
        return None
    if cu_q is not cu_k and not torch.equal(cu_q, cu_k):
        return None  # cross-attention between different layouts
    bounds = cu_q.tolist()
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != query.shape[2] or key.shape[2] != query.shape[2]:
        return None
    return bounds


def packed_sdpa_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Transformers attention function: per-sequence causal SDPA for packed rows, plain SDPA otherwise.

    The packed path runs when the call carries `cu_seq_lens_q` / `cu_seq_lens_k` (equal) covering one row, the layer
    is causal, and nothing else shapes the scores (no dropout, sliding window, soft-capping or position bias); the
    dense `attention_mask` is then not read, since the boundaries say the same.

    Args:
        module: The attention layer (`num_key_value_groups` gives the grouped-query factor).
        query: `(batch, heads, seq_len, head_dim)`.
        key: `(batch, kv_heads, seq_len, head_dim)`.
        value: `(batch, kv_heads, seq_len, head_dim)`.
        attention_mask: The mask transformers built for SDPA (used on the fallback path only).
        dropout: Attention dropout probability.
        scaling: Score scale (default `head_dim ** -0.5`).
        is_causal: Overrides the layer's `is_causal`.
        **kwargs: The layer's extra attention arguments (`cu_seq_lens_q`, `sliding_window`, ...).

    Returns:
        `(attn_output, None)` with `attn_output` of shape `(batch, seq_len, heads, head_dim)`, as SDPA's.
    """
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    sink = _KEY_VALUE_SINK.get()
    if sink is not None:
        sink(module, key, value)
    prefixes = _PREFIXES.get()
    if prefixes is not None:
        if query.shape[0] != 1 or query.shape[2] != prefixes[2][-1] or key.shape[2] != query.shape[2]:
            raise RuntimeError(
                f"attend_after_prefixes expects one packed row of {prefixes[2][-1]} tokens; the attention got queries "
                f"{tuple(query.shape)} and keys {tuple(key.shape)}."
            )
        attn_output = _attend_after_prefixes(module, query, key, value, scaling, dropout)
        return attn_output.transpose(1, 2).contiguous(), None
    causal = (is_causal if is_causal is not None else getattr(module, "is_causal", True)) and query.shape[2] > 1
    shaped = any(kwargs.get(name) is not None for name in ("sliding_window", "softcap", "position_bias"))
    bounds = _sequence_bounds(query, key, kwargs) if causal and not shaped and dropout == 0.0 else None
    if bounds is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    groups = getattr(module, "num_key_value_groups", 1)
    grouped = groups > 1 and _grouped_query_attention_applies(query, key, value)
    if groups > 1 and not grouped:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    # Split, not sliced: the backward pass of a split concatenates the pieces' gradients once, where each slice's
    # would be a zero-filled tensor of the whole row, added up piece after piece.
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    pieces = [
        F.scaled_dot_product_attention(
            query_piece, key_piece, value_piece, is_causal=True, scale=scaling, enable_gqa=grouped
        )
        for query_piece, key_piece, value_piece, length in zip(
            query.split(lengths, dim=2), key.split(lengths, dim=2), value.split(lengths, dim=2), lengths
        )
        if length
    ]
    attn_output = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2)
    return attn_output.transpose(1, 2).contiguous(), None


def register_packed_sdpa() -> str:
    """Registers [`packed_sdpa_attention_forward`] with transformers as [`PACKED_SDPA`] (idempotent); returns the name.

    Its masks are SDPA's, so every call that is not a packed one (padded batches, generation, evaluation) is SDPA's.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention_forward)
    AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)
    return PACKED_SDPA
