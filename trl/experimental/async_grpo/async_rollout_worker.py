"""The rollout worker: samples, scoring and the data it hands to the trainer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ._reconcile import DriftKind, TrainingSequence, TurnRecord, _chain_to_sequences, _common_prefix_len


__all__ = [
    "DriftKind",
    "RolloutGroup",
    "RolloutSample",
    "TrainingSequence",
    "TurnRecord",
    "_chain_to_sequences",
    "_common_prefix_len",
]


@dataclass
class RolloutGroup:
    """The finished conversations of one prompt, waiting to be scored."""

    prompts: list[list[dict[str, str]]]
    reward_kwargs: dict[str, list[Any]]
    completions: list[list[dict[str, str]]]
    completions_ids: list[list[int]]
    completions_sequences: list[list[TrainingSequence]]
    tool_call_counts: list[int]
    tool_failure_counts: list[int]
    model_version: int
    group_id: int
    env_rewards: list[tuple[type, float] | None]
    rollout_rewards: list[float | None]
    queued_at: float = 0.0


@dataclass
class RolloutSample:
    """One training row handed to the trainer.

    `model_version` is the policy version when the sample's group was opened; `metrics` holds per-sample values
    (`reward`, `reward_std`, `rewards/<name>`, ...) averaged per micro-batch by the collator.
    """

    prompt: list[dict[str, str]]
    completion: list[dict[str, str]]
    input_ids: np.ndarray
    completion_mask: np.ndarray
    old_log_probs: np.ndarray
    advantage: float
    model_version: int
    group_id: int
    metrics: dict[str, float]
    enqueued_at: float | None = None
