"""Memory-lean SwiGLU MLP and RMSNorm: the same values and gradients as the modules they stand in for, keeping fewer
activations for the backward pass.

Autograd keeps every intermediate of a Llama-style decoder MLP, `down(silu(gate(x)) * up(x))`: the gate and up
projections, `silu(gate)` and the product, four `tokens x intermediate` tensors per layer, ~45 % of a small decoder's
activation memory. [`swiglu_mlp`] keeps only the gate and up projections and recomputes the two cheap elementwise
ones in the backward pass; inside a checkpointed layer's recompute it keeps nothing but its input and computes the
projections block by block in the backward pass. Likewise the standard RMSNorm keeps its float32 input, the
normalised rows and the reciprocal root mean square; [`rms_norm`] keeps the input and one float per row.
"""

import torch
import torch.nn.functional as F


class _SwiGLUMLP(torch.autograd.Function):
    """`down(silu(x @ gate^T) * (x @ up^T))` without biases; saves `x`, the gate and up projections."""

    @staticmethod
    def forward(ctx, x, gate_weight, up_weight, down_weight, output_unused):
        ctx.output_unused = output_unused
        if output_unused:
            # A recompute for the backward pass never reads the output: the backward pass computes the projections
            # itself, block of rows by block of rows, so nothing `tokens x intermediate` is kept in between.
            ctx.save_for_backward(x, gate_weight, up_weight, down_weight)
            return x.new_zeros(()).expand(*x.shape[:-1], down_weight.shape[0])
        gate = F.linear(x, gate_weight)
        up = F.linear(x, up_weight)
        ctx.save_for_backward(x, gate_weight, up_weight, down_weight, gate, up)
        return F.linear(F.silu(gate).mul_(up), down_weight)

    @staticmethod
    def backward(ctx, grad_output):
        x, gate_weight, up_weight, down_weight, *projections = ctx.saved_tensors
        needs = ctx.needs_input_grad[:4]
        flat_x = x.reshape(-1, x.shape[-1])
        flat_grad_output = grad_output.reshape(-1, grad_output.shape[-1])
        if not ctx.output_unused:
            gate, up = (p.reshape(-1, p.shape[-1]) for p in projections)
            grads = _swiglu_block_backward(
                flat_x, gate, up, flat_grad_output, gate_weight, up_weight, down_weight, needs
            )
        else:
            grads = _swiglu_recompute_backward(flat_x, flat_grad_output, gate_weight, up_weight, down_weight, needs)
        grad_x, grad_gate_weight, grad_up_weight, grad_down = grads
        if grad_x is not None:
            grad_x = grad_x.view(x.shape)
        return grad_x, grad_gate_weight, grad_up_weight, grad_down, None


# Rows per block when the backward pass recomputes the projections: about 20 MiB per `rows x intermediate` temporary
# (four are live at once; ~1 000 rows at Qwen2.5-0.5B's intermediate size of 4 864), and never fewer than 256 rows.
# At that width, on 2 threads, the block's three products run at 165 GFLOP/s over 256 rows, 174 over 512 and 189 over
# 1 024: blocks are kept as large as the memory of a few temporaries allows.
_RECOMPUTE_BLOCK_BYTES = 20 << 20
_MIN_BLOCK_ROWS = 256


def _swiglu_hidden_gradients(gate, up, grad_output, down_weight, need_down: bool, grad_down=None):
    """The gradients of `down(silu(gate) * up)` for `gate`, `up` and `down_weight`, given the 2-D projections: the
    operations plain autograd runs, on the same values (bitwise its gradients), each temporary reused in place once
    its value is no longer needed (two `rows x intermediate` temporaries beside `gate` and `up`, left intact). A given
    `grad_down` gets the down weight's gradient added in place."""
    activated = F.silu(gate)  # recomputed, as the forward computed it
    if need_down:
        hidden = activated * up  # the down projection's input, silu(gate) * up
        grad_down = _add_product(grad_down, grad_output.T, hidden)
        del hidden
    grad_hidden = grad_output @ down_weight
    grad_up = activated.mul_(grad_hidden)  # grad_hidden * silu(gate): a product commutes bit for bit
    del activated
    # silu_backward(grad_hidden * up, gate), written over its own elementwise input.
    grad_gate = torch.ops.aten.silu_backward.grad_input(grad_hidden.mul_(up), gate, grad_input=grad_hidden)
    return grad_gate, grad_up, grad_down


def _swiglu_block_backward(x, gate, up, grad_output, gate_weight, up_weight, down_weight, needs):
    """All four gradients for 2-D rows `x` with their projections `gate` and `up`, bitwise plain autograd's."""
    grad_gate, grad_up, grad_down = _swiglu_hidden_gradients(gate, up, grad_output, down_weight, needs[3])
    grad_x = grad_gate @ gate_weight + grad_up @ up_weight if needs[0] else None
    grad_gate_weight = grad_gate.T @ x if needs[1] else None
    grad_up_weight = grad_up.T @ x if needs[2] else None
    return grad_x, grad_gate_weight, grad_up_weight, grad_down


def _swiglu_recompute_backward(x, grad_output, gate_weight, up_weight, down_weight, needs):
    """[`_swiglu_block_backward`]'s gradients over blocks of rows, each block's projections computed here and dropped
    after it.

    One block (up to `rows_per_block` rows, every small batch) runs [`_swiglu_block_backward`] itself: bitwise plain
    autograd's gradients. Over several blocks, the same products are summed in another order: each row's input
    gradient is its block's two products accumulated in place, and each weight's gradient the blocks' products
    accumulated in block order."""
    rows = x.shape[0]
    rows_per_block = max(_MIN_BLOCK_ROWS, _RECOMPUTE_BLOCK_BYTES // (gate_weight.shape[0] * x.element_size()))
    if rows <= rows_per_block:
        gate, up = F.linear(x, gate_weight), F.linear(x, up_weight)
        return _swiglu_block_backward(x, gate, up, grad_output, gate_weight, up_weight, down_weight, needs)
    grad_x = x.new_empty(x.shape) if needs[0] else None
    grad_gate_weight = grad_up_weight = grad_down = None
    for start in range(0, rows, rows_per_block):
        block = slice(start, start + rows_per_block)
        x_block = x[block]
        gate, up = F.linear(x_block, gate_weight), F.linear(x_block, up_weight)
        grad_gate, grad_up, grad_down = _swiglu_hidden_gradients(
            gate, up, grad_output[block], down_weight, needs[3], grad_down
        )
        del gate, up
        if grad_x is not None:
            torch.mm(grad_gate, gate_weight, out=grad_x[block]).addmm_(grad_up, up_weight)
        if needs[1]:
            grad_gate_weight = _add_product(grad_gate_weight, grad_gate.T, x_block)
        if needs[2]:
            grad_up_weight = _add_product(grad_up_weight, grad_up.T, x_block)
        del grad_gate, grad_up  # before the next block's projections exist
    return grad_x, grad_gate_weight, grad_up_weight, grad_down


def _add_product(total: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`total + a @ b`, in place (`a @ b` when there is no total yet)."""
    return a @ b if total is None else total.addmm_(a, b)


def swiglu_mlp(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    output_unused: bool = False,
) -> torch.Tensor:
    """`F.linear(F.silu(F.linear(x, gate_weight)) * F.linear(x, up_weight), down_weight)`, keeping only `x` and the
    two projections for the backward pass.

    Args:
        x: `(..., hidden)` input.
        gate_weight: `(intermediate, hidden)` gate projection weight.
        up_weight: `(intermediate, hidden)` up projection weight.
        down_weight: `(hidden, intermediate)` down projection weight.
        output_unused: The caller only back-propagates through the result and never reads its value (a checkpointed
            layer's recompute): the forward keeps `x` and returns zeros, and the backward pass computes the
            projections itself, a block of rows (about 20 MiB of `rows x intermediate`) at a time, so that no
            `tokens x intermediate` tensor exists at all.

    Returns:
        `(..., hidden)` output: the plain expression's values and gradients, bitwise (the backward pass runs the
        operations plain autograd runs). Without gradients, the plain expression's values with the activation and
        the product computed in place. With `output_unused` over more than one block, the weights' gradients sum
        the blocks' products in block order (equal to float rounding). Under autocast the plain expression itself
        runs (with its output, whatever `output_unused` says).
    """
    if torch.is_autocast_enabled(x.device.type):
        # Autocast casts each product's operands (bf16 gate and up projections of float32 weights); plain autograd
        # replays those casts in the backward pass, which the kernel's hand-written backward does not.
        return F.linear(F.silu(F.linear(x, gate_weight)) * F.linear(x, up_weight), down_weight)
    if not torch.is_grad_enabled():
        # Nothing is kept for a backward pass: the activation and the product overwrite the gate projection, so two
        # `tokens x intermediate` tensors exist at once instead of three (same operations, same values).
        gate = F.silu(F.linear(x, gate_weight), inplace=True)
        return F.linear(gate.mul_(F.linear(x, up_weight)), down_weight)
    return _SwiGLUMLP.apply(x, gate_weight, up_weight, down_weight, output_unused)


class _RMSNorm(torch.autograd.Function):
    """`weight * (x * rsqrt(mean(x^2) + eps))` (in at least float32, cast back to `x`'s dtype before the weight); saves `x` and
    the per-row reciprocal root mean square."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        normed = (x32 * rstd).to(x.dtype)
        ctx.save_for_backward(x, weight, rstd)
        return weight * normed

    @staticmethod
    def backward(ctx, grad_output):
        x, weight, rstd = ctx.saved_tensors
        normed32 = x.to(rstd.dtype) * rstd
        grad_weight = None
        if ctx.needs_input_grad[1]:
            product = grad_output * normed32.to(x.dtype)
            grad_weight = product.reshape(-1, product.shape[-1]).sum(0).to(weight.dtype)
            del product
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_normed = (grad_output * weight).to(rstd.dtype)
            dot = (grad_normed * normed32).mean(-1, keepdim=True)
            grad_x = (grad_normed - normed32 * dot).mul_(rstd).to(x.dtype)
        return grad_x, grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama-style RMSNorm, keeping only `x` and one float per row for the backward pass.

    Args:
        x: `(..., hidden)` input.
        weight: `(hidden,)` scale.
        eps: Added to the mean square.

    Returns:
        `weight * (x.float() * rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)`.
    """
    return _RMSNorm.apply(x, weight, eps)
