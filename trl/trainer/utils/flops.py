"""Throughput accounting: training FLOPs per token, the peak FLOP/s of known accelerators, and model FLOPs
utilisation (MFU)."""

import torch
import torch.nn as nn
from transformers import PretrainedConfig


# Dense bf16/fp16 tensor-core peak (FLOP/s) of common accelerators, matched by substring of the device name.
_PEAK_FLOPS_BF16 = {
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L40": 181e12,
    "L4": 121e12,
    "A10G": 125e12,
    "A10": 125e12,
    "A6000": 155e12,
    "V100": 125e12,
    "T4": 65e12,
    "4090": 165e12,
    "3090": 71e12,
    "MI300X": 1307e12,
    "MI250": 362e12,
}


def compute_flops_per_token(model: nn.Module | PretrainedConfig, seq_len: int, num_params: int | None = None) -> float:
    """Approximate training FLOPs per token (forward + backward) of a decoder: `6 * N + 12 * L * H * S`.

    Args:
        model: Model (or its config) providing `num_hidden_layers` and `hidden_size`.
        seq_len: Sequence length `S` (attention cost grows with it).
        num_params: Parameter count `N`; counted from `model` when it is a module and this is None.

    Returns:
        FLOPs per token.
    """
    config = model if isinstance(model, PretrainedConfig) else getattr(model, "config", None)
    text_config = getattr(config, "text_config", None) or config
    layers = getattr(text_config, "num_hidden_layers", 0) or 0
    hidden = getattr(text_config, "hidden_size", 0) or 0
    if num_params is None:
        if not isinstance(model, nn.Module):
            raise ValueError("`num_params` is required when a config (not a model) is given.")
        num_params = sum(p.numel() for p in model.parameters())
    return 6.0 * num_params + 12.0 * layers * hidden * seq_len


def get_peak_flops(device: torch.device | str | None = None) -> float | None:
    """Dense bf16 peak FLOP/s of a CUDA device from a table of known GPUs, or None when unknown (or on CPU)."""
    if not torch.cuda.is_available():
        return None
    device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).upper()
    for key in sorted(_PEAK_FLOPS_BF16, key=len, reverse=True):  # longest match first ("L40S" before "L40")
        if key in name:
            return _PEAK_FLOPS_BF16[key]
    return None


def compute_mfu(
    flops_per_token: float, tokens_per_second: float, peak_flops: float | None, num_devices: int = 1
) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s divided by the peak of `num_devices` devices (None without a peak)."""
    if not peak_flops:
        return None
    return flops_per_token * tokens_per_second / (peak_flops * num_devices)
