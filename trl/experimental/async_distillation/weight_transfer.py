"""Weight transfer to the student's `vllm serve` server: AsyncGRPO's (`trl.experimental.async_grpo.weight_transfer`).
Teacher servers never receive weights."""

from ..async_grpo.weight_transfer import WeightTransferClient


__all__ = ["WeightTransferClient"]
