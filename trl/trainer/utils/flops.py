"""Throughput accounting: training FLOPs per token, the peak FLOP/s of known accelerators, and model FLOPs
utilisation (MFU)."""

from typing import Any

import torch
from transformers import PretrainedConfig


# Dense tensor-core peak (FLOP/s) of common accelerators by dtype, matched by substring of the device name. Cards
# without bf16 tensor cores (T4, V100) have a float16 entry only.
_HALF = ("bfloat16", "float16")
_PEAK_FLOPS = {
    "GH200": (989e12, _HALF),
    "H200": (989e12, _HALF),
    "H100": (989e12, _HALF),
    "H800": (989e12, _HALF),
    "B200": (2250e12, _HALF),
    "A100": (312e12, _HALF),
    "A800": (312e12, _HALF),
    "L40S": (362e12, _HALF),
    "L40": (181e12, _HALF),
    "L4": (121e12, _HALF),
    "A10G": (125e12, _HALF),
    "A10": (125e12, _HALF),
    "MI300X": (1307e12, _HALF),
    "MI250": (362e12, _HALF),
    "V100": (125e12, ("float16",)),
    "T4": (65e12, ("float16",)),
}


def _decoder_dims(config: PretrainedConfig) -> tuple[int, int, int, int, int, int, int, int]:
    """Layers, hidden size, attention width (heads x head dim), key/value width, MLP width, vocabulary size."""
    config = getattr(config, "text_config", None) or config
    hidden = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    intermediate = int(getattr(config, "intermediate_size", 0) or 0)
    experts_per_token = int(getattr(config, "num_experts_per_tok", 0) or 0)
    expert_width = int(getattr(config, "moe_intermediate_size", 0) or 0)
    if experts_per_token and expert_width:  # MoE: the experts a token is routed to, plus a shared expert if any
        intermediate = experts_per_token * expert_width + int(
            getattr(config, "shared_expert_intermediate_size", 0) or 0
        )
    return (
        int(config.num_hidden_layers),
        hidden,
        heads * head_dim,
        kv_heads * head_dim,
        intermediate,
        int(config.vocab_size),
        heads,
        head_dim,
    )


def compute_flops_per_token(config: PretrainedConfig, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward) of a decoder, from its config: `6 * N + 12 * L * A * S`.

    `N` counts the weight matrices a token goes through (attention projections, the MLP or the routed experts, the
    LM head; not the embedding lookup, biases or norms), `L` is the number of layers, `A` the attention width (heads
    times head dimension) and `S` the sequence length.

    Args:
        config: Model config (a vision-language config's `text_config` is used).
        seq_len: Sequence length `S`.

    Returns:
        FLOPs per token.
    """
    layers, hidden, attention, key_value, intermediate, vocab, _, _ = _decoder_dims(config)
    per_layer = hidden * attention + 2 * hidden * key_value + attention * hidden + 3 * hidden * intermediate
    num_params = layers * per_layer + vocab * hidden
    return 6 * num_params + 12 * layers * attention * seq_len


def get_peak_flops(device_name: str, dtype: str) -> float | None:
    """Dense peak FLOP/s of an accelerator for `dtype` (`"bfloat16"` or `"float16"`), from a table of known GPUs.

    Args:
        device_name: Device name as `torch.cuda.get_device_name` reports it (e.g. `"NVIDIA H100 80GB HBM3"`).
        dtype: Compute dtype name.

    Returns:
        FLOP/s, or None for an unknown device or a dtype without tensor-core support in the table (e.g. float32).
    """
    name = device_name.upper()
    for key in sorted(_PEAK_FLOPS, key=len, reverse=True):  # longest match first ("L40S" before "L40")
        if key in name:
            peak, dtypes = _PEAK_FLOPS[key]
            return peak if dtype in dtypes else None
    return None


def get_peak_flops_per_device(accelerator: Any, dtype: str) -> float | None:
    """Peak FLOP/s of the accelerator's device for `dtype` (None on CPU or an unknown device)."""
    device = accelerator.device
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return get_peak_flops(torch.cuda.get_device_name(device), dtype)


def compute_mfu(
    flops_per_token: int, tokens_per_second: float, world_size: int, peak_flops_per_device: float
) -> float:
    """Model FLOPs utilisation in percent: achieved FLOP/s over the peak of `world_size` devices."""
    return 100.0 * flops_per_token * tokens_per_second / (world_size * peak_flops_per_device)


def adjusted_mfu(mfu: float, config: PretrainedConfig, seq_len: int) -> float:
    """MFU counting only the attention FLOPs a causal mask leaves (half of the `12 * L * A * S` term).

    Args:
        mfu: MFU from [`compute_mfu`] (percent).
        config: Model config.
        seq_len: Sequence length.

    Returns:
        The adjusted MFU (percent).
    """
    layers, _, attention, *_ = _decoder_dims(config)
    total = compute_flops_per_token(config, seq_len)
    return mfu * (total - 6 * layers * attention * seq_len) / total
