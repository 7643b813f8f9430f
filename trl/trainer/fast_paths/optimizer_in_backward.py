"""Optimizer steps taken in the backward pass, each parameter's as soon as its gradient is complete.

Replaces: the optimizer step after the backward pass, for which every parameter's gradient exists at once (at
Qwen2.5-0.5B's shape in fp32, 1 884 MiB on top of the weights and Adam's moments). Clipping by the global norm needs
all of them before any update; without clipping (`max_grad_norm=0`) nothing does. Then each parameter is stepped by
the trainer's own optimizer from a post-accumulate-grad hook on the last micro-batch of a step, and its gradient is
freed there, so the backward pass holds the gradients of a few layers instead of the whole model's.

The update is the optimizer's own `step()`, run on a single parameter: the elementwise optimizers this takes
(`torch.optim.Adam`, `AdamW` and `SGD`, fused or not) compute each parameter's update from its own gradient and state
only, so the values are those of the step after the backward pass. The norm transformers logs as `grad_norm` is
computed from each gradient before it is freed, in the order and with the kernel `clip_grad_norm_` uses. The
trainer's `optimizer.step()` then finds only the gradients left to it (the input embeddings', which tied heads and
the sparse tied-embedding path complete at the end of the backward) and steps those.

Predicate: [`optimizer_in_backward_fallback_reason`] (no clipping, one process without DeepSpeed, FSDP or a gradient
scaler, one of the optimizers above without step hooks, no callback acting around the optimizer step and no
`training_step` of a subclass that could read the gradients afterwards).
Equality test: `tests/test_optimizer_in_backward.py`. Gain: `docs/benchmarks.md`, "Optimizer steps in the backward".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
from transformers import TrainerCallback

from ..utils.distributed import uses_sharding_engine


_ELEMENTWISE_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
_OPTIMIZER_CALLBACKS = ("on_pre_optimizer_step", "on_optimizer_step")
# Ids of the parameters whose gradients the current backward pass steps and frees (see `stepped_in_backward`).
_STEPPED: set[int] = set()


def stepped_in_backward(parameter: nn.Parameter) -> bool:
    """Whether the backward pass under way steps `parameter` and frees its gradient: its gradient never coexists
    with the others (the layer checkpoints' memory budget does not count it)."""
    return id(parameter) in _STEPPED


def _subclass_overrides(trainer: Any, name: str) -> bool:
    """Whether a class outside `trl` and `transformers` (a user's subclass or plugin) defines `name`."""
    return any(
        name in vars(cls) and not cls.__module__.startswith(("trl.", "transformers.")) for cls in type(trainer).__mro__
    )


def optimizer_in_backward_fallback_reason(trainer: Any) -> str | None:
    """Why the optimizer of `trainer` must step after the backward pass, or `None` when each parameter may step in
    it."""
    args = trainer.args
    if args.max_grad_norm is not None and args.max_grad_norm > 0:
        return "gradients are clipped by their global norm (max_grad_norm > 0)"
    accelerator = trainer.accelerator
    if accelerator.num_processes > 1 or uses_sharding_engine(args):
        return "more than one process or a sharding engine trains the model"
    if getattr(accelerator, "scaler", None) is not None:
        return "a gradient scaler unscales the gradients before the step"
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    if type(optimizer) not in _ELEMENTWISE_OPTIMIZERS or optimizer.defaults.get("differentiable"):
        return f"{type(optimizer).__name__} is not one of Adam, AdamW or SGD"
    if getattr(optimizer, "_optimizer_step_pre_hooks", None) or getattr(optimizer, "_optimizer_step_post_hooks", None):
        return "the optimizer has step hooks (they expect one step over all parameters)"
    for callback in trainer.callback_handler.callbacks:
        for name in _OPTIMIZER_CALLBACKS:
            if getattr(type(callback), name, None) is not getattr(TrainerCallback, name):
                return f"{type(callback).__name__} overrides {name}"
    if _subclass_overrides(trainer, "training_step"):
        return "a subclass overrides training_step (it may read the gradients after the backward)"
    return None


class StepsInBackward:
    """The per-parameter steps of one backward pass and the gradient norms taken before each gradient was freed."""

    def __init__(self, optimizer: torch.optim.Optimizer, parameters: list[nn.Parameter]):
        self.optimizer = optimizer
        self.parameters = parameters
        self.norms: dict[int, torch.Tensor] = {}
        self._grad_kinds: dict[int, tuple[torch.device, torch.dtype]] = {}
        self._group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}

    def step(self, parameter: nn.Parameter) -> None:
        """Records the norm of `parameter`'s gradient, steps it alone with the optimizer and frees the gradient."""
        key = id(parameter)
        if key in self.norms:
            raise RuntimeError(
                f"The gradient of a parameter of shape {tuple(parameter.shape)} was accumulated again after the "
                "optimizer had already stepped it in this backward pass: each parameter must receive its gradient "
                "once per backward (a weight shared across reentrant checkpoints does not). Set max_grad_norm > 0 "
                "to step after the backward pass instead."
            )
        self.norms[key] = torch._foreach_norm([parameter.grad], 2.0)[0]
        self._grad_kinds[key] = (parameter.grad.device, parameter.grad.dtype)
        group = self._group_of[key]
        groups = self.optimizer.param_groups
        self.optimizer.param_groups = [{**group, "params": [parameter]}]
        try:
            self.optimizer.step()
        finally:
            self.optimizer.param_groups = groups
        parameter.grad = None

    def total_norm(self) -> torch.Tensor:
        """The 2-norm of all gradients of the step, as `clip_grad_norm_(parameters, inf)` computes it: the norms of
        the stepped gradients and of those still held, grouped by device and dtype, each group in parameter order."""
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for p in self.parameters:
            if id(p) in self.norms:
                groups.setdefault(self._grad_kinds[id(p)], []).append(self.norms[id(p)])
            elif p.grad is not None:
                groups.setdefault((p.grad.device, p.grad.dtype), []).append(torch._foreach_norm([p.grad], 2.0)[0])
        norms = [norm for group in groups.values() for norm in group]
        if not norms:
            return torch.tensor(0.0)
        first_device = norms[0].device
        stacked = torch.stack([torch.linalg.vector_norm(n, 2.0).to(first_device) for n in norms])
        return torch.linalg.vector_norm(stacked, 2.0)


def _input_embedding_weight(model: nn.Module) -> nn.Parameter | None:
    """The input embeddings' weight: tied heads and the sparse tied-embedding path add to its gradient at the end of
    the backward pass, after its accumulate-grad hook has run."""
    get = getattr(getattr(model, "module", model), "get_input_embeddings", None)
    embeddings = get() if callable(get) else None
    return getattr(embeddings, "weight", None)


@contextlib.contextmanager
def optimizer_steps_in_backward(trainer: Any, model: nn.Module) -> Iterator[StepsInBackward | None]:
    """Within the block, the backward pass of the last micro-batch of a step steps each trainable parameter of
    `model` with the trainer's optimizer once its gradient is complete (see the module's docstring), when
    [`optimizer_in_backward_fallback_reason`] finds nothing against it. Yields the steps taken, or `None`."""
    if not trainer.accelerator.sync_gradients or optimizer_in_backward_fallback_reason(trainer) is not None:
        yield None
        return
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    parameters = list(getattr(model, "module", model).parameters())
    shared: set[int] = set()
    seen: set[int] = set()
    for _, p in getattr(model, "module", model).named_parameters(remove_duplicate=False):
        (shared if id(p) in seen else seen).add(id(p))
    embedding = _input_embedding_weight(model)
    steps = StepsInBackward(optimizer, parameters)
    stepped = [
        p
        for p in parameters
        if p.requires_grad and id(p) in in_optimizer and id(p) not in shared and p is not embedding
    ]
    handles = [p.register_post_accumulate_grad_hook(steps.step) for p in stepped]
    _STEPPED.update(id(p) for p in stepped)
    try:
        yield steps
    finally:
        _STEPPED.clear()
        for handle in handles:
            handle.remove()
