"""Sequence-level log-probabilities for offline preference trainers (DPO, KTO, ...).

These trainers score whole completions (chosen/rejected, desirable/undesirable) under the policy and a reference.
The helpers below (1) run several sequences through the model in one forward pass without spending compute on
padding ("packed" layouts with restarting `position_ids`), (2) return per-token values back in the ordinary padded
`(num_sequences, seq_len - 1)` shape so that loss code never has to know the layout, and (3) precompute reference
log-probabilities for a whole dataset once, storing them as dataset columns.
"""

import contextlib
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch
import torch.nn as nn

from ...import_utils import is_rich_available
from ...kernels.packed_attention import PACKED_SDPA, register_packed_sdpa
from ...models.utils import _base_transformers_model
from .forward_randomness import forward_is_deterministic
from .logprobs import compute_token_logps, model_accepts_argument


# Attention implementations whose masks are built from `position_ids` when no attention mask is given (transformers'
# `masking_utils` detects the restarting positions and builds a block-diagonal causal mask) or that run variable-length
# kernels. "varlen" ones cost nothing extra for one long row; the others build a dense mask per row. The per-sequence
# SDPA kernel is "varlen" when a one-row call carries the sequence boundaries ([`packed_forward_inputs`]); without them
# it is SDPA over the dense mask (correct, slower).
_VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3", "flex_attention", PACKED_SDPA)
_MASKED_ATTENTION = ("eager", "sdpa")
_PACKABLE_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def packed_attention_kind(model: nn.Module) -> str | None:
    """How `model` can attend within several sequences packed into one row, or None when it cannot.

    Packing needs a decoder-only model whose forward takes `position_ids` and whose mask is derived from them when no
    attention mask is given (every model built on transformers' `masking_utils`), and no recurrent/linear-attention
    layer (their state would leak from one packed sequence into the next).

    Args:
        model: The (possibly wrapped) causal language model.

    Returns:
        `"varlen"` for variable-length kernels (FlashAttention, flex attention, the per-sequence SDPA kernel a trainer
        swaps in: one long row is free), `"masked"` for
        eager/SDPA attention (a dense block-diagonal mask per row: rows should stay short), or None.
    """
    base = _base_transformers_model(model)
    config = getattr(base, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return None
    if not model_accepts_argument(model, "position_ids"):
        return None
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is not None and any(kind not in _PACKABLE_LAYER_TYPES for kind in layer_types):
        return None
    implementation = str(getattr(config, "_attn_implementation", None) or "eager")
    if implementation in _VARLEN_ATTENTION or "flash" in implementation:
        return "varlen"
    if implementation in _MASKED_ATTENTION:
        module = sys.modules.get(type(base).__module__)
        # Models that do not build their mask with `masking_utils` would ignore the restarting positions.
        if module is not None and hasattr(module, "create_causal_mask"):
            return "masked"
    return None


def packed_sdpa_applicable(model: nn.Module) -> bool:
    """Whether `model`'s SDPA attention can be swapped for [`~trl.kernels.packed_attention.packed_sdpa_attention_forward`]
    (per-sequence causal kernels on padding-free batches, SDPA itself on every other call).

    It can for a text-only transformers decoder (no vision or audio sub-model, whose encoders read their own sequence
    boundaries) that attends with `"sdpa"` and builds its masks with `masking_utils` ([`packed_attention_kind`]
    `"masked"`). PEFT adapters, DeepSpeed and FSDP leave the attention arithmetic alone, so they do not matter here.
    """
    base = _base_transformers_model(model)
    config = getattr(base, "config", None)
    if (
        config is None
        or getattr(config, "_attn_implementation", None) != "sdpa"
        or getattr(config, "sub_configs", None)
    ):
        return False
    return hasattr(base, "set_attn_implementation") and packed_attention_kind(model) == "masked"


@contextlib.contextmanager
def packed_sdpa_attention(model: nn.Module) -> Iterator[None]:
    """Within the block, `model` attends with the packed-sequence SDPA kernel when [`packed_sdpa_applicable`]; SDPA is
    restored afterwards (the implementation is not written to saved configs either). Re-entering the block (an
    evaluation inside training) leaves the outer one in charge."""
    if not packed_sdpa_applicable(model):
        yield
        return
    base = _base_transformers_model(model)
    base.set_attn_implementation(register_packed_sdpa())
    try:
        yield
    finally:
        base.set_attn_implementation("sdpa")


@contextlib.contextmanager
def plain_sdpa_attention(model: nn.Module) -> Iterator[None]:
    """Within the block, a model switched to the packed-sequence SDPA kernel by [`packed_sdpa_attention`] attends with
    plain SDPA (the same function on calls without sequence boundaries), for code that accepts only transformers' own
    implementation names (continuous batching); the packed kernel is back afterwards."""
    base = _base_transformers_model(model)
    config = getattr(base, "config", None)
    if getattr(config, "_attn_implementation", None) != PACKED_SDPA:
        yield
        return
    base.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        base.set_attn_implementation(register_packed_sdpa())


class PackedSequences(NamedTuple):
    """Sequences of a right- or left-padded batch packed into rows, as built by [`pack_padded_sequences`].

    Attributes:
        input_ids: `(rows, width)` packed token ids (trailing free slots hold the pad id).
        position_ids: `(rows, width)` positions restarting at 0 for every sequence (free slots form their own run).
        src_row: `(num_tokens,)` row of each real token in the padded batch.
        src_col: `(num_tokens,)` column of each real token in the padded batch.
        dst_row: `(num_tokens,)` row of that token in the packed layout.
        dst_col: `(num_tokens,)` column of that token in the packed layout.
        offset: `(num_tokens,)` index of the token inside its own sequence.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    src_row: torch.Tensor
    src_col: torch.Tensor
    dst_row: torch.Tensor
    dst_col: torch.Tensor
    offset: torch.Tensor

    def pack_next_token(self, values: torch.Tensor, fill: Any = 0) -> torch.Tensor:
        """Move a padded next-token tensor `(batch, seq_len - 1, ...)` into the packed `(rows, width - 1, ...)` layout.

        Entry `t` of a sequence refers to predicting its token `t + 1`, so only tokens with `offset >= 1` carry a
        value; the first token of every sequence is never a target (nothing precedes it in its own sequence).
        """
        rows, width = self.input_ids.shape
        out = values.new_full((rows, width - 1, *values.shape[2:]), fill)
        keep = self.offset >= 1
        out[self.dst_row[keep], self.dst_col[keep] - 1] = values[self.src_row[keep], self.src_col[keep] - 1]
        return out

    def unpack_next_token(self, packed: torch.Tensor, shape: tuple[int, int], fill: Any = 0) -> torch.Tensor:
        """Inverse of [`pack_next_token`]: a packed `(rows, width - 1, ...)` tensor back to the padded `shape`."""
        out = packed.new_full((*shape, *packed.shape[2:]), fill)
        keep = self.offset >= 1
        out[self.src_row[keep], self.src_col[keep] - 1] = packed[self.dst_row[keep], self.dst_col[keep] - 1]
        return out


def pack_padded_sequences(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    capacity: int | None = None,
    pad_token_id: int = 0,
    pad_to_multiple_of: int | None = None,
    min_width: int | None = None,
) -> PackedSequences:
    """Pack the sequences of a padded batch into as few rows as possible, without padding between them.

    With `capacity=None` every sequence goes into a single row (the best layout for variable-length attention
    kernels). With a capacity, sequences are placed first-fit-decreasing into rows of at most `capacity` tokens
    (`capacity` is raised to the longest sequence if needed), which bounds the size of dense attention masks. Each
    sequence must be contiguous in its padded row (right or left padding).

    Args:
        input_ids: `(batch, seq_len)` padded token ids.
        attention_mask: `(batch, seq_len)` mask of real tokens.
        capacity: Maximum row length, or None for a single row.
        pad_token_id: Id written into unused slots at the end of rows.
        pad_to_multiple_of: Round the packed width up to a multiple of this value.
        min_width: Make the rows at least this wide (free slots at the end), e.g. to give two packed batches the same
            width (see [`common_packed_width`]).

    Returns:
        [`PackedSequences`].

    Example:
    ```python
    >>> ids = torch.tensor([[1, 2, 3], [4, 5, 0]])
    >>> packed = pack_padded_sequences(ids, ids != 0)
    >>> packed.input_ids, packed.position_ids
    (tensor([[1, 2, 3, 4, 5]]), tensor([[0, 1, 2, 0, 1]]))
    ```
    """
    mask = attention_mask.bool()
    lengths = mask.sum(dim=1)
    length_list = lengths.tolist()
    # Destination (row, start) of every sequence.
    if capacity is None:
        starts = [0] * len(length_list)
        total = 0
        for index, length in enumerate(length_list):
            starts[index] = total
            total += length
        seq_rows = [0] * len(length_list)
        fills = [max(total, 1)]
    else:
        capacity = max(int(capacity), max(length_list, default=1), 1)
        fills: list[int] = []
        seq_rows = [0] * len(length_list)
        starts = [0] * len(length_list)
        for index in sorted(range(len(length_list)), key=lambda i: -length_list[i]):
            length = length_list[index]
            for row, fill in enumerate(fills):
                if fill + length <= capacity:
                    seq_rows[index], starts[index] = row, fill
                    fills[row] = fill + length
                    break
            else:
                seq_rows[index], starts[index] = len(fills), 0
                fills.append(length)
        if not fills:
            fills = [1]
    width = max(max(fills), 2)  # at least two columns so that a next-token position exists
    if pad_to_multiple_of:
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    width = max(width, min_width or 0)
    device = input_ids.device
    src_row, src_col = mask.nonzero(as_tuple=True)
    # Index of each token inside its sequence (works for left and right padding).
    offset = (mask.long().cumsum(dim=1) - 1)[src_row, src_col]
    seq_rows_t = torch.tensor(seq_rows, dtype=torch.long, device=device)
    starts_t = torch.tensor(starts, dtype=torch.long, device=device)
    dst_row = seq_rows_t[src_row]
    dst_col = starts_t[src_row] + offset
    rows = len(fills)
    packed_ids = input_ids.new_full((rows, width), pad_token_id)
    packed_ids[dst_row, dst_col] = input_ids[src_row, src_col]
    # Free slots count up from 0 after the last sequence of each row, forming a separate run nothing attends to.
    fill_t = torch.tensor(fills, dtype=torch.long, device=device).unsqueeze(1)
    columns = torch.arange(width, device=device).unsqueeze(0)
    position_ids = (columns - fill_t).clamp(min=0).expand(rows, width).clone()
    position_ids[dst_row, dst_col] = offset
    return PackedSequences(packed_ids, position_ids, src_row, src_col, dst_row, dst_col, offset)


# Packing only pays when it saves at least this share of the padded batch's positions: below, its own costs (the
# block-diagonal masks built from `position_ids`, the gathers in and out) eat the saving. Rows of similar lengths, as
# in most reward batches, save nothing with eager/SDPA attention (no two sequences fit in one row).
# `benchmarks/bench_drop_padding.py` (28M reward model, 8 x 256): 12.5 % of the positions saved ran 0.99x the padded
# step's CPU time, 25 % 0.80x, 37.5 % 0.79x (docs/benchmarks.md).
MIN_SAVED_SHARE = 0.15


def drop_padding(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    min_saved_share: float | None = None,
) -> PackedSequences | None:
    """The sequences of a padded batch packed for `model` (see [`pack_padded_sequences`]), or None when packing would
    save less than `min_saved_share` (default `MIN_SAVED_SHARE`) of the batch's positions, the model cannot attend
    within packed sequences ([`packed_attention_kind`]) or its forward draws random numbers (dropout, NEFTune's noise:
    [`~trl.trainer.utils.forward_randomness.forward_is_deterministic`]), which would be drawn per packed position.

    Variable-length kernels and the per-sequence SDPA kernel ([`packed_sdpa_attention`]) get one row (pass
    [`packed_forward_inputs`] to the model: that kernel reads the sequence boundaries); eager/SDPA attention gets
    rows no longer than the longest sequence, so the dense block-diagonal masks stay as small as the padded batch's
    (and only the rows that packing empties are saved).
    """
    kind = packed_attention_kind(model)
    if kind is None or bool(attention_mask.all()) or not forward_is_deterministic(model):
        return None
    capacity = None if kind == "varlen" else int(attention_mask.sum(dim=1).max().item())
    packed = pack_padded_sequences(input_ids, attention_mask, capacity)
    share = MIN_SAVED_SHARE if min_saved_share is None else min_saved_share
    if packed.input_ids.numel() > (1 - share) * input_ids.numel():
        return None
    return packed


def packed_forward_inputs(packed: PackedSequences) -> dict[str, Any]:
    """The model inputs of packed sequences: ids, restarting positions and, for one row, the sequence boundaries
    ([`sequence_boundaries`]) that variable-length kernels and the per-sequence SDPA kernel read."""
    inputs = {"input_ids": packed.input_ids, "position_ids": packed.position_ids}
    if packed.input_ids.shape[0] == 1:
        inputs.update(sequence_boundaries(packed.position_ids))
    return inputs


def classifier_call_hooked(model: nn.Module) -> bool:
    """Whether calling `model` runs forward hooks (its own, those of the transformers model it wraps, or global ones)
    that calling its backbone and score head directly would skip: the pooled-score fast paths then step aside."""
    from torch.nn.modules import module as torch_module

    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in (model, _base_transformers_model(model)))


def sequence_scores_without_padding(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    min_saved_share: float | None = None,
) -> torch.Tensor | None:
    """The pooled logits `(batch, num_labels)` of a `*ForSequenceClassification` model on a padded batch, computed on
    the packed sequences ([`drop_padding`]) instead: the backbone runs without padding, and the score head only at
    the token the model pools (the last one that is not the pad token, as transformers' classification heads read it).

    Returns None (run the model as usual) when packing saves less than `min_saved_share` of the positions (see
    [`drop_padding`]), or the model is not a plain transformers sequence classifier whose backbone can attend within
    packed sequences (also when it is wrapped for distributed training, whose hooks live on the outer module), or
    calling it runs forward hooks ([`classifier_call_hooked`]). PEFT adapters injected into the backbone and head
    still apply.
    """
    if hasattr(model, "module") or classifier_call_hooked(model):
        return None
    base = _base_transformers_model(model)
    config = getattr(base, "config", None)
    pad_token_id = getattr(config, "pad_token_id", None)
    backbone = getattr(base, getattr(base, "base_model_prefix", ""), None)
    score = getattr(base, "score", None)
    if not type(base).__name__.endswith("ForSequenceClassification") or backbone is None or score is None:
        return None
    if pad_token_id is None or getattr(config, "problem_type", None) not in (None, "regression"):
        return None
    packed = drop_padding(model, input_ids, attention_mask, min_saved_share)
    if packed is None:
        return None
    hidden = backbone(**packed_forward_inputs(packed), use_cache=False)[0]
    # The pooled token of each row, as the model picks it: the rightmost token that is not the pad token.
    columns = torch.arange(input_ids.shape[1], device=input_ids.device)
    pooled_col = (columns * (input_ids != pad_token_id)).argmax(dim=-1)
    # Where that token went in the packed layout.
    lookup = torch.full_like(input_ids, -1)
    lookup[packed.src_row, packed.src_col] = torch.arange(packed.src_row.shape[0], device=input_ids.device)
    token = lookup[torch.arange(input_ids.shape[0], device=input_ids.device), pooled_col]
    if bool((token < 0).any()):  # the pooled token is padding (e.g. pad id inside the text): keep the plain path
        return None
    return score(hidden[packed.dst_row[token], packed.dst_col[token]])


class SequenceTokenLogps(NamedTuple):
    """Result of [`compute_sequence_token_logps`], always in the padded layout of the input.

    Attributes:
        logps: `(batch, seq_len - 1)` log-probability of each next token; 0 outside `target_mask`.
        entropy: Same shape, entropy of the predicted distribution (None unless requested).
        stats: Dict of extra `(batch, seq_len - 1)` per-token tensors from `logits_stats_fn` (empty when not given).
        outputs: The model's raw outputs (for `aux_loss` of mixture-of-experts models).
    """

    logps: torch.Tensor
    entropy: torch.Tensor | None
    stats: dict[str, torch.Tensor]
    outputs: Any


def sequence_boundaries(position_ids: torch.Tensor) -> dict[str, Any]:
    """The sequence boundaries of one packed row, in the keyword arguments variable-length attention reads
    (`cu_seq_lens_q` / `cu_seq_lens_k`, `max_length_q` / `max_length_k`): a sequence starts wherever the positions
    restart at 0 (free slots at the end form sequences of their own, as the packing lays them out).

    Args:
        position_ids: `(1, width)` positions of a packed row.

    Returns:
        The four keyword arguments, as the padding-free SFT collator passes them.
    """
    starts = (position_ids[0] == 0).nonzero().flatten().to(torch.int32)
    width = torch.tensor([position_ids.shape[1]], dtype=torch.int32, device=position_ids.device)
    cu_seq_lens = torch.cat([starts, width])
    longest = int((cu_seq_lens[1:] - cu_seq_lens[:-1]).max()) if starts.numel() else 0
    return {
        "cu_seq_lens_q": cu_seq_lens,
        "cu_seq_lens_k": cu_seq_lens.clone(),
        "max_length_q": longest,
        "max_length_k": longest,
    }


def compute_sequence_token_logps(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    target_mask: torch.Tensor,
    layout: str = "padded",
    pad_token_id: int = 0,
    pad_to_multiple_of: int | None = None,
    compute_entropy: bool = False,
    logits_stats_fn: Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]] | None = None,
    min_width: int | None = None,
    **forward_kwargs: Any,
) -> SequenceTokenLogps:
    """Per-token log-probs of a padded batch of sequences, computed in one forward pass in the chosen layout.

    Args:
        model: Causal LM.
        input_ids: `(batch, seq_len)` padded token ids.
        attention_mask: `(batch, seq_len)` mask of real tokens.
        target_mask: `(batch, seq_len - 1)` bool mask of the next-token positions to score.
        layout: `"padded"` (the batch as is), `"packed"` (sequences packed first-fit into rows no longer than the
            longest sequence: no padding compute, dense masks stay small) or `"padding_free"` (everything in one row;
            best with variable-length attention kernels). See [`packed_attention_kind`] for which models can pack.
        pad_token_id: Id used for free slots of packed rows.
        pad_to_multiple_of: Round packed row widths up to a multiple of this value.
        compute_entropy: Also return per-token entropies.
        logits_stats_fn: Optional `f(logits, targets) -> dict[str, Tensor]` evaluated without gradients on the logits
            the model returned (`(rows, positions, vocab)`) and their target ids (`(rows, positions)`); each returned
            tensor must have the shape of `targets` and is handed back in the padded layout. Use it for metrics that
            need the full distribution (mean logit, argmax accuracy, ...).
        min_width: Packed layouts: make the rows at least this wide (see [`common_packed_width`]).
        **forward_kwargs: Extra arguments for the model's forward.

    Returns:
        [`SequenceTokenLogps`].
    """
    if layout not in ("padded", "packed", "padding_free"):
        raise ValueError(f"layout must be 'padded', 'packed' or 'padding_free'; got {layout!r}.")
    target_mask = target_mask.bool()
    packed = None
    if layout == "padded":
        ids, mask, positions_ids, targets_mask = input_ids, attention_mask, None, target_mask
    else:
        capacity = _layout_capacity(attention_mask, layout)
        packed = pack_padded_sequences(
            input_ids, attention_mask, capacity, pad_token_id, pad_to_multiple_of, min_width
        )
        ids, mask, positions_ids = packed.input_ids, None, packed.position_ids
        targets_mask = packed.pack_next_token(target_mask, False)
        if ids.shape[0] == 1 and "cu_seq_lens_q" not in forward_kwargs:
            forward_kwargs = {**sequence_boundaries(positions_ids), **forward_kwargs}
    result = compute_token_logps(
        model,
        ids,
        attention_mask=mask,
        position_ids=positions_ids,
        target_mask=targets_mask,
        compute_entropy=compute_entropy,
        logits_stats_fn=logits_stats_fn,
        **forward_kwargs,
    )
    stats = result.stats
    logps, entropy = result.logps, result.entropy
    if packed is not None:
        shape = (input_ids.shape[0], input_ids.shape[1] - 1)
        logps = packed.unpack_next_token(logps, shape)
        entropy = packed.unpack_next_token(entropy, shape) if entropy is not None else None
        stats = {name: packed.unpack_next_token(value, shape) for name, value in stats.items()}
    return SequenceTokenLogps(logps=logps, entropy=entropy, stats=stats, outputs=result.outputs)


def _layout_capacity(attention_mask: torch.Tensor, layout: str) -> int | None:
    """Row capacity of a packed layout: one row (`padding_free`) or rows no longer than the longest sequence."""
    return None if layout == "padding_free" else int(attention_mask.sum(dim=1).max().item())


def common_packed_width(
    attention_masks: list[torch.Tensor], layout: str, pad_to_multiple_of: int | None = None
) -> int:
    """The row width that fits every one of several padded batches packed in `layout` (`"packed"` or
    `"padding_free"`, as in [`compute_sequence_token_logps`]).

    Passing it as `min_width` packs each batch into rows of the same width: rows of one can then run in a forward
    pass with rows of another and give the same bits as in a pass of their own (the width of a row changes the
    summation order of attention, its number of rows does not).
    """
    width = 2
    for mask in attention_masks:
        capacity = _layout_capacity(mask, layout)
        packed = pack_padded_sequences(mask.long(), mask, capacity, 0, pad_to_multiple_of)
        width = max(width, packed.input_ids.shape[1])
    return width


def packed_sequence_logps_in_one_pass(
    model: nn.Module,
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    layout: str,
    pad_token_id: int = 0,
    pad_to_multiple_of: int | None = None,
) -> list[torch.Tensor]:
    """Per-token log-probs of several padded batches in one forward pass of `model`, each one packed on its own.

    Each part is packed as [`compute_sequence_token_logps`] packs it alone with
    `min_width=common_packed_width(...)` of all parts, and the rows of all parts are stacked: every real token sees
    the same keys at the same positions in a row of the same width as in that call, and gets the same value while
    the model is called once. Used for gradient-free passes (KTO's reference over its main and its KL rows).

    Args:
        model: Causal LM whose attention keeps packed sequences apart ([`packed_attention_kind`]).
        parts: `(input_ids, attention_mask, target_mask)` of each padded batch; `target_mask` is `(batch, seq_len - 1)`.
        layout: `"packed"` (rows no longer than the part's longest sequence) or `"padding_free"` (one row per part).
        pad_token_id: Id used for free slots.
        pad_to_multiple_of: Round each part's packed width up to a multiple of this value.

    Returns:
        The `(batch, seq_len - 1)` log-probs of each part, in its padded layout (0 outside its `target_mask`).
    """
    if layout not in ("packed", "padding_free"):
        raise ValueError(f"layout must be 'packed' or 'padding_free'; got {layout!r}.")
    width = common_packed_width([mask for _, mask, _ in parts], layout, pad_to_multiple_of)
    packs = [
        pack_padded_sequences(ids, mask, _layout_capacity(mask, layout), pad_token_id, pad_to_multiple_of, width)
        for ids, mask, _ in parts
    ]
    logps = compute_token_logps(
        model,
        torch.cat([pack.input_ids for pack in packs]),
        position_ids=torch.cat([pack.position_ids for pack in packs]),
        target_mask=torch.cat(
            [pack.pack_next_token(target.bool(), False) for pack, (_, _, target) in zip(packs, parts)]
        ),
    ).logps
    out, start = [], 0
    for pack, (input_ids, _, _) in zip(packs, parts, strict=True):
        rows = pack.input_ids.shape[0]
        shape = (input_ids.shape[0], input_ids.shape[1] - 1)
        out.append(pack.unpack_next_token(logps[start : start + rows], shape))
        start += rows
    return out


def precompute_reference_logps(
    dataset: Any,
    data_collator: Callable[[list[dict[str, Any]]], dict[str, Any]],
    compute_fn: Callable[[dict[str, Any]], dict[str, torch.Tensor]],
    batch_size: int,
    accelerator: Any = None,
    num_workers: int = 0,
    desc: str = "Computing reference log-probs",
) -> Any:
    """Evaluate `compute_fn` on every example of `dataset` once and store the results as new dataset columns.

    Used by trainers that can compute reference log-probabilities before training (`precompute_ref_log_probs=True`)
    so that the reference model is not needed afterwards. The dataset is read in order (no shuffling), split across
    processes when an accelerator is given, and the per-example values are gathered back in dataset order, so every
    process gets the same columns.

    Args:
        dataset: A map-style `datasets.Dataset` (streaming datasets cannot get new columns).
        data_collator: Turns a list of examples into the batch `compute_fn` expects.
        compute_fn: `f(batch) -> {column_name: (batch_size,) tensor}`; called under `torch.no_grad()`.
        batch_size: Examples per forward pass (per process).
        accelerator: Optional `accelerate.Accelerator` used to shard the work and move batches to the device.
        num_workers: DataLoader worker processes.
        desc: Progress-bar description.

    Returns:
        The dataset with one float column per key returned by `compute_fn` (existing columns of that name replaced).
    """
    from datasets import Dataset
    from torch.utils.data import DataLoader

    if not isinstance(dataset, Dataset):
        raise ValueError(
            f"Reference log-probs can only be precomputed for a map-style datasets.Dataset, got "
            f"{type(dataset).__name__}. Materialise the dataset (e.g. Dataset.from_list(list(streaming_dataset))) or "
            "set precompute_ref_log_probs=False."
        )
    loader = DataLoader(
        dataset, batch_size=batch_size, collate_fn=data_collator, shuffle=False, num_workers=num_workers
    )
    if accelerator is not None:
        loader = accelerator.prepare(loader)
    device = accelerator.device if accelerator is not None else None
    collected: dict[str, list[torch.Tensor]] = {}
    iterator: Iterable = loader
    if is_rich_available() and (accelerator is None or accelerator.is_main_process) and len(loader) > 1:
        try:
            from rich.progress import track

            iterator = track(loader, description=desc, transient=True)
        except Exception:  # progress display is optional
            iterator = loader
    with torch.no_grad():
        for batch in iterator:
            if device is not None:
                batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
            values = compute_fn(batch)
            if accelerator is not None:
                values = accelerator.gather_for_metrics(values)
            for name, value in values.items():
                collected.setdefault(name, []).append(value.detach().float().cpu())
    for name, chunks in collected.items():
        column = torch.cat(chunks).tolist()
        if len(column) != len(dataset):
            raise RuntimeError(
                f"Precomputing {name!r} produced {len(column)} values for {len(dataset)} examples; the dataloader "
                "must visit every example exactly once."
            )
        if name in dataset.column_names:
            dataset = dataset.remove_columns(name)
        dataset = dataset.add_column(name, column)
    return dataset
