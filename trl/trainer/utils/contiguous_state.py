"""Gradients and Adam moments of the trained parameters in one buffer each, allocated once per `train()` call.

On a CPU, tensors live in glibc's heap. Autograd allocates every parameter's gradient during the backward pass, in
between the activations it is freeing, and keeps it until the optimizer step; Adam allocates its moments at the
first step. These long-lived 1-10 MB blocks end up scattered through the heap, and the freed activations around them
form holes that later, differently sized tensors cannot reuse, so the heap (and the resident set) keeps growing.
glibc never returns such holes to the system.

[`ContiguousTrainingState`] puts these long-lived tensors into one buffer per kind instead; a buffer that large is
mapped on its own, outside the heap, unless the heap has a free stretch that fits it. Before the first micro-batch of
each optimizer step it points every trained parameter's `.grad` at its zeroed slice of the gradient buffer, so
autograd accumulates into it in place (`0 + g == g`: the values are those of a fresh gradient). After each
micro-batch, parameters that received no gradient get `.grad = None` back, as they would have had; right before the
optimizer step, Adam's state of a parameter seen for the first time is created as the optimizer would create it,
with the moments as slices of two more buffers. Between steps `.grad` is `None`, as usual; only the memory behind it
differs.

[`contiguous_state_fallback_reason`] says when it is not used: distributed training and sharding engines (they own
gradient storage), parameters off the CPU (the CUDA caching allocator has no such problem), embeddings with sparse
gradients, and optimizers that are not `torch.optim` optimizers.
"""

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from .distributed import uses_sharding_engine


try:  # Adam's own choice of dtype for its `step` counter, so that the state created here is the state it creates
    from torch.optim.optimizer import _get_scalar_dtype
except ImportError:  # pragma: no cover - a torch without it: Adam then creates its state itself
    _get_scalar_dtype = None


def _trained_parameters(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    seen, params = set(), []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                params.append(param)
    return params


def _torch_optimizer(optimizer: Any) -> Any:
    """The `torch.optim` optimizer behind accelerate's wrapper (or `optimizer` itself)."""
    return getattr(optimizer, "optimizer", optimizer)


def contiguous_state_fallback_reason(args: Any, optimizer: Any, model: nn.Module | None = None) -> str | None:
    """Why [`ContiguousTrainingState`] is not used for this training run, or None when it is.

    Args:
        args: The trainer's `TrainingArguments`.
        optimizer: The trainer's optimizer (accelerate's wrapper or a `torch.optim.Optimizer`).
        model: The trained model, checked for embeddings with sparse gradients (which a dense buffer would densify).

    Returns:
        A short reason, or None.
    """
    if getattr(args, "world_size", 1) != 1 or uses_sharding_engine(args):
        return "distributed training or a sharding engine owns the gradients"
    inner = _torch_optimizer(optimizer)
    if not isinstance(inner, torch.optim.Optimizer):
        return f"optimizer {type(inner).__name__} is not a torch.optim optimizer"
    params = _trained_parameters(inner)
    if not params:
        return "no trained parameters"
    for param in params:
        if param.device.type != "cpu" or not param.is_floating_point() or param.is_sparse:
            return "a trained parameter is not a dense floating-point CPU tensor"
        if type(param) is not nn.Parameter or hasattr(param, "ds_id"):
            return "a trained parameter is a subclass (quantized or sharded)"
    if model is not None and any(getattr(module, "sparse", False) is True for module in model.modules()):
        return "an embedding has sparse gradients"
    return None


def _slices(params: list[nn.Parameter], buffers: dict[torch.dtype, torch.Tensor]) -> list[torch.Tensor]:
    """A view of the right shape per parameter, consecutive in the buffer of its dtype."""
    offsets = dict.fromkeys(buffers, 0)
    views = []
    for param in params:
        start = offsets[param.dtype]
        offsets[param.dtype] = start + param.numel()
        views.append(buffers[param.dtype][start : start + param.numel()].view_as(param))
    return views


def _empty_buffers(params: list[nn.Parameter]) -> dict[torch.dtype, torch.Tensor]:
    sizes: dict[torch.dtype, int] = {}
    for param in params:
        sizes[param.dtype] = sizes.get(param.dtype, 0) + param.numel()
    # `empty`, not `zeros`: slices are zeroed when taken into use. (Anonymous mappings of their own, outside glibc's
    # heap, measured ~10 % slower GRPO steps; malloc maps requests this large on their own unless the heap has a free
    # stretch that fits, which it then reuses.)
    return {dtype: torch.empty(size, dtype=dtype) for dtype, size in sizes.items()}


class ContiguousTrainingState:
    """Keeps the trained parameters' gradients (and Adam's moments) in contiguous buffers; see the module docstring.

    Args:
        optimizer: The trainer's optimizer (accelerate's wrapper or a `torch.optim.Optimizer`); check
            [`contiguous_state_fallback_reason`] first.
    """

    def __init__(self, optimizer: Any):
        self.optimizer = _torch_optimizer(optimizer)
        self.params = _trained_parameters(self.optimizer)
        self._grad_buffers = _empty_buffers(self.params)
        self._grad_views = _slices(self.params, self._grad_buffers)
        self._moment_views: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._received: set[int] = set()
        self._handles = [param.register_post_accumulate_grad_hook(self._mark_received) for param in self.params]
        self._handles.append(self.optimizer.register_step_pre_hook(self._before_step))

    def _mark_received(self, param: torch.Tensor) -> None:
        self._received.add(id(param))

    def before_micro_batch(self) -> None:
        """Point every gradient at its zeroed slice at the start of an optimizer step (all gradients are `None`);
        later micro-batches of the step accumulate as usual."""
        if any(param.grad is not None for param in self.params):
            return
        self._received.clear()
        for buffer in self._grad_buffers.values():
            buffer.zero_()
        for param, view in zip(self.params, self._grad_views):
            param.grad = view

    def after_micro_batch(self) -> None:
        """Give `.grad = None` back to parameters no backward pass of this step has reached so far (as they would
        have it without the buffer), before gradient clipping, callbacks or the optimizer look at the gradients."""
        for param in self.params:
            if param.grad is not None and id(param) not in self._received and self._owns_grad(param):
                param.grad = None

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.after_micro_batch()  # (a no-op after the trainer's own call; kept for direct use of the class)
        if self._adam_state_supported():
            self._create_adam_state()

    def _owns_grad(self, param: nn.Parameter) -> bool:
        buffer = self._grad_buffers.get(param.grad.dtype)
        return buffer is not None and param.grad.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()

    def _adam_state_supported(self) -> bool:
        # Exact classes: a subclass may keep other state; its own lazy initialisation then runs as usual.
        return _get_scalar_dtype is not None and type(self.optimizer) in (torch.optim.Adam, torch.optim.AdamW)

    def _create_adam_state(self) -> None:
        """Adam's lazy state initialisation (same keys, dtypes, devices and zeros), with the moments as slices of
        two buffers, for the parameters about to be updated for the first time."""
        if self._moment_views is None:
            first, second = _empty_buffers(self.params), _empty_buffers(self.params)
            self._moment_views = list(zip(_slices(self.params, first), _slices(self.params, second)))
        moments = {id(param): views for param, views in zip(self.params, self._moment_views)}
        for group in self.optimizer.param_groups:
            if group.get("amsgrad") or group.get("differentiable"):
                continue
            for param in group["params"]:
                # (Looked up only for parameters with a gradient: `state` is a defaultdict, as Adam uses it.)
                if param.grad is None or id(param) not in moments or len(self.optimizer.state[param]) != 0:
                    continue
                state = self.optimizer.state[param]
                if group["capturable"] or group["fused"]:
                    step = torch.zeros((), dtype=_get_scalar_dtype(is_fused=group["fused"]), device=param.device)
                else:
                    step = torch.tensor(0.0, dtype=_get_scalar_dtype(), device="cpu")
                exp_avg, exp_avg_sq = moments[id(param)]
                state["step"] = step
                state["exp_avg"] = exp_avg.zero_()
                state["exp_avg_sq"] = exp_avg_sq.zero_()

    def close(self) -> None:
        """Remove the hooks and release the buffers (gradients still pointing into them are kept as they are)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._grad_views = []
        self._grad_buffers = {}


@contextlib.contextmanager
def contiguous_training_state(trainer: Any) -> Iterator[None]:
    """For the length of a `train()` call: let `trainer.training_step` set up [`ContiguousTrainingState`] on its
    first call (the optimizer exists by then) and remove it afterwards."""
    trainer._contiguous_state = None
    trainer._contiguous_state_checked = False
    try:
        yield
    finally:
        state = getattr(trainer, "_contiguous_state", None)
        if state is not None:
            state.close()
        trainer._contiguous_state = None
        trainer._contiguous_state_checked = False


def prepare_contiguous_gradients(trainer: Any) -> None:
    """Called at the start of each training micro-batch: set up the contiguous state on the first call of a
    `train()` run when it applies, then point the gradients into it at the start of each optimizer step."""
    if not getattr(trainer, "_contiguous_state_checked", True):
        trainer._contiguous_state_checked = True
        optimizer = getattr(trainer, "optimizer", None)
        model = getattr(trainer, "model", None)
        if optimizer is not None and contiguous_state_fallback_reason(trainer.args, optimizer, model) is None:
            trainer._contiguous_state = ContiguousTrainingState(optimizer)
    state = getattr(trainer, "_contiguous_state", None)
    if state is not None:
        state.before_micro_batch()


def finish_contiguous_micro_batch(trainer: Any) -> None:
    """Called at the end of each training micro-batch: parameters the backward passes have not reached get
    `.grad = None` back (see [`ContiguousTrainingState.after_micro_batch`])."""
    state = getattr(trainer, "_contiguous_state", None)
    if state is not None:
        state.after_micro_batch()
