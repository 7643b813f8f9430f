"""Client of the student's `vllm serve` server: AsyncGRPO's (`trl.experimental.async_grpo.vllm_client`)."""

from ..async_grpo.vllm_client import VLLMClient


__all__ = ["VLLMClient"]
