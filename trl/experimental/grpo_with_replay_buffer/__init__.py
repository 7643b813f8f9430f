"""GRPO with a replay buffer: groups whose rewards do not vary are swapped for stored groups that did.

Experimental: the API may change or be removed in any release.
"""

from .grpo_with_replay_buffer_config import GRPOWithReplayBufferConfig
from .grpo_with_replay_buffer_trainer import GRPOWithReplayBufferTrainer, ReplayBuffer


__all__ = ["GRPOWithReplayBufferConfig", "GRPOWithReplayBufferTrainer", "ReplayBuffer"]
