"""Per-token log-probabilities of a causal LM (shared by DPO, KTO, GRPO, RLOO, Online DPO, ...): one forward pass,
LM-head work only where a target is scored, plus chunked per-token statistics of the output distribution."""

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.nn as nn
from torch.nn.modules import module as torch_module

from ...kernels.linear_log_softmax import fused_head_working_bytes, in_common_dtype, linear_selective_log_softmax
from ...kernels.log_softmax import selective_log_softmax
from ...kernels.log_softmax import selective_log_softmax_and_entropy as _logps_and_entropy
from ...models.utils import _base_transformers_model


class TokenLogps(NamedTuple):
    """Result of [`compute_token_logps`].

    Attributes:
        logps: `(batch, seq_len - 1)` log-probability of each next token (`input_ids[:, t + 1]` given the prefix up to
            `t`); 0 where `target_mask` is False.
        entropy: Same shape, entropy of the predicted distribution (None unless requested).
        outputs: The model's raw outputs (for `aux_loss` of mixture-of-experts models, for example). Their `logits`
            are None when the fused LM head computed the log-probs (see [`fused_lm_head`]).
        stats: `logits_stats_fn` values, each `(batch, seq_len - 1)`, 0 where `target_mask` is False.
    """

    logps: torch.Tensor
    entropy: torch.Tensor | None
    outputs: Any
    stats: dict[str, torch.Tensor] = {}


def selective_log_softmax_and_entropy(
    logits: torch.Tensor,
    index: torch.Tensor,
    entropy_requires_grad: bool = True,
    temperature: float = 1.0,
    row_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Selected-token log-probabilities and per-position entropies of `softmax(logits / temperature)`, with TRL's
    `trl.trainer.utils` signature (see `trl.kernels.selective_log_softmax_and_entropy` for the computation).

    Args:
        logits: Tensor of shape `(..., vocab_size)`.
        index: Integer tensor of shape `(...)` with the token ids to score.
        entropy_requires_grad: When False, the entropy is returned detached (no gradient flows through it).
        temperature: Logits are divided by this value before the softmax (must be > 0).
        row_mask: Optional boolean mask with the shape of `index`; masked rows read 0 for both results.

    Returns:
        `(log_probs, entropy)`, both with the shape of `index`.
    """
    logps, entropy = _logps_and_entropy(logits, index, temperature=temperature, row_mask=row_mask)
    return logps, entropy if entropy_requires_grad else entropy.detach()


def model_accepts_argument(model: nn.Module, name: str) -> bool:
    """Whether the (possibly PEFT- or DDP-wrapped) model's `forward` takes an argument called `name`."""
    # PeftModel.forward takes **kwargs and passes them to the wrapped transformers model. (A PEFT-wrapped transformers
    # model also has `peft_config`, and `base_model` is its decoder: only the PEFT wrapper is looked through.)
    target = _base_transformers_model(model)
    try:
        return name in inspect.signature(target.forward).parameters
    except (TypeError, ValueError):
        return False


def fusable_lm_head(model: nn.Module) -> nn.Linear | None:
    """The model's output projection if the fused LM head + log-softmax can stand in for it, else None.

    It can when the head is a plain `nn.Linear` (not wrapped by PEFT, not sharded by DeepSpeed ZeRO-3 or FSDP) whose
    output the model returns as is (no logit soft-capping or scaling in the config), without forward hooks on it or
    on every module (which would read the logits the fused head never builds), and the model is not wrapped by DistributedDataParallel (whose
    gradient hooks expect every parameter used inside the wrapped forward).
    """
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return None
    target = getattr(model, "module", model)
    head = _computing_head(_output_embeddings(target))
    if type(head) is not nn.Linear or type(head.weight) is not nn.Parameter or hasattr(head.weight, "ds_id"):
        return None
    if head._forward_hooks or torch_module._global_forward_hooks:
        return None
    config = getattr(target, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale"):
        value = getattr(text_config, name, None)
        if value is not None and value != 1:
            return None
    return head


@contextlib.contextmanager
def capture_lm_head_inputs(head: nn.Linear) -> Iterator[list[torch.Tensor]]:
    """Within the block, the head computes nothing: it records its input in the yielded list and returns a
    zero-stride placeholder of the logits' shape (no memory), so the forward pass stops at the final hidden states.

    The placeholder is float32 whatever the head's dtype: accelerate's mixed precision converts a model's half-precision
    outputs to float32 (`convert_outputs_to_fp32`), which would materialise a bf16 placeholder as full logits."""
    captured: list[torch.Tensor] = []

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        captured.append(hidden)
        return hidden.new_zeros((), dtype=torch.float32).expand(*hidden.shape[:-1], head.out_features)

    forward.captures_lm_head_inputs = True
    head.forward = forward
    try:
        yield captured
    finally:
        del head.forward


def lm_head_inputs_captured(model: nn.Module) -> bool:
    """Whether a forward pass of `model` now runs inside [`capture_lm_head_inputs`]: no logits are materialised, the
    fused head computes the log-probs afterwards, a chunk at a time."""
    head = _computing_head(_output_embeddings(getattr(model, "module", model)))
    return getattr(vars(head).get("forward") if head is not None else None, "captures_lm_head_inputs", False)


# Innermost first: the bytes that callers of `small_head_output` declared for the forward passes in their block.
_DECLARED_HEAD_OUTPUT_BYTES: list[int] = []


@contextlib.contextmanager
def small_head_output(nbytes: int) -> Iterator[None]:
    """Within the block, forward passes are declared to build small logits (few positions, `logits_to_keep`): they,
    and all the loss builds on them until the backward pass, take at most `nbytes`.

    Memory planning that would otherwise assume full-sequence logits ([`head_output_bytes`]) can then count on the
    rest. A caller that under-declares only makes the step's peak higher, never its values different.
    """
    _DECLARED_HEAD_OUTPUT_BYTES.append(int(nbytes))
    try:
        yield
    finally:
        _DECLARED_HEAD_OUTPUT_BYTES.pop()


def small_student_logits(
    model: nn.Module, teacher_logits: torch.Tensor, copies: int = 4
) -> contextlib.AbstractContextManager[None]:
    """[`small_head_output`] for a student whose logits cover the same completion positions as `teacher_logits`
    (`logits_to_keep`, when `model` takes it): with the teacher's, their gradient and the loss's work, `copies` times
    the teacher's logits in float32 (four for the chunked generalized JSD). Gradient checkpointing may then keep the
    last layers' activations instead of recomputing them (`LayerBudget`)."""
    if not model_accepts_argument(model, "logits_to_keep"):
        return contextlib.nullcontext()
    return small_head_output(copies * teacher_logits.numel() * 4)


def head_output_bytes(model: nn.Module) -> int | None:
    """The memory a forward pass of `model` starting now builds at its head, with the loss on it, until the backward
    pass: what [`small_head_output`] declared, else the fused head's working memory when it computes the log-probs
    ([`lm_head_inputs_captured`]), else None: nothing bounds it (full logits)."""
    if _DECLARED_HEAD_OUTPUT_BYTES:  # the caller knows what it builds on the head's output, captured or not
        return _DECLARED_HEAD_OUTPUT_BYTES[-1]
    return fused_head_working_bytes() if lm_head_inputs_captured(model) else None


def _computing_head(head: nn.Module | None) -> nn.Module | None:
    """The module that computes `head`'s output now. For PEFT's `ModulesToSaveWrapper` (a head listed in
    `modules_to_save`): the active adapter's trained copy, or the original head while the adapters are disabled or an
    active adapter has no copy (the wrapper then passes through), None when several adapters are active or the
    wrapper itself is hooked. Any other module is its own."""
    if head is None or type(head).__name__ != "ModulesToSaveWrapper":
        return head
    if head._forward_hooks or head._forward_pre_hooks:
        return None
    active = list(head.active_adapters)
    if head.disable_adapters or any(name not in head.modules_to_save for name in active):
        return head.original_module
    return head.modules_to_save[active[0]] if len(active) == 1 else None


@contextlib.contextmanager
def head_in_common_dtype(model: nn.Module) -> Iterator[None]:
    """Within the block, the plain `nn.Linear` head of `model` (the active copy of a head in PEFT's `modules_to_save`)
    computes its logits in the wider of its input's and weight's dtypes, as the fused head does: a bf16 trained copy
    on an fp32 base model then gives fp32 logits instead of failing in its product. A head in the input embeddings'
    dtype keeps its own forward."""
    target = getattr(model, "module", model)
    head = _computing_head(_output_embeddings(target))
    get_embeddings = getattr(target, "get_input_embeddings", None)
    embeddings = get_embeddings() if callable(get_embeddings) else None
    input_dtype = getattr(getattr(embeddings, "weight", None), "dtype", None)
    if type(head) is not nn.Linear or "forward" in vars(head) or head.weight.dtype == input_dtype:
        yield
        return
    head.forward = lambda hidden: nn.functional.linear(*in_common_dtype(hidden, head.weight, head.bias))
    try:
        yield
    finally:
        del head.forward


def _output_embeddings(model: nn.Module) -> nn.Module | None:
    get_head = getattr(model, "get_output_embeddings", None)
    try:
        return get_head() if get_head is not None else None
    except (AttributeError, NotImplementedError):
        return None


def compute_token_logps(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    target_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    targets: torch.Tensor | None = None,
    logits_stats_fn: Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]] | None = None,
    fused: bool = True,
    upcast: bool = False,
    expected_grad: torch.Tensor | None = None,
    **forward_kwargs: Any,
) -> TokenLogps:
    """Log-probability of every next token under a causal LM, without a full-vocabulary log-softmax.

    Only positions where `target_mask` is True in some row go through the output projection when the model supports
    `logits_to_keep`, so prompts and padding cost no LM-head compute. Works for padded batches (`attention_mask`) and
    padding-free ones (`position_ids` restarting at each packed sequence, no attention mask). When the model's head
    allows it (see [`fusable_lm_head`]) and `fused` is True, the head and the log-softmax run fused, chunk by chunk,
    on the target positions only ([`~trl.kernels.linear_log_softmax.linear_selective_log_softmax`]): the logits of the
    batch are never built, and `outputs.logits` is None.

    Args:
        model: Causal LM (plain, PEFT or accelerate-wrapped).
        input_ids: `(batch, seq_len)` token ids.
        attention_mask: Optional `(batch, seq_len)` mask.
        position_ids: Optional `(batch, seq_len)` positions (required for padding-free batches).
        target_mask: Optional `(batch, seq_len - 1)` bool mask of the next-token positions to score.
        temperature: Logits are divided by this value before the softmax.
        compute_entropy: Also return the per-position entropy.
        targets: Optional `(batch, seq_len - 1)` ids to score (default: the next tokens, `input_ids[:, 1:]`).
        logits_stats_fn: Optional `f(logits, targets) -> {name: tensor}`, evaluated without gradients on the unscaled
            logits of the scored positions (see `compute_sequence_token_logps`); returned in `stats`.
        fused: Use the fused LM head when the model allows it.
        upcast: Return float32 log-probs and entropies for a half-precision model (default: the logits' dtype).
        expected_grad: Optional `(batch, seq_len - 1)` tensor the gradient of `logps` (at the `target_mask`
            positions) will be proportional to, as for a loss that is a weighted sum of them: lets the fused head
            compute its gradients in the forward (see [`~trl.kernels.linear_log_softmax.linear_selective_log_softmax`]).
            Ignored on the unfused path.
        **forward_kwargs: Extra arguments for the model's forward (e.g. `pixel_values`).

    Returns:
        [`TokenLogps`] with `(batch, seq_len - 1)` tensors.
    """
    kwargs = dict(forward_kwargs)
    kwargs["input_ids"] = input_ids
    kwargs["use_cache"] = False
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    targets = input_ids[:, 1:] if targets is None else targets
    shape = targets.shape
    positions = None
    if target_mask is not None and model_accepts_argument(model, "logits_to_keep"):
        positions = target_mask.any(dim=0).nonzero().squeeze(-1)
        kwargs["logits_to_keep"] = positions
    head = fusable_lm_head(model) if fused and (target_mask is None or bool(target_mask.any())) else None
    if head is not None:
        with capture_lm_head_inputs(head) as captured, _last_layer_on_targets(model, target_mask, kwargs):
            outputs = model(**kwargs)
        if len(captured) == 1:
            return _fused_token_logps(
                head, captured[0], outputs, targets, target_mask, positions, temperature, compute_entropy,
                logits_stats_fn, upcast, expected_grad,
            )  # fmt: skip
        raise RuntimeError(f"The LM head ran {len(captured)} times in one forward pass; pass `fused=False`.")
    outputs = model(**kwargs)
    logits = outputs.logits
    if positions is None:
        logits = logits[:, :-1]
    else:
        targets = targets[:, positions]
    if compute_entropy:
        logps, entropy = _logps_and_entropy(logits, targets, temperature=temperature)
    else:
        logps, entropy = selective_log_softmax(logits, targets, temperature=temperature), None
    if upcast:
        logps, entropy = _upcast(logps), _upcast(entropy)
    stats = {}
    if logits_stats_fn is not None:
        with torch.no_grad():
            stats = logits_stats_fn(logits.detach(), targets)
    if positions is not None:
        logps = logps.new_zeros(shape).index_copy(1, positions, logps)
        if entropy is not None:
            entropy = entropy.new_zeros(shape).index_copy(1, positions, entropy)
        stats = {name: value.new_zeros(shape).index_copy(1, positions, value) for name, value in stats.items()}
    if target_mask is not None:
        logps = logps.masked_fill(~target_mask, 0.0)
        if entropy is not None:
            entropy = entropy.masked_fill(~target_mask, 0.0)
        stats = {name: value.masked_fill(~target_mask, 0) for name, value in stats.items()}
    return TokenLogps(logps=logps, entropy=entropy, outputs=outputs, stats=stats)


def _last_layer_on_targets(model: nn.Module, target_mask: torch.Tensor | None, kwargs: dict[str, Any]) -> Any:
    """The last decoder layer computed only at the scored positions (their hidden states are all the fused head
    reads), unless the caller also asked for other outputs of the layers."""
    from ..fast_paths.last_layer_selection import last_layer_at

    if target_mask is None or any(kwargs.get(name) for name in ("output_hidden_states", "output_attentions")):
        return contextlib.nullcontext(False)
    rows, columns = target_mask.nonzero(as_tuple=True)
    length = kwargs["input_ids"].shape[1]
    return last_layer_at(model, rows * length + columns, length)


def _upcast(value: torch.Tensor | None) -> torch.Tensor | None:
    return value.float() if value is not None and value.dtype in (torch.float16, torch.bfloat16) else value


def _fused_token_logps(
    head: nn.Linear,
    hidden: torch.Tensor,
    outputs: Any,
    targets: torch.Tensor,
    target_mask: torch.Tensor | None,
    positions: torch.Tensor | None,
    temperature: float,
    compute_entropy: bool,
    logits_stats_fn: Callable | None,
    upcast: bool,
    expected_grad: torch.Tensor | None = None,
) -> TokenLogps:
    """[`compute_token_logps`] from the captured head inputs: only the `target_mask` rows are scored."""
    shape = targets.shape
    if positions is None:  # the head saw every position; the last one predicts nothing
        hidden = hidden[:, : shape[1]]
    else:
        targets = targets[:, positions]
    row_expected = None
    if expected_grad is not None and positions is not None:
        expected_grad = expected_grad[:, positions]
    if target_mask is None:
        rows, cols = None, None
        row_hidden, row_targets = hidden, targets
        row_expected = expected_grad
    else:
        kept_mask = target_mask if positions is None else target_mask[:, positions]
        rows, cols = kept_mask.nonzero(as_tuple=True)
        row_hidden, row_targets = hidden[rows, cols], targets[rows, cols]
        row_expected = expected_grad[rows, cols] if expected_grad is not None else None
    logps, entropy, stats = linear_selective_log_softmax(
        row_hidden, head.weight, row_targets, head.bias, temperature, compute_entropy, logits_stats_fn,
        expected_grad=row_expected,  # an entropy that gets a gradient after all takes the recomputing backward
    )  # fmt: skip
    # The unfused path returns values in the logits' dtype.
    dtype = logps.dtype if upcast else torch.promote_types(row_hidden.dtype, head.weight.dtype)
    logps = logps.to(dtype)
    entropy = entropy.to(dtype) if entropy is not None else None
    if rows is not None:
        columns = cols if positions is None else positions[cols]

        def scatter(value: torch.Tensor) -> torch.Tensor:
            return value.new_zeros(shape).index_put((rows, columns), value)

        logps = scatter(logps)
        entropy = scatter(entropy) if entropy is not None else None
        stats = {name: scatter(value) for name, value in stats.items()}
    outputs.logits = None
    return TokenLogps(logps=logps, entropy=entropy, outputs=outputs, stats=stats)


# Bytes of float32 logits processed at once by `logits_statistics`.
_STATS_CHUNK_BYTES = 64 * 1024 * 1024


def logits_statistics(logits: torch.Tensor, targets: torch.Tensor, sharpness: bool = False) -> dict[str, torch.Tensor]:
    """Per-token statistics of the full output distribution, computed chunk by chunk (never a full log-softmax).

    Meant as the `logits_stats_fn` of [`compute_sequence_token_logps`] (metrics only, no gradient).

    Args:
        logits: `(rows, positions, vocab)` logits.
        targets: `(rows, positions)` target token ids.
        sharpness: Also return `log_sum_sq_probs = log sum_v p_v^2` (used by WPO weighting).

    Returns:
        `{"mean_logit", "correct"}` (and `"log_sum_sq_probs"`), each of the shape of `targets`: the mean logit over
        the vocabulary and whether the argmax is the target token.
    """
    vocab = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab)
    flat_targets = targets.reshape(-1)
    rows = max(1, _STATS_CHUNK_BYTES // (4 * vocab))
    mean_logit, correct, sharp = [], [], []
    for start in range(0, flat_logits.shape[0], rows):
        chunk = flat_logits[start : start + rows].float()
        mean_logit.append(chunk.mean(dim=-1))
        correct.append((chunk.argmax(dim=-1) == flat_targets[start : start + rows]).float())
        if sharpness:
            # log sum_v p_v^2 = logsumexp(2 z) - 2 logsumexp(z)
            sharp.append(torch.logsumexp(2 * chunk, dim=-1) - 2 * torch.logsumexp(chunk, dim=-1))
    stats = {
        "mean_logit": torch.cat(mean_logit).reshape(targets.shape),
        "correct": torch.cat(correct).reshape(targets.shape),
    }
    if sharp:
        stats["log_sum_sq_probs"] = torch.cat(sharp).reshape(targets.shape)
    return stats


def mean_logits_from_hidden(model: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Mean over the vocabulary of the logits at every position, from the final hidden states, without the LM head.

    The output projection is linear, so `mean_v(W h + b) = h . mean_v(W) + mean(b)`: one dot product per position
    instead of a full-vocabulary matmul. Models that post-process their logits are handled: a `logit_scale` /
    `logits_scaling` factor is applied, and a `final_logit_softcapping` (not linear) falls back to the exact mean of
    the projected logits, chunk by chunk. Metrics only: computed without gradients.

    Args:
        model: The (possibly PEFT- or accelerate-wrapped) causal LM whose output embeddings produce the logits.
        hidden_states: `(..., hidden)` final hidden states (after the last norm, `outputs.hidden_states[-1]`).

    Returns:
        `(...)` float32 tensor: the mean logit at each position.
    """
    return _reduce_logits_from_hidden(model, hidden_states, "mean")


def summed_logits_from_hidden(model: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Sum over the vocabulary of the logits at every position, from the final hidden states, without the LM head.

    [`mean_logits_from_hidden`] with `sum_v(W h + b) = h . sum_v(W) + sum(b)` (same arguments; the vocabulary is the
    LM head's output size, the width of the model's logits). Returns the `(...)` float32 summed logits.
    """
    return _reduce_logits_from_hidden(model, hidden_states, "sum")


def _reduce_logits_from_hidden(model: nn.Module, hidden_states: torch.Tensor, reduction: str) -> torch.Tensor:
    """Mean or sum over the vocabulary of the logits at every position (see [`mean_logits_from_hidden`])."""
    target = getattr(model, "module", model)
    head = target.get_output_embeddings()
    config = getattr(target, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    weight = head.weight
    reduce = torch.mean if reduction == "mean" else torch.sum
    with torch.no_grad():
        hidden = hidden_states.detach()
        softcap = getattr(text_config, "final_logit_softcapping", None)
        if softcap:
            flat = hidden.reshape(-1, hidden.shape[-1])
            rows = max(1, _STATS_CHUNK_BYTES // (4 * weight.shape[0]))
            reduced = []
            for start in range(0, flat.shape[0], rows):
                logits = head(flat[start : start + rows]).float()
                reduced.append(reduce(torch.tanh(logits / softcap) * softcap, dim=-1))
            return torch.cat(reduced).reshape(hidden.shape[:-1])
        out = hidden.float() @ reduce(weight.float(), dim=0)
        if getattr(head, "bias", None) is not None:
            out = out + reduce(head.bias.float())
        scale = getattr(text_config, "logit_scale", None)
        if isinstance(scale, (int, float)):
            out = out * scale
        divisor = getattr(text_config, "logits_scaling", None)
        if isinstance(divisor, (int, float)) and divisor:
            out = out / divisor
        return out
