"""The rollout decode's decoder-layer outputs reused as the training forward's gradient checkpoints.

With gradient checkpointing, the loss pass of an on-policy rollout runs every decoder layer twice: once without
saving activations (its only products are each layer's output, the next layer's checkpointed input, and the final
hidden states) and once more in the backward pass, with gradients. The first run recomputes, token for token, what the
rollout decode loop computed a moment earlier with the same parameters: the output of every layer at every prompt and
completion token (the prompt during the prefill, each completion token on the step that fed it).

[`DecodeLayerOutputs`] keeps those outputs as the decode loop produces them (`decode_rollouts(...,
record_layer_outputs=True)`). [`replayed_layer_outputs`] lays them out as the shared-prefix layout of a training
micro-batch, and within [`replay_decoder_layers`] each decoder layer's checkpoint function returns its recorded output
instead of running the layer; the backward pass recomputes the layer from its (recorded) input exactly as gradient
checkpointing always does. The forward values are the decode's, which equal the training forward's up to float
rounding (matrix products over other shapes), as the old log-probabilities of the sampler always do.

The outputs are valid only while the parameters are the ones that decoded: the trainer stamps them with its optimizer
step and the parameters' version counters ([`parameters_stamp`]) and replays only when both are unchanged. Models and
settings whose forward the decode does not reproduce (dropout drawing random numbers, autocast, hooks, other layer
classes) never record ([`layer_outputs_fallback_reason`]).
"""

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from .last_layer_selection import has_dropout
from .layer_checkpoints import checkpointed_layer
from .lean_decode import lean_decode_fallback_reason


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    base = model.model
    return list(base.layers[: model.config.num_hidden_layers])


def layers_checkpointed(model: nn.Module) -> bool:
    """Whether every decoder layer of the causal LM `model` runs under gradient checkpointing in train mode."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        return False
    return all(
        getattr(layer, "gradient_checkpointing", False) and "_gradient_checkpointing_func" in vars(layer)
        for layer in _decoder_layers(model)
    )


def layer_outputs_fallback_reason(model: nn.Module) -> str | None:
    """Why the decode of `model` cannot record layer outputs a training forward may replay, or None when it can.

    The model must be one the lean decode step runs (transformers' own Llama-style decoders, no hooks, no autocast;
    see [`~trl.trainer.utils.lean_decode.lean_decode_fallback_reason`]) and draw no random numbers in its forward.

    Args:
        model: The unwrapped causal LM about to decode.

    Returns:
        A short reason, or None.
    """
    reason = lean_decode_fallback_reason(model)
    if reason is not None:
        return reason
    if has_dropout(model, active_only=False):  # the loss pass runs in train mode, whatever mode decodes
        return "dropout modules in the model"
    if getattr(model.config, "attention_dropout", 0.0):
        return "attention dropout"
    return None


def parameters_stamp(model: nn.Module) -> int:
    """The sum of the parameters' version counters: changes with every in-place update except fused optimizer steps
    (which the trainer's optimizer step counter covers)."""
    return sum(parameter._version for parameter in model.parameters())


class DecodeLayerOutputs:
    """Every decoder layer's output at every token the rollout decode fed to the model, indexed by rollout row and
    token position (counted from the row's first real prompt token).

    Built by `decode_rollouts`: [`record_call`] after each model call (the shared prompt prefill, the first step, and
    every later step), with the outputs that call produced. The trainer sets `stamp` to whatever identifies the
    parameters that decoded.

    Args:
        model: The causal LM that decodes.
        sequences: `(N, L)` left-padded prompt ids of the rollout rows.
        prompt_mask: `(N, L)` their attention mask.
        max_new_tokens: The most completion tokens of the rollout.
    """

    def __init__(self, model: nn.Module, sequences: torch.Tensor, prompt_mask: torch.Tensor, max_new_tokens: int):
        self.num_layers = len(_decoder_layers(model))
        num_rows, width = sequences.shape
        self.width = width
        self.padding = (width - prompt_mask.long().sum(dim=1)).to(sequences.device)
        self._index = torch.full((num_rows, width + max_new_tokens), -1, dtype=torch.long, device=sequences.device)
        # Calls not yet in `_index`: (call_rows, first_column, length, first entry). Placed when `index` is read, so
        # that the decode steps (one token each, the same rows) cost one scatter together instead of one apiece.
        self._unindexed: list[tuple[torch.Tensor, int, int, int]] = []
        self.layers: list[list[torch.Tensor]] = []
        self.num_entries = 0
        self.sequences: list[list[int]] | None = None
        self.stamp: Any = None

    def record_call(self, outputs: list[torch.Tensor], call_rows: torch.Tensor, first_column: int) -> None:
        """Record one model call's layer outputs.

        Args:
            outputs: One `(rows, length, hidden)` tensor per decoder layer.
            call_rows: `(N,)` the row of the call's batch each rollout row was computed in (a shared prompt prefill
                computes a group's prompt once).
            first_column: Column (in the left-padded prompt + completion layout) of the call's first input token.
        """
        rows, length = outputs[0].shape[:2]
        if not self.layers:
            self.layers = [[] for _ in outputs]
        for stored, output in zip(self.layers, outputs):
            stored.append(output.reshape(rows * length, -1))
        self._unindexed.append((call_rows, first_column, length, self.num_entries))
        self.num_entries += rows * length

    @property
    def index(self) -> torch.Tensor:
        """`(N, width + max_new_tokens)`: `index[r, j]` is the row of the flat output table (see [`table`]) holding
        rollout row `r`'s token `j`, -1 where the decode never fed it."""
        start = 0
        while start < len(self._unindexed):
            # A run of consecutive calls over the same rows with the same length goes in one scatter; runs keep
            # their order, so a later call still overwrites an earlier one.
            call_rows, _, length, _ = self._unindexed[start]
            end = start + 1
            while (
                end < len(self._unindexed)
                and self._unindexed[end][0] is call_rows
                and self._unindexed[end][2] == length
            ):
                end += 1
            self._place(self._unindexed[start:end])
            start = end
        self._unindexed.clear()
        return self._index

    def _place(self, calls: list[tuple[torch.Tensor, int, int, int]]) -> None:
        """Write the entries of calls sharing `call_rows` and `length` into `_index`."""
        call_rows, _, length, _ = calls[0]
        device = self._index.device
        offsets = torch.arange(length, device=device)
        first_columns = torch.tensor([call[1] for call in calls], device=device)
        first_entries = torch.tensor([call[3] for call in calls], device=device)
        columns = (first_columns[:, None] + offsets[None, :]).reshape(-1)
        entry_offsets = (first_entries[:, None] + offsets[None, :]).reshape(-1)
        positions = columns[None, :] - self.padding[:, None]  # (N, calls * length) token position of each entry
        entries = entry_offsets[None, :] + call_rows[:, None] * length
        real = positions >= 0
        self._index[torch.nonzero(real, as_tuple=True)[0], positions[real]] = entries[real]

    def table(self, layer: int) -> torch.Tensor:
        """`(entries + 1, hidden)` every recorded output of `layer`, then a zero row (for tokens never fed)."""
        stored = self.layers[layer]
        return torch.cat([*stored, stored[0].new_zeros((1, stored[0].shape[-1]))])

    def set_sequences(self, tokens: torch.Tensor) -> None:
        """The rollout rows' real tokens (prompt without padding, then every sampled token)."""
        padding = self.padding.tolist()
        self.sequences = [row[start:] for row, start in zip(tokens.tolist(), padding)]


def _row_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[tuple[int, ...]]:
    ids, mask = input_ids.tolist(), attention_mask.bool().tolist()
    return [tuple(token for token, keep in zip(row, keeps) if keep) for row, keeps in zip(ids, mask)]


def _matching_rows(recorded: DecodeLayerOutputs, rows: list[tuple[int, ...]]) -> list[int] | None:
    """For each row of a batch, a rollout row whose tokens begin with it (a token's outputs depend only on the tokens
    up to it), or None when some row matches none."""
    sequences = recorded.sequences or []
    matches = []
    for tokens in rows:
        found = next((r for r, sequence in enumerate(sequences) if tuple(sequence[: len(tokens)]) == tokens), None)
        if found is None or len(tokens) > len(sequences[found]):
            return None
        matches.append(found)
    return matches


def replayed_layer_outputs(
    recorded: DecodeLayerOutputs,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    layout_token_index: torch.Tensor,
    layout_shape: tuple[int, int],
) -> list[torch.Tensor] | None:
    """The recorded decoder-layer outputs laid out as a shared-prefix layout of a batch, or None when some token the
    loss needs was not recorded.

    Args:
        recorded: The rollout's [`DecodeLayerOutputs`].
        input_ids: `(B, S)` the batch's prompt + completion ids.
        attention_mask: `(B, S)` its attended tokens (contiguous per row).
        layout_token_index: `(B, S)` flat index in the layout of every attended token, -1 elsewhere.
        layout_shape: `(groups, length)` of the layout.

    Returns:
        One `(groups, length, hidden)` tensor per decoder layer (zeros at padding and at each row's last token when
        the decode never fed it: nothing the loss reads attends to them), or None.
    """
    matches = _matching_rows(recorded, _row_tokens(input_ids, attention_mask))
    if matches is None:
        return None
    mask = attention_mask.bool()
    positions = mask.long().cumsum(dim=1) - 1
    sources = recorded.index[torch.tensor(matches, device=input_ids.device)]  # (B, width + max_new_tokens)
    positions = positions.clamp(max=sources.shape[1] - 1)
    row_sources = torch.where(mask, sources.gather(1, positions.clamp(min=0)), -1)
    # Every attended token but each row's last must have been fed (the decode feeds all but the last sampled token).
    last = mask.long().sum(dim=1, keepdim=True) - 1
    needed = mask & (positions < last)
    if bool((row_sources[needed] < 0).any()):
        return None
    groups, length = layout_shape
    flat = torch.full((groups * length,), -1, dtype=torch.long, device=input_ids.device)
    # A shared prefix token is fed by several rows (or only by a longer one): any recorded source will do.
    flat.scatter_reduce_(0, layout_token_index[mask], row_sources[mask], reduce="amax")
    flat = torch.where(flat < 0, recorded.num_entries, flat)
    flat = flat.view(groups, length)
    return [recorded.table(layer)[flat] for layer in range(len(recorded.layers))]


def _replay_checkpoint(
    given: torch.Tensor, layer: nn.Module, original: Any, function: Any, *args: Any, **kwargs: Any
) -> torch.Tensor:
    """A layer's `_gradient_checkpointing_func` that returns `given` as the output of `function(*args)`, or runs the
    original checkpoint function when the call is not the one the outputs were laid out for."""
    if kwargs or len(args) != 1 or args[0].shape != given.shape or torch.is_autocast_enabled(given.device.type):
        return original(function, *args, **kwargs)
    return checkpointed_layer(layer, function, args[0], given=given)


@contextlib.contextmanager
def replay_decoder_layers(model: nn.Module, outputs: list[torch.Tensor]) -> Iterator[None]:
    """Within the block, a gradient-checkpointed forward of `model` takes each decoder layer's output from `outputs`
    instead of running the layer (the backward pass recomputes it, as checkpointing does).

    Args:
        model: The transformers causal LM (unwrapped) whose layers are checkpointed.
        outputs: One tensor per decoder layer, shaped as that layer's output in the coming forward.
    """
    layers = _decoder_layers(model)
    if len(layers) != len(outputs):
        raise ValueError(f"{len(outputs)} recorded layer outputs for a model with {len(layers)} decoder layers.")
    saved = []
    for layer, given in zip(layers, outputs):
        original = vars(layer).get("_gradient_checkpointing_func")
        saved.append(original)
        if original is None:
            continue
        layer._gradient_checkpointing_func = functools.partial(_replay_checkpoint, given, layer, original)
    try:
        yield
    finally:
        for layer, original in zip(layers, saved):
            if original is not None:
                layer._gradient_checkpointing_func = original


@contextlib.contextmanager
def recording_layer_outputs(model: nn.Module, sink: list[torch.Tensor]) -> Iterator[None]:
    """Within the block, every decoder layer's output of a model call is appended to `sink` (in layer order)."""
    handles = [
        layer.register_forward_hook(lambda module, args, output: sink.append(output))
        for layer in _decoder_layers(model)
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
