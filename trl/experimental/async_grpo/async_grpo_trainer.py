"""Asynchronous GRPO: the trainer side (rank 0 reads the rollout queue, plans packed micro-batches, trains, syncs).

This module holds the protocols a custom rollout worker or weight transfer implements, the loss, the step callback,
and re-exports the planning, collation and LoRA-sync helpers under TRL's import path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol, runtime_checkable

import torch
from transformers import TrainerCallback

from ._batching import (
    DataCollatorForRollout,
    FixedCountBatcher,
    RolloutQueueDataset,
    TokenBudgetBatcher,
    _EmptyIterableDataset,
    _reduce_metric,
    log_rollout_traces,
)
from ._lora_sync import (
    VLLM_LORA_RANKS,
    _iter_vllm_named_params,
    round_lora_rank,
    save_lora_adapter,
    select_adapter_sync,
    validate_lora_for_vllm_sync,
)
from .async_grpo_config import AsyncGRPOConfig
from .packing import TREE_ATTENTION, TreeRow, register_tree_attention


__all__ = [
    "TREE_ATTENTION",
    "VLLM_LORA_RANKS",
    "AsyncGRPOConfig",
    "DataCollatorForRollout",
    "FixedCountBatcher",
    "RolloutQueueDataset",
    "RolloutWorkerProtocol",
    "StepIntervalCallback",
    "TokenBudgetBatcher",
    "TreeRow",
    "WeightTransferProtocol",
    "_EmptyIterableDataset",
    "_iter_vllm_named_params",
    "_reduce_metric",
    "clipped_surrogate_loss",
    "log_rollout_traces",
    "register_tree_attention",
    "round_lora_rank",
    "save_lora_adapter",
    "select_adapter_sync",
    "validate_lora_for_vllm_sync",
]


@runtime_checkable
class RolloutWorkerProtocol(Protocol):
    """What the trainer needs from a rollout worker (inject one with `rollout_worker=`)."""

    rollout_buffer: Any
    metrics_queue: Any

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def update_model_version(self, model_version: int) -> None: ...

    def check_health(self, stale_after_s: float) -> None: ...


@runtime_checkable
class WeightTransferProtocol(Protocol):
    """What the trainer needs to push weights to the generation server (inject one with `weight_transfer=`)."""

    def init_weight_transfer(self) -> None: ...

    def pause(self) -> None: ...

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None: ...

    def resume(self) -> None: ...

    def destroy(self) -> None: ...


class StepIntervalCallback(TrainerCallback):
    """Calls `fn()` at the end of every `every_n_steps`-th optimizer step."""

    def __init__(self, fn: Callable[[], None], every_n_steps: int):
        self.fn = fn
        self.every_n_steps = every_n_steps

    def on_step_end(self, args, state, control, **kwargs):
        if self.every_n_steps > 0 and state.global_step % self.every_n_steps == 0:
            self.fn()
        return control


def clipped_surrogate_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    num_tokens: float,
    epsilon_low: float,
    epsilon_high: float,
    gradient_accumulation_steps: int = 1,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """AsyncGRPO's loss over the trained tokens of a micro-batch (one entry per token, flattened).

    With `ρ = exp(log π_θ − log π_old)` (π_old the sampler's log-probabilities), each token contributes
    `ℓ = −min(ρ·A, clip(ρ, 1 − ε_low, 1 + ε_high)·A)`; the loss is `Σℓ / max(num_tokens, 1) / GA`, `num_tokens` being
    the trained tokens of the micro-batch per process. There is no KL term and no reference model.

    Returns:
        `(loss, stats)` where stats (detached, per-token means) are `ratio`, `kl` (`ρ − 1 − log ρ`, a divergence from
        the sampler), `clip_ratio/low_mean` (ρ below the range with A < 0), `clip_ratio/high_mean` (above, A > 0) and
        `clip_ratio/region_mean` (either).
    """
    log_ratio = log_probs - old_log_probs
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    loss = per_token.sum() / max(float(num_tokens), 1.0) / gradient_accumulation_steps
    with torch.no_grad():
        low = (ratio < 1.0 - epsilon_low) & (advantages < 0)
        high = (ratio > 1.0 + epsilon_high) & (advantages > 0)
        stats = {
            "ratio": ratio.mean(),
            "kl": (ratio - 1.0 - log_ratio).mean(),
            "clip_ratio/low_mean": low.float().mean(),
            "clip_ratio/high_mean": high.float().mean(),
            "clip_ratio/region_mean": (low | high).float().mean(),
        }
    return loss, stats
