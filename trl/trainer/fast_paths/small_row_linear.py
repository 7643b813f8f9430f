"""Decode steps of a few rows on the CPU, each linear layer computed as `W @ xᵀ` instead of `x @ Wᵀ`.

Replaces: `F.linear(x, W, b)` in the per-token steps of [`decode_rollouts`] and of the transformers `generate` calls of
the online trainers (A2PO, GKD, IW-OPD, Online DPO and its kin, and the rollout fallback), where `x` holds one token of
each sequence in flight. For so few rows MKL's `x @ Wᵀ` kernel does not stream the weight; `W @ xᵀ` (the same product
with the weight as the left operand) reads it once at memory speed. Measured at Qwen2.5-0.5B's shape (fp32, 2
threads, AMD EPYC, weights too large for the cache), `x @ Wᵀ` / `W @ xᵀ`:
- the 151 936 x 896 LM head: 99 / 18 ms for 2 rows, 96 / 32 for 4, 91 / 62 for 8;
- a 4 864 x 896 MLP projection: 2.3 / 1.0 ms for 2 rows, 2.0 / 1.5 for 4, 1.7 / 1.9 for 8.

Hence up to 4 rows for every weight and up to 8 for the LM head (other heads measured alike: 32 000 x 4 096 and
128 256 x 2 048). One row is left alone (both forms are then the same matrix-vector product).

Numbers: the two kernels sum the same products in different orders, so the logits are equal to float rounding
(about 1e-7 relative), not bitwise; a sampled token can differ only where two candidates tie to that precision. The
training pass never runs here. `TRL_SMALL_ROW_LINEAR=0` turns the path off, giving `generate`'s logits bit for bit.

Predicate: [`small_row_linear_fallback_reason`] (CPU, float32, an MKL build, the switch on) for the loop, then per call
2 to 4 rows (8 at the LM head), no gradient, a 2-D weight. Equality test: `tests/test_small_row_linear.py`. Gain:
`docs/benchmarks.md`, "Small-row linear layers".
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


ENV_SWITCH = "TRL_SMALL_ROW_LINEAR"
# Rows for which `W @ xᵀ` beats `x @ Wᵀ` at the realistic shape (see the module docstring): up to 4 for every
# weight, up to 8 for the LM head.
MIN_ROWS, MAX_ROWS, MAX_HEAD_ROWS = 2, 4, 8


def small_row_linear_fallback_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the decode of a model on `device` in `dtype` keeps `F.linear` as it is, or None.

    Args:
        device: Device of the model's parameters.
        dtype: Dtype of the model's parameters.

    Returns:
        A short reason, or None.
    """
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return f"{ENV_SWITCH} is off"
    if device.type != "cpu":
        return f"decoding on {device.type} (measured on MKL CPU kernels only)"
    if dtype != torch.float32:
        return f"{dtype} weights (measured in float32 only)"
    if not torch.backends.mkl.is_available():
        return "no MKL in this torch build"
    return None


def _applies(inputs: torch.Tensor, weight: torch.Tensor, max_rows: int) -> bool:
    if torch.is_grad_enabled() or inputs.dim() < 2 or weight.dim() != 2:
        return False
    if inputs.device.type != "cpu" or inputs.dtype != torch.float32 or weight.dtype != torch.float32:
        return False
    return MIN_ROWS <= inputs.numel() // max(inputs.shape[-1], 1) <= max_rows


class _WeightOnTheLeft(TorchFunctionMode):
    """Computes `F.linear` calls of a few rows as `W @ xᵀ` (see the module docstring); every other call as is."""

    def __init__(self, head_weight: torch.Tensor | None):
        super().__init__()
        self.head_weight = head_weight

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            inputs, weight, *rest = args
            bias = rest[0] if rest else kwargs.get("bias")
            if isinstance(inputs, torch.Tensor) and isinstance(weight, torch.Tensor):
                max_rows = MAX_HEAD_ROWS if weight is self.head_weight else MAX_ROWS
                if _applies(inputs, weight, max_rows):
                    rows = inputs.reshape(-1, inputs.shape[-1])
                    if bias is None:
                        product = torch.mm(weight, rows.t())
                    else:
                        product = torch.addmm(bias.unsqueeze(1), weight, rows.t())
                    return product.t().contiguous().view(*inputs.shape[:-1], weight.shape[0])
        return func(*args, **kwargs)


def small_row_linear(model: nn.Module) -> contextlib.AbstractContextManager:
    """A context, reusable call after call, within which `model`'s `F.linear` calls of a few rows compute `W @ xᵀ`
    when [`small_row_linear_fallback_reason`] finds nothing against it (otherwise a context that changes nothing).

    Args:
        model: The decoding model (its first parameter gives the device and dtype; its output embeddings, when it has
            some, the LM head, which takes the path up to 8 rows).

    Returns:
        The context manager.
    """
    parameter = next(model.parameters(), None)
    if parameter is None or small_row_linear_fallback_reason(parameter.device, parameter.dtype) is not None:
        return contextlib.nullcontext()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return _WeightOnTheLeft(getattr(head, "weight", None))
