"""Memory-lean SwiGLU MLP and RMSNorm: the same values and gradients as the modules they stand in for, keeping fewer
activations for the backward pass.

Autograd keeps every intermediate of a Llama-style decoder MLP, `down(silu(gate(x)) * up(x))`: the gate and up
projections, `silu(gate)` and the product, four `tokens x intermediate` tensors per layer, ~45 % of a small decoder's
activation memory. [`swiglu_mlp`] keeps only the gate and up projections and recomputes the two cheap elementwise
ones in the backward pass. Likewise the standard RMSNorm keeps its float32 input, the normalised rows and the
reciprocal root mean square; [`rms_norm`] keeps the input and one float per row.
"""

import torch
import torch.nn.functional as F


class _SwiGLUMLP(torch.autograd.Function):
    """`down(silu(x @ gate^T) * (x @ up^T))` without biases; saves `x`, the gate and up projections."""

    @staticmethod
    def forward(ctx, x, gate_weight, up_weight, down_weight, output_unused):
        gate = F.linear(x, gate_weight)
        up = F.linear(x, up_weight)
        ctx.save_for_backward(x, gate, up, gate_weight, up_weight, down_weight)
        if output_unused:
            # A recompute for the backward pass never reads the output: no activation, no down product.
            return x.new_zeros(()).expand(*x.shape[:-1], down_weight.shape[0])
        return F.linear(F.silu(gate).mul_(up), down_weight)

    @staticmethod
    def backward(ctx, grad_output):
        x, gate, up, gate_weight, up_weight, down_weight = ctx.saved_tensors
        # The operations plain autograd runs, on the same values (bitwise the same gradients), each temporary reused
        # in place once its value is no longer needed: at most two `tokens x intermediate` temporaries beside the
        # saved projections (which stay intact, so a graph kept with `retain_graph` back-propagates again alike).
        activated = F.silu(gate)  # recomputed, as the forward computed it
        grad_down = None
        if ctx.needs_input_grad[3]:
            hidden = activated * up  # the down projection's input, silu(gate) * up
            grad_down = grad_output.reshape(-1, grad_output.shape[-1]).T @ hidden.reshape(-1, hidden.shape[-1])
            del hidden
        grad_hidden = grad_output @ down_weight
        grad_up = activated.mul_(grad_hidden)  # grad_hidden * silu(gate): a product commutes bit for bit
        del activated
        # silu_backward(grad_hidden * up, gate), written over its own elementwise input.
        grad_gate = torch.ops.aten.silu_backward.grad_input(grad_hidden.mul_(up), gate, grad_input=grad_hidden)
        del grad_hidden
        flat_x = x.reshape(-1, x.shape[-1])
        flat_gate, flat_up = grad_gate.reshape(-1, grad_gate.shape[-1]), grad_up.reshape(-1, grad_up.shape[-1])
        grad_x = grad_gate_weight = grad_up_weight = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_gate @ gate_weight + grad_up @ up_weight
        if ctx.needs_input_grad[1]:
            grad_gate_weight = flat_gate.T @ flat_x
        if ctx.needs_input_grad[2]:
            grad_up_weight = flat_up.T @ flat_x
        return grad_x, grad_gate_weight, grad_up_weight, grad_down, None


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
            layer's recompute): the forward computes the two projections only and returns zeros; the gradients are
            unchanged.

    Returns:
        `(..., hidden)` output: the plain expression's values and gradients, bitwise (the backward pass runs the
        operations plain autograd runs).
    """
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
