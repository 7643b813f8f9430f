"""Per-prompt reward normalisation for DDPO."""

from __future__ import annotations

from collections import deque

import numpy as np


class PerPromptStatTracker:
    r"""Normalises rewards with running statistics of the prompt that produced them.

    Each prompt keeps its last `buffer_size` rewards. A reward becomes `(r - mean_p) / (std_p + 1e-6)` over its
    prompt's buffer (the new rewards included) once the buffer holds at least `min_count` rewards; before that, the
    mean and standard deviation of the whole `rewards` array passed to [`update`] are used instead. Standard
    deviations are population ones (`ddof=0`).

    Args:
        buffer_size (`int`):
            Rewards remembered per prompt.
        min_count (`int`):
            Buffered rewards a prompt needs before its own statistics are used.
    """

    def __init__(self, buffer_size: int, min_count: int):
        self.buffer_size = buffer_size
        self.min_count = min_count
        self.stats: dict[str, deque] = {}

    def update(self, prompts, rewards) -> np.ndarray:
        """Record `rewards` (one per entry of `prompts`) and return them normalised, in the same order."""
        prompts = np.asarray(prompts)
        rewards = np.asarray(rewards, dtype=np.float64)
        if prompts.shape[0] != rewards.shape[0]:
            raise ValueError(f"Got {prompts.shape[0]} prompts for {rewards.shape[0]} rewards; expected one each.")
        advantages = np.empty_like(rewards)
        for prompt in np.unique(prompts):
            mask = prompts == prompt
            buffer = self.stats.setdefault(prompt, deque(maxlen=self.buffer_size))
            buffer.extend(rewards[mask])
            if len(buffer) < self.min_count:
                mean, std = rewards.mean(), rewards.std()
            else:
                mean, std = np.mean(buffer), np.std(buffer)
            advantages[mask] = (rewards[mask] - mean) / (std + 1e-6)
        return advantages

    def get_stats(self) -> dict[str, dict[str, float]]:
        """Per prompt: the `mean`, `std` and `count` of its buffered rewards."""
        return {
            prompt: {"mean": np.mean(buffer), "std": np.std(buffer), "count": len(buffer)}
            for prompt, buffer in self.stats.items()
        }
