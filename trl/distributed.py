"""One view of how the parameters of a distributed run are sharded (DeepSpeed ZeRO or FSDP), read once from an
`accelerate.Accelerator`, with the context managers that gather full parameters when they are."""

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch.nn as nn


__all__ = ["DistributedBackend"]


class DistributedBackend:
    """Sharding facts of an [`~accelerate.Accelerator`] and the matching parameter-gathering contexts.

    Args:
        accelerator (`accelerate.Accelerator`):
            The run's accelerator; its DeepSpeed plugin (ZeRO stage, 0 without DeepSpeed) and FSDP plugin (FSDP
            version, `None` without FSDP) are read once, here.

    Example:

    ```python
    backend = DistributedBackend(trainer.accelerator)
    with backend.gather_params(list(model.parameters())):
        state = {name: p.detach().clone() for name, p in model.named_parameters()}
    ```
    """

    def __init__(self, accelerator: Any):
        state = accelerator.state
        deepspeed_plugin = getattr(state, "deepspeed_plugin", None)
        self.zero_stage: int = int(getattr(deepspeed_plugin, "zero_stage", 0) or 0) if deepspeed_plugin else 0
        fsdp_plugin = getattr(state, "fsdp_plugin", None)
        self.fsdp_version: int | None = getattr(fsdp_plugin, "fsdp_version", None) if fsdp_plugin else None

    @property
    def is_zero3(self) -> bool:
        """Whether parameters are partitioned by DeepSpeed ZeRO stage 3."""
        return self.zero_stage == 3

    @property
    def is_fsdp(self) -> bool:
        """Whether the model is wrapped by FSDP (any version)."""
        return self.fsdp_version is not None

    @contextlib.contextmanager
    def gather_params(self, params: Iterable[nn.Parameter]) -> Iterator[None]:
        """Full copies of ZeRO-3 partitioned `params` inside the block (`deepspeed.zero.GatheredParameters`); a no-op
        otherwise."""
        if not self.is_zero3:
            yield
            return
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(params)):
            yield

    @contextlib.contextmanager
    def summon_full_params(self, module: nn.Module, **kwargs: Any) -> Iterator[None]:
        """`FullyShardedDataParallel.summon_full_params(module, **kwargs)` under FSDP version 1; a no-op otherwise
        (FSDP2 parameters are DTensors gathered one at a time with `full_tensor()`)."""
        if self.fsdp_version != 1:
            yield
            return
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(module, **kwargs):
            yield
