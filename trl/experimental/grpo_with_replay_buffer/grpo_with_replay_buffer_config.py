"""Configuration of the GRPO-with-replay-buffer trainer."""

from dataclasses import dataclass, field

from ...trainer.grpo_config import GRPOConfig


@dataclass
class GRPOWithReplayBufferConfig(GRPOConfig):
    r"""Configuration for [`experimental.grpo_with_replay_buffer.GRPOWithReplayBufferTrainer`]; every [`GRPOConfig`]
    field applies as well.

    Args:
        replay_buffer_size (`int`, defaults to `64`):
            Most groups kept in the replay buffer. Groups whose rewards vary are stored (the lowest-scored is evicted
            when full); groups whose rewards are all equal (no learning signal) are replaced by stored ones. 0 turns
            the buffer off (plain GRPO).
    """

    replay_buffer_size: int = field(
        default=64,
        metadata={
            "help": "Most groups kept in the replay buffer; groups with zero reward variance are replaced by stored "
            "groups. 0 disables the buffer."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        if self.replay_buffer_size < 0:
            raise ValueError(
                f"replay_buffer_size must be >= 0 (0 disables the buffer); got {self.replay_buffer_size}."
            )
