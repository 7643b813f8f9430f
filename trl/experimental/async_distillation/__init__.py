"""Asynchronous distillation: the student samples beside training, teacher vLLM servers score its tokens.

Experimental: the API may change or be removed in any release.
"""

from . import async_distillation_config, async_distillation_trainer, async_rollout_worker, vllm_client, weight_transfer
from .async_distillation_config import AsyncDistillationConfig
from .async_distillation_trainer import AsyncDistillationTrainer


__all__ = [
    "AsyncDistillationConfig",
    "AsyncDistillationTrainer",
    "async_distillation_config",
    "async_distillation_trainer",
    "async_rollout_worker",
    "vllm_client",
    "weight_transfer",
]
