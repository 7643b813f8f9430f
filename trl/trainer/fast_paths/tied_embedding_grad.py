"""Tied input embeddings whose gradient is added sparsely into the LM head's.

Replaces: `nn.Embedding`'s backward, which builds a dense `(vocab x hidden)` gradient of zeros, adds the rows of the
looked-up tokens into it, and hands it to autograd, which then adds it to the LM head's gradient of the same (tied)
weight. At Qwen2.5-0.5B's shape that is a 545 MB tensor allocated, zeroed and read once more per step, alive at the
same time as the head's gradient: the peak of an SFT step is there.

Here the embedding's backward adds the rows of the tokens it looked up (repeated tokens summed first) into the
weight's gradient in place, at the end of the backward pass, after autograd has put the head's gradient there: the
weight ends the step with the same dense gradient, bitwise equal unless a token occurs more than once in the batch
(then equal to float rounding: the repeated rows are summed in another order), and no second dense tensor exists.
Under `torch.autograd.grad`, which never writes `.grad`, the lookup returns the plain dense gradient.

Predicate: [`tied_embedding_grad_fallback_reason`] (a plain `nn.Embedding` whose weight is the output head's, trained,
without gradient hooks, `max_norm`, `scale_grad_by_freq` or `sparse`, in one process without DeepSpeed, FSDP or
`torch.compile`).
Equality test: `tests/test_tied_embedding_grad.py`. Gain: `docs/benchmarks.md`, "Tied embedding gradient".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..utils.distributed import uses_sharding_engine


def _grad_accumulator(weight: torch.Tensor) -> Any:
    """The autograd node that accumulates `weight`'s gradient (cached by autograd while referenced)."""
    return weight.view_as(weight).grad_fn.next_functions[0][0]


class _EmbeddingAddingIntoGrad(torch.autograd.Function):
    """`F.embedding(ids, weight, padding_idx)` whose rows are added into `weight.grad` at the end of the backward.

    In a `backward()` that accumulates into `weight.grad`, the backward returns no gradient for the weight (autograd
    then has nothing to sum with the head's gradient in its input buffer, where a sparse term would make the sum out
    of place); it sums the rows of repeated tokens and queues their addition for the end of the backward pass, when
    autograd has put the head's gradient into `weight.grad` (a dense gradient of zeros is started when nothing did).
    Under `torch.autograd.grad`, which never writes `.grad`, it returns the plain dense gradient instead.
    """

    @staticmethod
    def forward(ctx, ids, weight, padding_idx, accumulator):
        ctx.save_for_backward(ids)
        ctx.weight, ctx.padding_idx, ctx.accumulator = weight, padding_idx, accumulator
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad_output):
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        try:
            accumulating = torch._C._will_engine_execute_node(ctx.accumulator)
        except RuntimeError:  # raised for a leaf's node under `torch.autograd.grad`
            accumulating = None
        if accumulating is False:  # a backward(inputs=...) that leaves this weight out
            return None, None, None, None
        rows = ids.reshape(-1)
        values = grad_output.reshape(-1, grad_output.shape[-1])
        if ctx.padding_idx is not None:  # as nn.Embedding: the padding row gets no gradient
            keep = rows != ctx.padding_idx
            rows, values = rows[keep], values[keep]
        # Repeated tokens are summed first, as the dense backward does, then added once.
        summed = torch.sparse_coo_tensor(rows.unsqueeze(0), values, weight.shape, check_invariants=False).coalesce()
        indices, sums = summed.indices()[0], summed.values().to(weight.dtype)
        if accumulating is None:
            dense = torch.zeros_like(weight)
            return None, dense.index_put_((indices,), sums, accumulate=True), None, None

        def add_rows() -> None:
            with torch.no_grad():
                if weight.grad is None:
                    weight.grad = torch.zeros_like(weight)
                # index_put_ touches only these rows (index_add_ walks the whole gradient on a CPU).
                weight.grad.index_put_((indices,), sums.to(weight.grad.dtype), accumulate=True)

        torch.autograd.Variable._execution_engine.queue_callback(add_rows)
        return None, None, None, None


def tied_embedding_grad_fallback_reason(model: nn.Module, args: Any = None) -> str | None:
    """Why the input embeddings of `model` keep their own backward, or None when [`sparse_tied_embedding_grad`]
    applies."""
    target = getattr(model, "module", model)
    get_inputs, get_outputs = (
        getattr(target, name, None) for name in ("get_input_embeddings", "get_output_embeddings")
    )
    if get_inputs is None or get_outputs is None:
        return "the model does not expose its input and output embeddings"
    try:
        embeddings, head = get_inputs(), get_outputs()
    except (AttributeError, NotImplementedError):
        return "the model does not expose its input and output embeddings"
    if type(embeddings) is not nn.Embedding:
        return f"the input embeddings are a {type(embeddings).__name__}, not a plain nn.Embedding"
    if head is None or getattr(head, "weight", None) is not embeddings.weight:
        return "the input embeddings are not tied to the output head"
    weight = embeddings.weight
    if type(weight) is not nn.Parameter or not weight.requires_grad or hasattr(weight, "ds_id"):
        return "the tied weight is not a trained, unsharded parameter"
    if weight._backward_hooks or getattr(weight, "_post_accumulate_grad_hooks", None):
        return "the tied weight has gradient hooks, which must see its whole gradient"
    if embeddings.max_norm is not None or embeddings.scale_grad_by_freq or embeddings.sparse:
        return "the embedding uses max_norm, scale_grad_by_freq or sparse gradients"
    if "forward" in vars(embeddings):
        return "the embedding's forward is already replaced"
    if args is not None and (uses_sharding_engine(args) or getattr(args, "world_size", 1) > 1):
        return "more than one process or a sharding engine trains the model"
    if args is not None and getattr(args, "torch_compile", False):
        return "torch.compile traces the model"
    return None


@contextlib.contextmanager
def sparse_tied_embedding_grad(model: nn.Module, args: Any = None) -> Iterator[bool]:
    """Within the block, the tied input embeddings of `model` return sparse weight gradients (see the module's
    docstring) when [`tied_embedding_grad_fallback_reason`] finds no reason against it. Only the embedding's instance
    `forward` is replaced (its module hooks still run); lookups without gradients take `F.embedding`. Yields whether
    it was replaced."""
    if tied_embedding_grad_fallback_reason(model, args) is not None:
        yield False
        return
    embeddings = getattr(model, "module", model).get_input_embeddings()

    def forward(ids: torch.Tensor) -> torch.Tensor:
        weight = embeddings.weight
        if not (torch.is_grad_enabled() and weight.requires_grad):
            return F.embedding(ids, weight, embeddings.padding_idx)
        return _EmbeddingAddingIntoGrad.apply(ids, weight, embeddings.padding_idx, _grad_accumulator(weight))

    embeddings.forward = forward
    try:
        yield True
    finally:
        del embeddings.forward
