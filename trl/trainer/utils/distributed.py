"""Process-group environment: `MASTER_ADDR`/`MASTER_PORT` for `torch.distributed`, and whether DeepSpeed or FSDP will
shard the model."""

import os
import socket
from typing import Any


def _find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def ensure_master_addr_port(addr: str | None = None, port: int | None = None) -> None:
    """Make sure `MASTER_ADDR` and `MASTER_PORT` are set for `torch.distributed` initialisation.

    `MASTER_ADDR` keeps an existing value, else `addr`, else `"localhost"`. `MASTER_PORT` takes `port` when given,
    else keeps a valid existing value, else a free port is picked (empty, `"0"` and `"auto"` count as unset).

    Args:
        addr: Address used when `MASTER_ADDR` is not already set.
        port: Port to use; overrides any existing `MASTER_PORT`.
    """
    os.environ["MASTER_ADDR"] = os.environ.get("MASTER_ADDR") or addr or "localhost"
    if port is not None:
        os.environ["MASTER_PORT"] = str(port)
        return
    existing = os.environ.get("MASTER_PORT", "").strip()
    if existing.lower() not in ("", "0", "auto"):
        try:
            if 0 < int(existing) < 65536:
                return
        except ValueError:
            pass
    os.environ["MASTER_PORT"] = str(_find_free_port())


def uses_sharding_engine(args: Any) -> bool:
    """Whether DeepSpeed or FSDP will wrap the model (the policy cannot then double as an unsharded reference).

    Both ways of asking count: the training arguments (`deepspeed=`, `fsdp=`) and an `accelerate launch` config,
    which reaches the process as `ACCELERATE_USE_DEEPSPEED` / `ACCELERATE_USE_FSDP` (and gives the arguments a
    `deepspeed_plugin`).
    """
    if getattr(args, "deepspeed", None) or getattr(args, "fsdp", None):
        return True
    if getattr(args, "deepspeed_plugin", None) is not None:
        return True
    flags = ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP")
    return any(os.environ.get(flag, "false").lower() == "true" for flag in flags)


def parameters_sharded(model: Any, across_ranks: bool = False) -> bool:
    """Whether `model`'s parameters are sharded by DeepSpeed ZeRO-3 or FSDP, whose hooks gather them collectively
    around the whole model's forward (so a part of the model cannot be run alone, and every rank must run as many
    forwards as the others).

    Args:
        model: The (possibly FSDP-managed) model.
        across_ranks: Only count sharding when more than one process takes part.
    """
    import torch.distributed as dist

    if across_ranks and not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    from transformers.integrations import is_deepspeed_zero3_enabled
    from transformers.integrations.fsdp import is_fsdp_managed_module

    return bool(
        is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model) or type(model).__name__.startswith("FSDP")
    )
