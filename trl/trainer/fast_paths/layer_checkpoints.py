"""Gradient checkpointing of decoder layers whose kept outputs live in a reusable buffer, allocated once a run.

With gradient checkpointing, each decoder layer's output is the one activation kept from the forward pass to the
backward pass (it is the next layer's checkpointed input). On the CPU these outputs are allocated in glibc's heap
between the layers' short-lived temporaries, and the holes they leave when freed keep the heap growing: in the packed
SFT benchmark, half of the heap was free at the peak. [`lean_layer_checkpoints`] gives transformers' checkpointed
decoder layers a checkpoint function that runs the layer without gradients, as torch's non-reentrant checkpoint does,
and copies its output into a [`CheckpointArena`]: chunks sized to what a step keeps, allocated once and reused every
step. The backward pass recomputes the layer from its kept input and back-propagates through
it, skipping the product of the MLP's down projection whose value the recompute never reads (as torch's early-stopping
recompute does; under plain LoRA, the base layer's product, the adapters' terms still running). A plain SwiGLU MLP is recomputed by the lean kernel (`trl.kernels.decoder_layers.swiglu_mlp` with its
output unused), which keeps none of the four `tokens x intermediate` tensors plain autograd keeps for the backward
pass: its backward pass computes the gate and up projections a block of rows at a time. Values are those of torch's
checkpoint, and gradients equal them to float rounding (the weights' gradients sum the blocks' products).

With `CheckpointArena(split_layers=True)` (trainers holding a separate reference model, whose weights already press
on memory), the backward pass recomputes and back-propagates a layer's MLP block and then its attention block, one
after the other (the attention block's output recomputed once more without gradients: 2-10 % more CPU time), once
the layer's class was checked to compute the layer's output that way: the two blocks' saved activations are never
held at once, and the gradients are the whole layer's, bitwise. The first forward, without gradients, runs a SwiGLU
MLP with its activation in place (`lean_modules.mlps_without_grad`).

The last layers of a forward pass may keep their activations instead, when that cannot raise the step's peak
([`LayerBudget`]): after the optimizer's first step, the peak comes at the end of the backward pass, with every
gradient allocated, and the activations of the last layers are freed before most of those gradients exist. Each kept
layer saves its recompute (a quarter of its FLOPs in a training step).

It applies to transformers' Llama / Mistral / Qwen2 / Qwen3 decoder layers on the CPU, in a single process, with the
default checkpoint settings, and without dropout or autocast (torch's checkpoint would have to replay their random
numbers and autocast state); [`layer_checkpoint_fallback_reason`] says why not otherwise, and the layer keeps
transformers' checkpoint function.
"""

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from ..._compat import CACHE_KEYWORDS, cache_keyword
from ...kernels.decoder_layers import swiglu_mlp
from ..utils.forward_randomness import has_dropout
from ..utils.logprobs import head_output_bytes
from .lean_modules import is_unhooked_lean_swiglu_mlp, lean_mlp_kernels, mlps_without_grad, switched_forwards
from .optimizer_in_backward import stepped_in_backward


_LAYER_CLASSES = {
    "transformers.models.llama.modeling_llama": "LlamaDecoderLayer",
    "transformers.models.mistral.modeling_mistral": "MistralDecoderLayer",
    "transformers.models.qwen2.modeling_qwen2": "Qwen2DecoderLayer",
    "transformers.models.qwen3.modeling_qwen3": "Qwen3DecoderLayer",
}


class CheckpointArena:
    """A bump allocator for the checkpointed layer outputs of one training step.

    [`keep`] copies a layer output into the current chunk (a new, larger chunk when it does not fit); each kept
    output is released by its layer's backward pass, and once all are released the next step starts again at the
    beginning of the chunks. Kept outputs are tensors of their own (own version counter) on the chunk's storage.
    """

    def __init__(self, split_layers: bool = False):
        # Whether the layers checkpointed into this arena back-propagate one residual block at a time (see
        # `_CheckpointedLayer`): less memory for one more attention forward per layer.
        self.split_layers = split_layers
        self.budget: LayerBudget | None = None  # which last layers keep their activations (set on first use)
        self.chunks: list[torch.Tensor] = []
        self.offset = 0  # elements used in the last chunk
        self.live = 0
        self.needed = 0  # bytes kept at once at the most, to size the next chunk

    def keep(self, output: torch.Tensor) -> torch.Tensor:
        """A copy of `output` in the arena."""
        count = output.numel()
        nbytes = count * output.element_size()
        chunk = self.chunks[-1] if self.chunks else None
        if chunk is not None and chunk.dtype == output.dtype and chunk.device == output.device:
            start = -(-self.offset * chunk.element_size() // output.element_size())
        else:
            chunk, start = None, 0
        if chunk is None or start + count > chunk.numel():
            # Twice what is held so far while a step's need is unknown (few chunks), then that need in one chunk:
            # a fixed floor would be held for nothing when the kept outputs are small (and counts on a device).
            held = sum(c.numel() * c.element_size() for c in self.chunks)
            size = max(2 * nbytes, 2 * held, self.needed) // output.element_size()
            chunk = torch.empty(size, dtype=output.dtype, device=output.device)
            self.chunks.append(chunk)
            start = 0
        kept = torch.empty(0, dtype=output.dtype, device=output.device)
        kept.set_(chunk.untyped_storage(), start, output.shape)
        kept.copy_(output)
        self.offset = start + count
        self.live += 1
        used = sum(c.numel() * c.element_size() for c in self.chunks[:-1]) + self.offset * chunk.element_size()
        self.needed = max(self.needed, used)
        return kept

    def release(self) -> None:
        """One kept output is no longer needed; when none is, the chunks are reused from the start."""
        self.live -= 1
        if self.live <= 0:
            self.reset()

    def reset(self) -> None:
        """Start again at the beginning; several chunks are merged into one (allocated at the next `keep`)."""
        self.live = 0
        self.offset = 0
        if len(self.chunks) > 1:
            self.chunks = []

    def abandon(self) -> None:
        """Forget the chunks (kept outputs still referenced somewhere keep their memory alive)."""
        self.chunks, self.offset, self.live = [], 0, 0


class _GradientOnlyLinear(torch.autograd.Function):
    """A linear layer whose output value is never read (a checkpointed layer's last projection, recomputed only to
    back-propagate through it): the forward returns zeros without a matrix product, the backward is the linear's."""

    @staticmethod
    def forward(ctx, inputs, weight, bias):
        ctx.save_for_backward(inputs, weight)
        ctx.has_bias = bias is not None
        return inputs.new_zeros(()).expand(*inputs.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output):
        inputs, weight = ctx.saved_tensors
        grad_inputs = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_inputs = grad_output.matmul(weight)
        flat_grad = grad_output.reshape(-1, grad_output.shape[-1])
        if ctx.needs_input_grad[1]:
            grad_weight = flat_grad.t().mm(inputs.reshape(-1, inputs.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = flat_grad.sum(dim=0)
        return grad_inputs, grad_weight, grad_bias


def _plain_unhooked_linear(module: Any) -> bool:
    return (
        type(module) is nn.Linear
        and "forward" not in vars(module)
        and not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks)
    )


@contextlib.contextmanager
def _last_projection_gradient_only(layer: nn.Module) -> Iterator[None]:
    """Within the block, the MLP of `layer` skips the product of its down projection (the last product before the
    layer's output, which a recompute for the backward pass never reads). A supported SwiGLU MLP runs the lean kernel
    with its output unused, which keeps only its input and computes the gate and up projections block by block in
    the backward pass; another MLP's plain down projection runs [`_GradientOnlyLinear`]."""
    mlp = getattr(layer, "mlp", None)
    if is_unhooked_lean_swiglu_mlp(mlp):
        mlp.forward = lambda inputs: swiglu_mlp(
            inputs, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, output_unused=True
        )
        try:
            yield
        finally:
            del mlp.forward
        return
    down = getattr(mlp, "down_proj", None)
    product = down if _plain_unhooked_linear(down) else _lora_base_linear(down)
    if product is None:
        yield
        return
    product.forward = lambda inputs: _GradientOnlyLinear.apply(inputs, product.weight, product.bias)
    try:
        yield
    finally:
        del product.forward


def _lora_base_linear(module: Any) -> nn.Linear | None:
    """The frozen base layer of a PEFT LoRA linear layer whose output is the base layer's plus its adapters' terms
    (plain LoRA: no variant such as DoRA, whose terms read the base output; not merged), both unhooked; else None.
    Only such a sum's gradient with respect to the base product is independent of that product's value."""
    base = getattr(module, "base_layer", None)
    if base is None or not type(module).__module__.startswith("peft.tuners.lora"):
        return None
    if getattr(module, "lora_variant", None) or getattr(module, "merged", True) or "forward" in vars(module):
        return None
    if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks:
        return None
    return base if _plain_unhooked_linear(base) else None


# The keyword arguments a Llama-style decoder layer passes to its attention, with the layer's defaults.
_ATTENTION_DEFAULTS = {
    "attention_mask": None,
    "position_ids": None,
    "use_cache": False,
    "position_embeddings": None,
}
_HALF_MODULES = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
# Decoder layer classes whose forward was checked to equal its two halves (see `_LayerHalves`), bitwise.
_HALVES_VERIFIED: dict[type, bool] = {}


class _LayerHalves:
    """A Llama-style decoder layer's forward as its two residual blocks: `attention(x) = x + self_attn(norm(x))`
    and `mlp(x) = x + mlp(post_norm(x))`, with the keyword arguments of transformers' checkpointed call `function`
    (`partial(forward, layer, **kwargs)`), as the layer's forward passes them."""

    def __init__(self, layer: nn.Module, function: Any):
        attention, norm = layer.self_attn, layer.input_layernorm
        keywords = {**_ATTENTION_DEFAULTS, cache_keyword(attention): None, **function.keywords}
        post_norm, mlp = layer.post_attention_layernorm, layer.mlp
        self.attention = lambda x: x + attention(hidden_states=norm(x), **keywords)[0]
        self.mlp = lambda x: x + mlp(post_norm(x))
        self.attention_modules = (norm, attention)
        self.mlp_modules = (post_norm, mlp)

    @staticmethod
    def of(layer: nn.Module, function: Any) -> "_LayerHalves | None":
        """The halves of `layer` for the call `function`, or None when they may not stand in for it."""
        if not (
            isinstance(function, functools.partial)
            # transformers 5 checkpoints `partial(forward, layer, **kwargs)`, 4.x `partial(layer.__call__, **kwargs)`
            and (
                function.args == (layer,) or (not function.args and getattr(function.func, "__self__", None) is layer)
            )
            and all(function.keywords.get(name) is None for name in CACHE_KEYWORDS)
            and "forward" not in vars(layer)
            and all(hasattr(layer, name) for name in _HALF_MODULES)
        ):
            return None
        # Hooks would run once more for the extra attention forward (or for the check): such layers are not split.
        if any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks for m in layer.modules()):
            return None
        inside = {id(p) for name in _HALF_MODULES for p in getattr(layer, name).parameters()}
        if inside != {id(p) for p in layer.parameters()}:
            return None
        return _LayerHalves(layer, function)


def _check_halves(layer: nn.Module, function: Any, hidden_states: torch.Tensor, output: torch.Tensor) -> None:
    """Record, once per decoder layer class, whether its two halves give `output` (the layer's own forward on
    `hidden_states`) bitwise; the backward pass only splits layers of a class that passed."""
    if type(layer) in _HALVES_VERIFIED:
        return
    halves = _LayerHalves.of(layer, function)
    if halves is not None:
        with torch.no_grad(), mlps_without_grad(layer):
            _HALVES_VERIFIED[type(layer)] = torch.equal(halves.mlp(halves.attention(hidden_states)), output)


class _CheckpointedLayer(torch.autograd.Function):
    """A checkpointed decoder layer: the forward runs it without gradients and keeps the output in the arena; the
    backward recomputes the layer from its input and back-propagates through it.

    With an arena made with `split_layers`, the backward pass goes through the layer's two residual blocks one after
    the other (`_LayerHalves`), when its class was checked to compute the same output that way: the attention
    block's output is recomputed without gradients, the MLP block recomputed and back-propagated, then the attention
    block. The two blocks' saved activations are never held at once (about half of a layer's, at the cost of the
    attention block's forward once more); the operations, and so the gradients, are those of one pass through the
    layer."""

    @staticmethod
    def forward(ctx, function, context, hidden_states, *parameters):
        layer, arena = context
        ctx.function, ctx.layer, ctx.arena = function, layer, arena
        ctx.save_for_backward(hidden_states, *parameters)
        with torch.no_grad(), mlps_without_grad(layer):
            output = function(hidden_states)
        if arena is not None and arena.split_layers:
            _check_halves(layer, function, hidden_states, output)
        return output if arena is None else arena.keep(output)

    @staticmethod
    def backward(ctx, grad_output):
        hidden_states, *parameters = ctx.saved_tensors
        needs = ctx.needs_input_grad[2:]
        split = ctx.arena is not None and ctx.arena.split_layers and _HALVES_VERIFIED.get(type(ctx.layer))
        halves = _LayerHalves.of(ctx.layer, ctx.function) if split else None
        if halves is None:
            with torch.enable_grad(), _last_projection_gradient_only(ctx.layer):
                replay_input = hidden_states.detach().requires_grad_(needs[0])
                output = ctx.function(replay_input)
            wanted = [tensor for tensor, need in zip((replay_input, *parameters), needs) if need]
            grads = iter(torch.autograd.grad(output, wanted, grad_output, allow_unused=True))
            result = [next(grads) if need else None for need in needs]
        else:
            result = _backward_by_halves(ctx.layer, halves, hidden_states, parameters, needs, grad_output)
        if ctx.arena is not None:
            ctx.arena.release()  # this layer's output: every later layer's backward has run
        return (None, None, *result)


def _backward_by_halves(
    layer: nn.Module,
    halves: _LayerHalves,
    hidden_states: torch.Tensor,
    parameters: list[torch.Tensor],
    needs: tuple[bool, ...],
    grad_output: torch.Tensor,
) -> list[torch.Tensor | None]:
    """Gradients of the layer's input and `parameters` (those `needs` asks for), the MLP block first."""
    wanted_ids = {id(p) for p, need in zip(parameters, needs[1:]) if need}
    grads: dict[int, torch.Tensor | None] = {}

    def trainable(modules: tuple[nn.Module, ...]) -> list[torch.Tensor]:
        return [p for module in modules for p in module.parameters() if id(p) in wanted_ids]

    with torch.no_grad():
        middle = halves.attention(hidden_states)
    with torch.enable_grad(), _last_projection_gradient_only(layer):
        middle.requires_grad_(True)
        output = halves.mlp(middle)
    mlp_parameters = trainable(halves.mlp_modules)
    grad_middle, *mlp_grads = torch.autograd.grad(output, [middle, *mlp_parameters], grad_output, allow_unused=True)
    grads.update(zip(map(id, mlp_parameters), mlp_grads))
    del output, middle, mlp_grads

    attention_parameters = trainable(halves.attention_modules)
    grad_input = None
    if needs[0] or attention_parameters:  # nothing to back-propagate into below a frozen attention block otherwise
        with torch.enable_grad():
            replay_input = hidden_states.detach().requires_grad_(needs[0])
            middle = halves.attention(replay_input)
        inputs = [replay_input] if needs[0] else []
        attention_grads = torch.autograd.grad(middle, [*inputs, *attention_parameters], grad_middle, allow_unused=True)
        grads.update(zip(map(id, attention_parameters), attention_grads[len(inputs) :]))
        grad_input = attention_grads[0] if needs[0] else None
    return [grad_input, *(grads.get(id(p)) if need else None for p, need in zip(parameters, needs[1:]))]


def checkpointed_layer(
    layer: nn.Module,
    function: Any,
    hidden_states: torch.Tensor,
    arena: CheckpointArena | None = None,
) -> torch.Tensor:
    """Run `function(hidden_states)` as a checkpointed layer (see [`_CheckpointedLayer`])."""
    trainable = [parameter for parameter in layer.parameters() if parameter.requires_grad]
    # The context travels in a tuple: tensors among the inputs would be taken for inputs of the graph.
    return _CheckpointedLayer.apply(function, (layer, arena), hidden_states, *trainable)


def layer_checkpoint_fallback_reason(layer: nn.Module) -> str | None:
    """Why [`lean_layer_checkpoints`] leaves `layer` with transformers' checkpoint function, or None when it can
    replace it.

    Args:
        layer: A decoder layer.

    Returns:
        A short reason, or None.
    """
    cls = type(layer)
    if _LAYER_CLASSES.get(cls.__module__) != cls.__name__:
        return f"decoder layer {cls.__module__}.{cls.__name__} is not a Llama-style one"
    if not getattr(layer, "gradient_checkpointing", False) or "_gradient_checkpointing_func" not in vars(layer):
        return "gradient checkpointing off"
    parameter = next(layer.parameters(), None)
    if parameter is None or parameter.device.type != "cpu" or hasattr(parameter, "ds_id"):
        return "parameters not dense CPU tensors of this process"
    if has_dropout(layer, active_only=False):
        return "dropout in the layer"
    if getattr(getattr(layer, "self_attn", None), "attention_dropout", 0.0):
        return "attention dropout"
    return None


class LayerBudget:
    """Which of the last checkpointed decoder layers of a forward pass keep their activations instead.

    Gradient checkpointing exists to keep the peak of a step down. Once the optimizer has run, the backward pass
    allocates every trained parameter's gradient again, and the step's peak comes at its end, with all of them
    allocated. Activations that a layer keeps are freed when its own backward has run, early in the backward pass for
    the last layers. Such a layer's activations fit under that peak as long as all kept layers' activations together
    stay within the gradients of the decoder layers that are still unallocated (`grad` None) when the forward pass
    starts, less a margin: the largest layer's gradients (the working memory of one layer's backward pass) and the
    memory the head's output and the loss on it hold with the kept activations at the end of the forward pass: the
    fused LM head's working memory, or what a trainer declared for small logits
    ([`~trl.trainer.utils.logprobs.small_head_output`]). Layers are kept only in forward passes so bounded
    ([`~trl.trainer.utils.logprobs.head_output_bytes`]): full logits would sit on top of the kept activations.
    Those layers run with plain autograd (their MLPs through the lean kernel of
    [`~trl.trainer.fast_paths.lean_modules.lean_mlp_kernels`]) and are not recomputed: the values and gradients of
    torch's checkpoint, bitwise, and one layer forward fewer each.

    With gradient accumulation the gradients of later micro-batches are allocated, so those forward passes keep
    nothing; gradients that the backward pass steps and frees at once (without clipping: see
    [`~trl.trainer.fast_paths.optimizer_in_backward.stepped_in_backward`]) never make that peak and leave no room.
    Trainers that run a reference model between the policy's forward and backward do not keep layers
    (`lean_layer_checkpoints(..., keep_activations=False)`): its working memory would sit on top of them. The
    activation bytes per token are measured on the last layer of the first forward pass (the one layer kept before any
    measurement: its recompute would build the same activations at the start of the backward pass).
    """

    def __init__(self, layers: list[nn.Module], model: nn.Module):
        self.layers = layers
        self.model = model
        self.position = {id(layer): index for index, layer in enumerate(layers)}
        self.bytes_per_token: float | None = None
        self.keep_from = len(layers)
        self.outstanding = 0.0  # bytes kept by layers whose backward has not run yet

    def plan(self, tokens: int) -> None:
        """Decides, at the first layer of a forward pass over `tokens` tokens, which last layers keep activations."""
        sizes = [
            sum(
                p.numel() * p.element_size()
                for p in layer.parameters()
                if p.requires_grad and p.grad is None and not stepped_in_backward(p)
            )
            for layer in self.layers
        ]
        head_bytes = head_output_bytes(self.model)
        if head_bytes is None:
            kept = 0
        elif self.bytes_per_token is None:
            kept = 1
        else:
            margin = max(sizes, default=0) + head_bytes
            free = sum(sizes) - margin - self.outstanding
            kept = int(max(free, 0) // max(self.bytes_per_token * tokens, 1.0))
        self.keep_from = len(self.layers) - min(kept, len(self.layers))

    def keeps(self, layer: nn.Module) -> bool:
        return self.position.get(id(layer), -1) >= self.keep_from

    def run_kept(self, layer: nn.Module, function: Any, hidden_states: torch.Tensor) -> torch.Tensor:
        """`function(hidden_states)` with plain autograd, its MLP through the lean kernel."""
        tokens = hidden_states.shape[:-1].numel()
        measure = self.bytes_per_token is None
        saved: dict[tuple[int, int], int] = {}
        parameter_storages = {p.untyped_storage().data_ptr() for p in layer.parameters()} if measure else set()

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            # The tensor's own bytes, not its storage's: the layer's input may be a view into the arena's chunk.
            if tensor.untyped_storage().data_ptr() not in parameter_storages:
                saved[(tensor.data_ptr(), tensor.numel())] = tensor.numel() * tensor.element_size()
            return tensor

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor) if measure else None
        with switched_forwards(lean_mlp_kernels(layer)), hooks or contextlib.nullcontext():
            output = function(hidden_states)
        if measure:
            self.bytes_per_token = sum(saved.values()) / max(tokens, 1)
        kept_bytes = self.bytes_per_token * tokens
        self.outstanding += kept_bytes
        if output.requires_grad:
            output.register_hook(functools.partial(self._released, kept_bytes))
        return output

    def _released(self, kept_bytes: float, grad: torch.Tensor) -> None:
        self.outstanding = max(self.outstanding - kept_bytes, 0.0)


def _lean_checkpoint(
    layer: nn.Module, arena: CheckpointArena, original: Any, function: Any, *args: Any, **kwargs: Any
) -> torch.Tensor:
    """The checkpoint function [`lean_layer_checkpoints`] installs: [`checkpointed_layer`] for a plain call, or the
    plain layer for the last layers the arena's [`LayerBudget`] keeps; the original one for anything else (keyword
    arguments, autocast)."""
    if kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor) or torch.is_autocast_enabled("cpu"):
        return original(function, *args, **kwargs)
    budget = arena.budget
    if budget is not None and torch.is_grad_enabled():
        if budget.position.get(id(layer)) == 0:
            budget.plan(args[0].shape[:-1].numel())
        if budget.keeps(layer):
            return budget.run_kept(layer, function, args[0])
    return checkpointed_layer(layer, function, args[0], arena=arena)


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    target = getattr(model, "module", model)
    return [module for module in target.modules() if hasattr(module, "_gradient_checkpointing_func")]


@contextlib.contextmanager
def lean_layer_checkpoints(model: nn.Module, arena: CheckpointArena, keep_activations: bool = True) -> Iterator[int]:
    """Within the block, the qualifying checkpointed decoder layers of `model` ([`layer_checkpoint_fallback_reason`])
    use [`checkpointed_layer`] with outputs kept in `arena`. Yields how many layers were switched.

    A step that starts while outputs of an earlier one are still kept (a graph dropped without a backward pass)
    abandons the arena's chunks rather than overwrite them.
    """
    if arena.live:
        arena.abandon()
    if arena.budget is not None:
        arena.budget.outstanding = 0.0  # a new loss: the last one's graph was back-propagated (or dropped)
    switched = []
    for layer in _decoder_layers(model):
        original = vars(layer).get("_gradient_checkpointing_func")
        if getattr(original, "func", None) is _lean_checkpoint or layer_checkpoint_fallback_reason(layer):
            continue
        layer._gradient_checkpointing_func = functools.partial(_lean_checkpoint, layer, arena, original)
        switched.append((layer, original))
    if switched and keep_activations:
        layers = [layer for layer, _ in switched]
        if arena.budget is None or arena.budget.layers != layers:
            arena.budget = LayerBudget(layers, model)
    try:
        yield len(switched)
    finally:
        for layer, original in switched:
            layer._gradient_checkpointing_func = original
