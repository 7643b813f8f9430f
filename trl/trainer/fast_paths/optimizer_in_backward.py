"""Optimizer steps taken in the backward pass, each parameter's as soon as its gradient is complete.

Replaces: the optimizer step after the backward pass, for which every parameter's gradient exists at once (at
Qwen2.5-0.5B's shape in fp32, 1 884 MiB on top of the weights and Adam's moments). Without clipping
(`max_grad_norm=0`) each parameter is stepped by the trainer's own optimizer from a post-accumulate-grad hook on the
last micro-batch of a step, and its gradient is freed there, so the backward pass holds the gradients of a few layers
instead of the whole model's.

Clipping by the global norm needs every gradient before any update. With clipping, in the trainers whose steps are
mostly generation (`_clips_in_two_backward_passes`: the online trainers sampling several completions a prompt, whose
rollouts also press on memory), the backward pass runs twice over the same graph (`retain_graph`): the first takes
each gradient's norm and frees it, the second scales each gradient by the clipping coefficient of the global norm, as
`clip_grad_norm_` does, and steps it. The gradients never coexist, for one more backward pass (GRPO at Qwen2.5-0.5B's
shape on a CPU: 1.47x the step's time, 0.84x its peak tensor memory; a padded SFT step took 2x its time and on-policy
distillation's 1.51x, hence not there).

The update is the optimizer's own `step()`, run on a single parameter: the elementwise optimizers this takes
(`torch.optim.Adam`, `AdamW` and `SGD`, fused or not) compute each parameter's update from its own gradient and state
only, so the values are those of the step after the backward pass. The norm transformers logs as `grad_norm` is
computed from each gradient before it is freed, in the order and with the kernel `clip_grad_norm_` uses. The
trainer's `optimizer.step()` then finds only the gradients left to it (the input embeddings', which tied heads and
the sparse tied-embedding path complete at the end of the backward) and steps those.

Predicate: [`optimizer_in_backward_fallback_reason`] (no clipping, or the two passes: an online trainer, one
micro-batch a step, transformers' `_clip_grad_norm` not overridden, neither liger's kernels nor torch.compile, no
backward hooks that would run twice, more than adapters trained; then one process without
DeepSpeed, FSDP or a gradient scaler, one of the optimizers above without step hooks, no callback acting around the
optimizer step and no `training_step` of a subclass that could read the gradients afterwards).
Equality test: `tests/test_optimizer_in_backward.py`. Gain: `docs/benchmarks.md`, "Optimizer steps in the backward".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
from transformers import TrainerCallback

from ..._compat import trainer_clips_in_a_method
from ...kernels.linear_log_softmax import retaining_graph
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
    it (in one backward pass without clipping, in the second of two with it)."""
    args = trainer.args
    if args.max_grad_norm is not None and args.max_grad_norm > 0:
        reason = _two_pass_fallback_reason(trainer)
        if reason is not None:
            return f"gradients are clipped by their global norm (max_grad_norm > 0) and {reason}"
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


def _two_pass_fallback_reason(trainer: Any) -> str | None:
    """Why the clipped gradients of `trainer`'s step must all be held at once after one backward pass."""
    if trainer.args.gradient_accumulation_steps > 1:
        return "the step accumulates several micro-batches (their gradients are held between them anyway)"
    if not trainer_clips_in_a_method() or _subclass_overrides(trainer, "_clip_grad_norm"):
        return "the clipping is not transformers' `_clip_grad_norm` (older transformers or a subclass's)"
    if getattr(trainer.args, "use_liger_kernel", False) or getattr(trainer.args, "torch_compile", False):
        return "liger's kernels or torch.compile run the backward pass (made for one pass over the graph)"
    model = getattr(trainer.model, "module", trainer.model)
    if any(m._backward_hooks or m._backward_pre_hooks for m in model.modules()) or any(
        p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None) for p in model.parameters()
    ):
        return "the model has backward hooks, which a second backward pass would run again"
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if trained * 10 < sum(p.numel() for p in model.parameters()):
        return "less than a tenth of the weights is trained (adapters): their gradients are small"
    if not trainer._clips_in_two_backward_passes:
        return f"{type(trainer).__name__}'s backward pass is too large a part of its step to run twice"
    return None


class StepsInBackward:
    """The per-parameter steps of one backward pass and the gradient norms taken before each gradient was freed."""

    def __init__(self, optimizer: torch.optim.Optimizer, parameters: list[nn.Parameter]):
        self.optimizer = optimizer
        self.parameters = parameters
        self.norms: dict[int, torch.Tensor] = {}
        self._grad_kinds: dict[int, tuple[torch.device, torch.dtype]] = {}
        self._group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
        # Set by a first backward pass of two (clipping): the global norm and the factor each gradient is scaled by.
        self.clipped_norm: torch.Tensor | None = None
        self.clip_coef: torch.Tensor | None = None

    def record(self, parameter: nn.Parameter) -> None:
        """Records the norm of `parameter`'s gradient (once per backward pass) and frees the gradient."""
        self._record_norm(parameter)
        parameter.grad = None

    def _record_norm(self, parameter: nn.Parameter) -> None:
        key = id(parameter)
        if key in self.norms:
            raise RuntimeError(
                f"The gradient of a parameter of shape {tuple(parameter.shape)} was accumulated again after the "
                "optimizer had already stepped it in this backward pass: each parameter must receive its gradient "
                "once per backward (a weight shared across reentrant checkpoints does not). Use non-reentrant "
                "gradient checkpointing (gradient_checkpointing_kwargs={'use_reentrant': False})."
            )
        self.norms[key] = torch._foreach_norm([parameter.grad], 2.0)[0]
        self._grad_kinds[key] = (parameter.grad.device, parameter.grad.dtype)

    def clip_after_first_pass(self, max_norm: float) -> None:
        """Takes the global norm of the first pass's gradients (those recorded and those still held, which are then
        freed) and the clipping coefficient `clip_grad_norm_` would scale them by; the second pass steps."""
        self.clipped_norm = self.total_norm()
        self.clip_coef = torch.clamp(max_norm / (self.clipped_norm + 1e-6), max=1.0)
        for p in self.parameters:
            p.grad = None
        self.norms.clear()

    def clip_held(self, parameters: Iterator[nn.Parameter]) -> torch.Tensor:
        """Scales the gradients left after the second pass (the input embeddings') as `clip_grad_norm_` would, and
        returns the global norm of the first pass."""
        grads = [p.grad for p in parameters if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, self.clip_coef.to(grads[0].device))
        return self.clipped_norm

    def step(self, parameter: nn.Parameter) -> None:
        """Records the norm of `parameter`'s gradient, scales it by the clipping coefficient of a first pass (if any),
        steps it alone with the optimizer and frees the gradient."""
        self._record_norm(parameter)
        if self.clip_coef is not None:
            parameter.grad.mul_(self.clip_coef.to(parameter.grad.device))
        group = self._group_of[id(parameter)]
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
    [`optimizer_in_backward_fallback_reason`] finds nothing against it: after a first pass that takes the gradients'
    norms, when they are clipped. Yields the steps taken, or `None`."""
    accelerator = trainer.accelerator
    steps = None
    if accelerator.sync_gradients and optimizer_in_backward_fallback_reason(trainer) is None:
        steps, backward = _steps_and_backward(trainer, model, accelerator.backward)
        patched = "backward" in vars(accelerator), vars(accelerator).get("backward")
        accelerator.backward = backward
    try:
        yield steps
    finally:
        if steps is not None:
            if patched[0]:
                accelerator.backward = patched[1]
            else:
                del accelerator.backward
        _STEPPED.clear()


def _steps_and_backward(trainer: Any, model: nn.Module, backward: Any) -> tuple[StepsInBackward, Any]:
    """The steps of the parameters stepped in the backward pass, and the backward function that takes them."""
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
    _STEPPED.update(id(p) for p in stepped)
    max_norm = trainer.args.max_grad_norm

    def hooked_backward(hook: Any, loss: torch.Tensor, **kwargs: Any) -> None:
        handles = [p.register_post_accumulate_grad_hook(hook) for p in stepped]
        try:
            backward(loss, **kwargs)
        finally:
            for handle in handles:
                handle.remove()

    def steps_in_backward(loss: torch.Tensor, **kwargs: Any) -> None:
        if steps.clip_coef is not None:
            raise RuntimeError(
                "A second backward pass ran in a training step whose clipped gradients were already stepped: the "
                "step's gradients must come from one `accelerator.backward` call."
            )
        if max_norm is not None and max_norm > 0:
            with retaining_graph():
                hooked_backward(steps.record, loss, **{**kwargs, "retain_graph": True})
            steps.clip_after_first_pass(max_norm)
        hooked_backward(steps.step, loss, **kwargs)

    return steps, steps_in_backward
