"""Shared-prefix forward passes: rows that begin with the same tokens (a DPO pair's chosen and rejected sequences, a
reward pair, a KTO example and its KL completion) run their common prefix once.

The rows of a group become one sequence `[prefix | suffix_1 | suffix_2 | ...]` with a 4D attention mask (a suffix sees
the prefix and its own earlier tokens, never another suffix) and position ids where every suffix continues from the
prefix's length, so each token gets exactly the keys and positions it has in its own row. Per-row values are then
gathered back: the prediction of a suffix's first token sits at the prefix's last position, shared by the group.
"""

import contextlib
import sys
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.nn as nn

from ...kernels.linear_log_softmax import linear_selective_log_softmax
from ...kernels.packed_attention import PACKED_SDPA, attend_after_prefixes, capture_keys_values
from ...models.utils import _base_transformers_model
from ..utils.distributed import parameters_sharded
from ..utils.forward_randomness import forward_is_deterministic
from ..utils.logprobs import capture_lm_head_inputs, fusable_lm_head, model_accepts_argument
from ..utils.packing import (
    SequenceTokenLogps,
    _layout_capacity,
    classifier_call_hooked,
    compute_sequence_token_logps,
    pack_padded_sequences,
)
from .last_layer_selection import last_layer_at


# Sharing pays only when it removes at least this share of the tokens the unshared (padding-free) pass computes:
# below, the dense per-group masks and the gathers cost about what the skipped tokens would.
MIN_SHARED_SAVING = 0.15
# Attention implementations that take a custom additive 4D mask with arbitrary position ids (the packed-sequence SDPA
# that training switches to is SDPA itself on calls without sequence boundaries).
_MASK_ATTENTION = ("eager", "sdpa", PACKED_SDPA)


class SharedPrefixLayout(NamedTuple):
    """Rows of a padded batch laid out as one `[prefix | suffixes]` sequence per group (see [`share_prefixes`]).

    Attributes:
        input_ids: `(groups, length)` token ids; pad positions hold `pad_token_id`.
        position_ids: `(groups, length)` positions; every suffix continues from its group's prefix length.
        segment_ids: `(groups, length)` 0 on the prefix, `i + 1` on the `i`-th suffix, -1 on padding.
        token_index: `(batch, seq_len)` flat index (`group * length + column`) of every real token of the padded
            batch in the shared layout, -1 on padding.
        saved_share: Share of the batch's real tokens that the shared layout does not compute.
        silent: `(groups, length)` True on the batch's own pad positions when the layout keeps them
            (`share_prefixes(..., keep_padding=True)`): each sees its row as a pad position of the padded batch does,
            and nothing attends to it. None otherwise.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segment_ids: torch.Tensor
    token_index: torch.Tensor
    saved_share: float
    silent: torch.Tensor | None = None

    def attention_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """The `(groups, 1, length, length)` additive mask: 0 where a query may attend to a key, `finfo.min` elsewhere.

        A suffix token attends to the prefix and to its own suffix up to itself; the layout's padding attends only to
        itself (so that no softmax row is empty) and nothing attends to it. A silent token (a kept pad position)
        attends to its row's real tokens, not to itself, as in the padded batch.
        """
        segments = self.segment_ids
        length = segments.shape[1]
        query, key = segments.unsqueeze(2), segments.unsqueeze(1)
        causal = torch.ones(length, length, dtype=torch.bool, device=segments.device).tril()
        allowed = causal & (query >= 0) & ((key == 0) | (key == query))
        if self.silent is not None:
            allowed &= ~self.silent.unsqueeze(1)
        allowed |= torch.eye(length, dtype=torch.bool, device=segments.device) & (query < 0)
        zeros = torch.zeros((), dtype=dtype, device=segments.device)
        return torch.where(allowed, zeros, torch.finfo(dtype).min).unsqueeze(1)

    def gather(self, values: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        """`values[group, column]` (a `(groups, length, ...)` tensor of the shared layout) at the tokens
        `(rows, columns)` of the padded batch."""
        flat = values.reshape(-1, *values.shape[2:])
        return flat[self.token_index[rows, columns]]


def _common_prefix_length(rows: list[list[int]]) -> int:
    first = rows[0]
    length = min(len(row) for row in rows)
    for row in rows[1:]:
        index = 0
        while index < length and row[index] == first[index]:
            index += 1
        length = index
    return length


def share_prefixes(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    groups: list[list[int]],
    pad_token_id: int = 0,
    keep_padding: bool = False,
) -> SharedPrefixLayout:
    """Lay out the rows of a padded batch as one `[prefix | suffix_1 | ...]` sequence per group of rows.

    The prefix of a group is the longest common token prefix of its rows' real tokens (whatever produced them: a
    tokenized prompt or a whole tokenized text); a row equal to the prefix gets an empty suffix. Groups are padded to
    the longest one.

    Args:
        input_ids: `(batch, seq_len)` token ids, each row's real tokens contiguous (left or right padding).
        attention_mask: `(batch, seq_len)` mask of real tokens.
        groups: Row indices of each group; every row of the batch in exactly one group.
        pad_token_id: Id written at the layout's pad positions.
        keep_padding: Also lay out each row's pad positions (right padding only), after its suffix, as silent tokens
            ([`SharedPrefixLayout.silent`]), for callers that read the padded batch's values at every position. The
            token index then covers every column and the saved share counts the pad positions.

    Returns:
        [`SharedPrefixLayout`].

    Example:
    ```python
    >>> ids = torch.tensor([[5, 6, 7, 0], [5, 6, 8, 9]])
    >>> layout = share_prefixes(ids, ids != 0, [[0, 1]])
    >>> layout.input_ids, layout.position_ids
    (tensor([[5, 6, 7, 8, 9]]), tensor([[0, 1, 2, 2, 3]]))
    ```
    """
    mask = attention_mask.bool()
    batch = input_ids.shape[0]
    if sorted(row for group in groups for row in group) != list(range(batch)):
        raise ValueError(f"Every row of the batch ({batch} rows) must be in exactly one group; got {groups}.")
    lengths = mask.sum(dim=1).tolist()
    starts = mask.long().argmax(dim=1).tolist()
    ids_list = input_ids.tolist()
    tokens = [ids_list[row][start : start + length] for row, (start, length) in enumerate(zip(starts, lengths))]
    if keep_padding and not right_padded(mask):
        raise ValueError(
            "keep_padding=True needs right-padded rows (real tokens first, then padding); got an attention mask with "
            f"padding before or between real tokens: {attention_mask.int().tolist()}. Pad on the right."
        )
    # Each row's tokens as laid out; with `keep_padding` its pad positions too, as the end of its suffix.
    laid_out = ids_list if keep_padding else tokens
    sequences, segments, positions, silences = [], [], [], []
    # Column in the shared layout of every row's first token after the prefix, and its group and prefix length.
    row_group, row_prefix, row_suffix_start = [0] * batch, [0] * batch, [0] * batch
    for group_index, group in enumerate(groups):
        prefix = _common_prefix_length([tokens[row] for row in group])
        sequence, segment = list(tokens[group[0]][:prefix]), [0] * prefix
        position, silence = list(range(prefix)), [False] * prefix
        for suffix_index, row in enumerate(group):
            suffix = laid_out[row][prefix:]
            row_group[row], row_prefix[row], row_suffix_start[row] = group_index, prefix, len(sequence)
            sequence += suffix
            segment += [suffix_index + 1] * len(suffix)
            position += range(prefix, prefix + len(suffix))
            silence += [index >= lengths[row] for index in range(prefix, prefix + len(suffix))]
        sequences.append(sequence)
        segments.append(segment)
        positions.append(position)
        silences.append(silence)
    width = max(2, max(len(sequence) for sequence in sequences))
    device = input_ids.device
    shared_ids = torch.full((len(groups), width), pad_token_id, dtype=input_ids.dtype)
    segment_ids = torch.full((len(groups), width), -1, dtype=torch.long)
    position_ids = torch.zeros((len(groups), width), dtype=torch.long)
    silent = torch.zeros((len(groups), width), dtype=torch.bool)
    for index, (sequence, segment, position) in enumerate(zip(sequences, segments, positions)):
        shared_ids[index, : len(sequence)] = torch.tensor(sequence, dtype=input_ids.dtype)
        segment_ids[index, : len(segment)] = torch.tensor(segment, dtype=torch.long)
        position_ids[index, : len(position)] = torch.tensor(position, dtype=torch.long)
        silent[index, : len(sequence)] = torch.tensor(silences[index], dtype=torch.bool)
    # Pad positions count on from the group's end (any value works: nothing attends to them).
    ends = torch.tensor([len(sequence) for sequence in sequences]).unsqueeze(1)
    pads = segment_ids < 0
    position_ids[pads] = (torch.arange(width).unsqueeze(0) - ends + 1).clamp(min=0).expand_as(position_ids)[pads]
    # Flat shared index of every real token (every position, keeping padding) of the padded batch.
    if keep_padding:
        mask = torch.ones_like(mask)
    offset = mask.long().cumsum(dim=1) - 1
    group_t = torch.tensor(row_group, device=device).unsqueeze(1)
    prefix_t = torch.tensor(row_prefix, device=device).unsqueeze(1)
    start_t = torch.tensor(row_suffix_start, device=device).unsqueeze(1)
    column = torch.where(offset < prefix_t, offset, start_t + offset - prefix_t)
    token_index = torch.where(mask, group_t * width + column, torch.full_like(column, -1))
    total = mask.numel() if keep_padding else sum(lengths)
    saved = 1.0 - sum(len(sequence) for sequence in sequences) / total if total else 0.0
    return SharedPrefixLayout(
        shared_ids.to(device),
        position_ids.to(device),
        segment_ids.to(device),
        token_index,
        saved,
        silent.to(device) if keep_padding else None,
    )


def supports_prefix_sharing(model: nn.Module | None, causal_lm: bool = True) -> bool:
    """Whether `model` can run shared-prefix layouts and give exactly the values of separate rows.

    It can when it is a decoder-only transformers model with eager or SDPA attention (they take a custom 4D mask;
    flash-attention variants do not), whose layers all use full attention (a sliding window would need its own mask),
    whose forward takes `position_ids`, and that is not wrapped for distributed training. A causal LM also needs an
    output head the fused LM head can stand in for ([`fusable_lm_head`]) so that no full logits are built.

    Args:
        model: The (possibly PEFT- or accelerate-wrapped) model, or None.
        causal_lm: Check the causal-LM head (False for sequence classifiers, whose score head is applied directly).
    """
    if model is None or isinstance(model, nn.parallel.DistributedDataParallel) or hasattr(model, "module"):
        return False
    base = _base_transformers_model(model)
    config = getattr(base, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return False
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is not None and any(kind != "full_attention" for kind in layer_types):
        return False
    if (
        layer_types is None
        and getattr(text_config, "sliding_window", None)
        and getattr(text_config, "use_sliding_window", True)
    ):
        return False
    if str(getattr(config, "_attn_implementation", None) or "eager") not in _MASK_ATTENTION:
        return False
    module = sys.modules.get(type(base).__module__)
    # Models that build their masks with transformers' `masking_utils` pass a prepared 4D mask through as is.
    if module is None or not hasattr(module, "create_causal_mask"):
        return False
    if not model_accepts_argument(model, "position_ids"):
        return False
    return not causal_lm or fusable_lm_head(model) is not None


def sharing_possible_now(model: nn.Module, causal_lm: bool = True) -> bool:
    """The part of [`supports_prefix_sharing`] that engines can change after the trainer is built: the model is not
    wrapped (DDP), its parameters are not sharded (FSDP, DeepSpeed ZeRO-3: their hooks gather them around the whole
    model's forward), a causal LM still has a head the fused LM head can replace, and its forward draws no random
    numbers (dropout, NEFTune's noise), which would be drawn per shared position
    ([`~trl.trainer.utils.forward_randomness.forward_is_deterministic`])."""
    if hasattr(model, "module") or not forward_is_deterministic(model):
        return False
    if parameters_sharded(model):
        return False
    return not causal_lm or fusable_lm_head(model) is not None


def _mask_dtype(model: nn.Module) -> torch.dtype:
    for parameter in model.parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    return torch.float32


def shared_prefix_token_logps(
    model: nn.Module,
    input_ids: torch.Tensor,
    layout: SharedPrefixLayout,
    target_mask: torch.Tensor,
    compute_entropy: bool = False,
    logits_stats_fn: Any = None,
    temperature: float = 1.0,
    final_hidden_states: bool = False,
) -> SequenceTokenLogps:
    """Per-token log-probs of a padded batch computed on its shared-prefix layout, in the batch's padded shape.

    The model runs once on the layout; the final hidden state that predicts each scored token of each row is
    gathered and goes through the fused LM head + log-softmax ([`linear_selective_log_softmax`]), so no
    full-vocabulary logits are built. Same result as [`compute_sequence_token_logps`] up to float rounding.

    Args:
        model: Causal LM accepted by [`supports_prefix_sharing`].
        input_ids: `(batch, seq_len)` padded token ids the layout was built from.
        layout: [`share_prefixes`] of `input_ids`.
        target_mask: `(batch, seq_len - 1)` bool mask of the next-token positions to score.
        compute_entropy: Also return per-token entropies.
        logits_stats_fn: Optional `f(logits, targets) -> dict` evaluated on the scored positions' logits.
        temperature: Logits are divided by this value before the softmax.
        final_hidden_states: Also hand back the final hidden states of every position of the padded batch, pad
            positions included, as `outputs.hidden_states = (states,)` (`(batch, seq_len, hidden)`); needs a layout
            that keeps the padding.

    Returns:
        [`SequenceTokenLogps`] (its `outputs.logits` is None).
    """
    if final_hidden_states and layout.silent is None:
        raise ValueError("final_hidden_states=True needs a layout built with share_prefixes(..., keep_padding=True).")
    rows, columns = target_mask.bool().nonzero(as_tuple=True)
    # Only the scored tokens' final hidden states are read (unless all are): the last layer runs on those alone.
    selected = None if final_hidden_states else layout.token_index[rows, columns]
    head, states, outputs = _final_hidden_states(model, layout, selected)
    # Entry t of a row predicts its token t + 1 from the hidden state of its token t.
    hidden = layout.gather(states, rows, columns)
    if final_hidden_states:
        outputs.hidden_states = (states.reshape(-1, states.shape[-1])[layout.token_index],)
    return _scored_logps(head, hidden, input_ids, rows, columns, target_mask.shape, outputs, compute_entropy,
        logits_stats_fn, temperature)  # fmt: skip


def shared_prefix_logits_at(
    model: nn.Module, layout: SharedPrefixLayout, rows: torch.Tensor, columns: torch.Tensor
) -> torch.Tensor:
    """The model's logits at the real tokens `(rows, columns)` of the padded batch `layout` was built from, computed
    on the shared-prefix layout: `rows.shape + (vocab,)`, the head run at those positions only. Same values as the
    padded batch's logits there up to float rounding.

    Args:
        model: Causal LM accepted by [`supports_prefix_sharing`].
        layout: [`share_prefixes`] of the padded batch.
        rows: Row of each position to read (any shape).
        columns: Column of each position to read, the same shape; each must be a real token of its row.
    """
    selected = layout.token_index[rows, columns]
    if bool((selected < 0).any()):
        raise ValueError("shared_prefix_logits_at reads real tokens only; some of the positions asked are padding.")
    head, states, _ = _final_hidden_states(model, layout, selected.flatten())
    return head(states.reshape(-1, states.shape[-1])[selected])


def _final_hidden_states(
    model: nn.Module, layout: SharedPrefixLayout, selected: torch.Tensor | None
) -> tuple[nn.Linear, torch.Tensor, Any]:
    """One forward of `model` on `layout` that stops at the LM head: the head, the `(groups, length, hidden)` final
    hidden states and the model's outputs. With `selected` (flat layout positions), the last layer runs at those
    positions only ([`last_layer_at`]), and the states elsewhere are not to be read."""
    head = fusable_lm_head(model)
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output head the fused LM head can replace.")
    length = layout.input_ids.shape[1]
    selection = contextlib.nullcontext() if selected is None else last_layer_at(model, selected, length)
    with capture_lm_head_inputs(head) as captured, selection:
        outputs = model(
            input_ids=layout.input_ids,
            attention_mask=layout.attention_mask(_mask_dtype(model)),
            position_ids=layout.position_ids,
            use_cache=False,
        )
    if len(captured) != 1:
        raise RuntimeError(f"The LM head ran {len(captured)} times in one forward pass.")
    return head, captured[0], outputs


def _scored_logps(
    head: nn.Linear,
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    rows: torch.Tensor,
    columns: torch.Tensor,
    shape: torch.Size,
    outputs: Any,
    compute_entropy: bool,
    logits_stats_fn: Any,
    temperature: float = 1.0,
) -> SequenceTokenLogps:
    """Fused LM head + log-softmax on the gathered `hidden` states that predict `input_ids[rows, columns + 1]`,
    scattered back into the padded `shape` (0 elsewhere; log-probs and entropies in the logits' dtype)."""
    logps, entropy, stats = linear_selective_log_softmax(
        hidden, head.weight, input_ids[rows, columns + 1], head.bias, temperature, compute_entropy, logits_stats_fn
    )

    def scatter(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return value.new_zeros(shape, dtype=dtype).index_put((rows, columns), value.to(dtype))

    dtype = torch.promote_types(hidden.dtype, head.weight.dtype)  # the dtype of the logits the head's product gives
    outputs.logits = None
    return SequenceTokenLogps(
        logps=scatter(logps, dtype),
        entropy=scatter(entropy, dtype) if entropy is not None else None,
        stats={name: scatter(value, value.dtype) for name, value in stats.items()},
        outputs=outputs,
    )


def shared_prefix_pooled_scores(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, layout: SharedPrefixLayout
) -> torch.Tensor:
    """The pooled scores `(batch, num_labels)` of a `*ForSequenceClassification` model, computed on the shared-prefix
    layout: the backbone runs once per group, the score head only at the token the model pools (the rightmost one
    that is not the pad id, see [`pooled_scores_share_safely`]).

    Args:
        model: Sequence classifier accepted by `supports_prefix_sharing(model, causal_lm=False)` with a `score` head.
        input_ids: `(batch, seq_len)` padded token ids the layout was built from.
        attention_mask: `(batch, seq_len)` mask of real tokens.
        layout: [`share_prefixes`] of the batch.
    """
    base = _base_transformers_model(model)
    backbone = getattr(base, base.base_model_prefix)
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    columns = _pooled_columns(input_ids, base.config.pad_token_id)
    # Only the pooled tokens' final hidden states are read: the last layer runs on those alone.
    with last_layer_at(model, layout.token_index[rows, columns], layout.input_ids.shape[1]):
        hidden = backbone(
            input_ids=layout.input_ids,
            attention_mask=layout.attention_mask(_mask_dtype(model)),
            position_ids=layout.position_ids,
            use_cache=False,
        )[0]
    return base.score(layout.gather(hidden, rows, columns))


def _pooled_columns(input_ids: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """Column of the rightmost token that is not the pad id in every row (what transformers' classifiers pool)."""
    columns = torch.arange(input_ids.shape[1], device=input_ids.device)
    return (columns * (input_ids != pad_token_id)).argmax(dim=-1)


def pooled_scores_share_safely(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> bool:
    """Whether the scores of a sequence classifier can come from [`shared_prefix_pooled_scores`]: a plain
    transformers `*ForSequenceClassification` with a `score` head and a regression (or default) problem type, whose
    pooled token (the rightmost one that is not the pad id) is a real token of every row, and calling which runs no
    forward hooks ([`~trl.trainer.utils.packing.classifier_call_hooked`])."""
    if classifier_call_hooked(model):
        return False
    base = _base_transformers_model(model)
    config = getattr(base, "config", None)
    pad_token_id = getattr(config, "pad_token_id", None)
    if not type(base).__name__.endswith("ForSequenceClassification") or getattr(base, "score", None) is None:
        return False
    if pad_token_id is None or getattr(config, "problem_type", None) not in (None, "regression"):
        return False
    if getattr(base, getattr(base, "base_model_prefix", ""), None) is None:
        return False
    pooled = _pooled_columns(input_ids, pad_token_id)
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    return bool(attention_mask.bool()[rows, pooled].all())


def paired_groups(batch: int) -> list[list[int]]:
    """Groups of a batch whose first half pairs row by row with its second half (`[chosen...; rejected...]`)."""
    half = batch // 2
    return [[row, row + half] for row in range(half)]


def same_prompt_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[list[int]]:
    """Rows grouped by identical real prompt tokens (padding ignored), groups in order of their first row.

    Rollout micro-batches may be shuffled, so a group's completions need not be adjacent."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for row, (ids, mask) in enumerate(zip(prompt_ids.tolist(), prompt_mask.tolist())):
        key = tuple(token for token, keep in zip(ids, mask) if keep)
        groups.setdefault(key, []).append(row)
    return list(groups.values())


def contiguous_rows(attention_mask: torch.Tensor) -> bool:
    """Whether every row's real tokens form one contiguous run (left and/or right padding only)."""
    mask = attention_mask.bool()
    columns = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    first = torch.where(mask, columns, mask.shape[1]).min(dim=1).values
    last = torch.where(mask, columns, -1).max(dim=1).values
    counts = mask.sum(dim=1)
    return bool(((counts == 0) | (last - first + 1 == counts)).all())


def right_padded(attention_mask: torch.Tensor) -> bool:
    """Whether every row starts with at least one real token and has nothing but padding after its real tokens."""
    mask = attention_mask.bool()
    return bool(mask[:, 0].all()) and torch.equal(mask, mask.cummin(dim=1).values)


class PrefixCachedLogps(NamedTuple):
    """Result of [`prefix_cached_token_logps`].

    Attributes:
        main: Per-token log-probs of the main rows ([`SequenceTokenLogps`], padded layout of the main batch).
        continuation_logps: `(batch, cont_len - 1)` log-probs of the continuation rows, detached.
    """

    main: SequenceTokenLogps
    continuation_logps: torch.Tensor


def keys_values_capturable(model: nn.Module) -> bool:
    """Whether `model` attends through [`~trl.kernels.packed_attention.packed_sdpa_attention_forward`] (switched in
    by [`~trl.trainer.utils.packing.packed_sdpa_attention`]), so that [`capture_keys_values`] sees its keys/values,
    and every layer is a full-attention layer ([`supports_prefix_sharing`])."""
    base = _base_transformers_model(model)
    config = getattr(base, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != PACKED_SDPA:
        return False
    return supports_prefix_sharing(model)


def continuation_starts(
    main_ids: torch.Tensor,
    main_mask: torch.Tensor,
    ids: torch.Tensor,
    mask: torch.Tensor,
    target_mask: torch.Tensor,
) -> torch.Tensor:
    """`(batch,)` number of leading tokens of each continuation row whose keys/values come from its main row.

    That is the rows' common token prefix less one token (the last shared token runs again, so that its hidden state,
    which predicts the first new token, comes from the continuation pass), and never past the row's first scored
    position. Both batches right-padded.
    """
    prefix = _row_common_prefix(main_ids, main_mask, ids, mask)
    scored = target_mask.bool()
    columns = torch.arange(scored.shape[1], device=scored.device).expand_as(scored)
    first_scored = torch.where(scored, columns, scored.shape[1]).min(dim=1).values
    return torch.minimum(prefix - 1, first_scored).clamp(min=0)


def prefix_cached_saving(
    main_ids: torch.Tensor,
    main_mask: torch.Tensor,
    continuation_ids: torch.Tensor,
    continuation_mask: torch.Tensor,
    continuation_target_mask: torch.Tensor,
    layout: str = "packed",
) -> float:
    """Share of the tokens of separate main + continuation passes that [`prefix_cached_token_logps`] does not compute:
    the continuation tokens taken from the main rows (less the main rows' padding in the `"padded"` layout), as a
    fraction of all real tokens."""
    starts = continuation_starts(main_ids, main_mask, continuation_ids, continuation_mask, continuation_target_mask)
    skipped = int(starts.sum())
    if layout == "padded":
        skipped -= 2 * int((~main_mask.bool()).sum())
    total = int(main_mask.sum() + continuation_mask.sum())
    return skipped / total if total else 0.0


def _row_common_prefix(
    ids: torch.Tensor, mask: torch.Tensor, other_ids: torch.Tensor, other_mask: torch.Tensor
) -> torch.Tensor:
    """`(batch,)` length of the common token prefix of row `i` of two right-padded batches."""
    width = min(ids.shape[1], other_ids.shape[1])
    same = (ids[:, :width] == other_ids[:, :width]) & mask[:, :width].bool() & other_mask[:, :width].bool()
    return same.long().cumprod(dim=1).sum(dim=1)


def prefix_cached_token_logps(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    target_mask: torch.Tensor,
    continuation_ids: torch.Tensor,
    continuation_mask: torch.Tensor,
    continuation_target_mask: torch.Tensor,
    layout: str = "padded",
    pad_token_id: int = 0,
    pad_to_multiple_of: int | None = None,
    compute_entropy: bool = False,
    logits_stats_fn: Any = None,
) -> PrefixCachedLogps:
    """Log-probs of right-padded main rows (with gradient, as [`compute_sequence_token_logps`] computes them in
    `layout`), then of continuation rows that start like them (e.g. KTO's KL rows: the same prompt, another
    completion), without gradient, from the main rows' prefix keys/values.

    The keys/values are recorded during the main forward pass ([`capture_keys_values`]), so this works under
    gradient checkpointing too (which turns the model's own cache off). Row `i` of the continuation batch takes the
    first [`continuation_starts`] tokens from main row `i`; only its remaining tokens run through the model, all rows'
    packed into one row without padding, each attending to its own recorded prefix ([`attend_after_prefixes`]).
    The values are those of separate forward passes up to float rounding; the fused LM head scores only the target
    tokens.

    Args:
        model: Causal LM for which [`keys_values_capturable`] holds.
        input_ids: `(batch, seq_len)` right-padded main rows.
        attention_mask: `(batch, seq_len)` mask of their real tokens.
        target_mask: `(batch, seq_len - 1)` next-token positions to score in the main rows.
        continuation_ids: `(batch, cont_len)` right-padded continuation rows.
        continuation_mask: `(batch, cont_len)` mask of their real tokens.
        continuation_target_mask: `(batch, cont_len - 1)` positions to score in them.
        layout: Layout of the main forward pass (see [`compute_sequence_token_logps`]).
        pad_token_id: Id of free slots of packed rows.
        pad_to_multiple_of: Round packed row widths up to a multiple of this value.
        compute_entropy: Also return the main rows' per-token entropies.
        logits_stats_fn: Optional `f(logits, targets) -> dict` on the main rows' scored logits.

    Returns:
        [`PrefixCachedLogps`].
    """
    if not keys_values_capturable(model):
        raise ValueError(
            f"{type(model).__name__} does not attend through {PACKED_SDPA!r} with full attention only; switch it in "
            "with trl.trainer.utils.packing.packed_sdpa_attention(model) (models with SDPA attention)."
        )
    head = fusable_lm_head(model)
    with capture_keys_values() as captured:
        main = compute_sequence_token_logps(
            model, input_ids, attention_mask, target_mask, layout=layout, pad_token_id=pad_token_id,
            pad_to_multiple_of=pad_to_multiple_of, compute_entropy=compute_entropy, logits_stats_fn=logits_stats_fn,
        )  # fmt: skip
    config = _base_transformers_model(model).config
    num_layers = config.get_text_config().num_hidden_layers
    if sorted(captured) != list(range(num_layers)):
        raise RuntimeError(
            f"The main pass recorded the keys/values of layers {sorted(captured)}, expected all {num_layers}."
        )
    slots = _token_slots(input_ids, attention_mask, layout, pad_token_id, pad_to_multiple_of)
    starts = continuation_starts(
        input_ids, attention_mask, continuation_ids, continuation_mask, continuation_target_mask
    )
    with torch.no_grad(), _gradient_checkpointing_off(model):
        prefixes = _gathered_prefixes(captured, slots, starts, num_layers)
        captured.clear()
        continuation = _continuation_logps(
            model, head, prefixes, starts, continuation_ids, continuation_mask, continuation_target_mask
        )
    return PrefixCachedLogps(main=main, continuation_logps=continuation.to(head.weight.dtype))


def _token_slots(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    layout: str,
    pad_token_id: int,
    pad_to_multiple_of: int | None,
) -> tuple[torch.Tensor, int]:
    """Where each token of the padded batch sat in the main forward pass: `(batch, seq_len)` flat indices
    (`row * width + column` of the forward's rows) and that `width`; packing as [`compute_sequence_token_logps`]
    packs."""
    if layout == "padded":
        rows, width = input_ids.shape
        return torch.arange(rows * width, device=input_ids.device).view(rows, width), width
    capacity = _layout_capacity(attention_mask, layout)
    packed = pack_padded_sequences(input_ids, attention_mask, capacity, pad_token_id, pad_to_multiple_of)
    width = packed.input_ids.shape[1]
    slots = torch.zeros_like(input_ids, dtype=torch.long)
    slots[packed.src_row, packed.src_col] = packed.dst_row * width + packed.dst_col
    return slots, width


def _gathered_prefixes(
    captured: dict[int, tuple[torch.Tensor, torch.Tensor]],
    slots: tuple[torch.Tensor, int],
    starts: torch.Tensor,
    num_layers: int,
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the recorded keys/values of the first `starts[i]` tokens of main row `i`, gathered into
    `(batch, kv_heads, max(starts), head_dim)` (later positions of shorter rows are filler, never attended to)."""
    token_slots, width = slots
    length = max(int(starts.max()), 1)
    columns = torch.arange(length, device=starts.device).clamp(max=token_slots.shape[1] - 1)
    index = token_slots[:, columns]  # (batch, length)
    prefixes = {}
    for layer in range(num_layers):
        states = []
        for tensor in captured[layer]:
            rows, heads, seq_len, dim = tensor.shape
            if seq_len != width:
                raise RuntimeError(f"Layer {layer} saw {seq_len} positions per row; the main pass had {width}.")
            flat = tensor.transpose(1, 2).reshape(rows * seq_len, heads, dim)
            states.append(flat[index].transpose(1, 2))
        prefixes[layer] = (states[0], states[1])
    return prefixes


@contextlib.contextmanager
def _gradient_checkpointing_off(model: nn.Module) -> Iterator[None]:
    """Layers run without gradient checkpointing within the block (the continuation has no gradient to save
    memory for; checkpointing would only add its overhead and warnings)."""
    layers = [module for module in model.modules() if getattr(module, "gradient_checkpointing", False) is True]
    for module in layers:
        module.gradient_checkpointing = False
    try:
        yield
    finally:
        for module in layers:
            module.gradient_checkpointing = True


def _continuation_logps(
    model: nn.Module,
    head: nn.Linear,
    prefixes: dict[int, tuple[torch.Tensor, torch.Tensor]],
    starts: torch.Tensor,
    ids: torch.Tensor,
    mask: torch.Tensor,
    target_mask: torch.Tensor,
) -> torch.Tensor:
    """The continuation rows' log-probs of [`prefix_cached_token_logps`] (called under no_grad).

    The continuations (each row's tokens from `starts[i]` on) run packed into one row without padding; each attends
    to its own prefix keys/values and causally to itself ([`attend_after_prefixes`]).
    """
    suffix_lengths = (mask.sum(dim=1) - starts).clamp(min=0)
    rows = torch.repeat_interleave(torch.arange(ids.shape[0], device=ids.device), suffix_lengths)
    offsets = torch.cumsum(suffix_lengths, dim=0) - suffix_lengths
    columns = torch.arange(rows.numel(), device=ids.device) - offsets[rows] + starts[rows]
    bounds = [0, *torch.cumsum(suffix_lengths, dim=0).tolist()]
    if bounds[-1] == 0:
        return torch.zeros(target_mask.shape, dtype=torch.float32, device=ids.device)
    with capture_lm_head_inputs(head) as captured, attend_after_prefixes(prefixes, starts.tolist(), bounds):
        model(input_ids=ids[rows, columns].unsqueeze(0), position_ids=columns.unsqueeze(0), use_cache=False)
    # Entry t of a row predicts its token t + 1 from token t, which the continuation ran at offset t - starts.
    target_rows, target_cols = target_mask.bool().nonzero(as_tuple=True)
    hidden = captured[0][0, offsets[target_rows] + target_cols - starts[target_rows]]
    logps, _, _ = linear_selective_log_softmax(
        hidden, head.weight, ids[target_rows, target_cols + 1], head.bias, 1.0, False, None
    )
    return logps.new_zeros(target_mask.shape).index_put((target_rows, target_cols), logps)
