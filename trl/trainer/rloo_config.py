"""Configuration of the RLOO trainer."""

from dataclasses import dataclass, field

from .base_config import warn_trl_trains_anyway
from .grpo_config import ONLINE_FIELDS_DOC
from .online_config import _OnlineConfig


@dataclass
class RLOOConfig(_OnlineConfig):
    r"""Configuration for [`RLOOTrainer`]: REINFORCE Leave-One-Out.

    For each prompt, `num_generations` completions are sampled and scored; the baseline of a completion is the mean
    reward of the other completions of its prompt. The KL divergence to the reference model enters the reward
    (`beta`). Only the fields TRL adds or whose default differs from [`~transformers.TrainingArguments`] are listed;
    every other `TrainingArguments` field works as usual.

    `__post_init__` derives `generation_batch_size` / `steps_per_generation` exactly like [`GRPOConfig`] and raises a
    `ValueError` for inconsistent values.

    Args:
        learning_rate (`float`, defaults to `1e-6`):
            Initial learning rate for AdamW (the parent default is `5e-5`).
        remove_unused_columns (`bool` or `None`, defaults to `False`):
            Extra dataset columns are kept because they are passed to the reward functions.
        num_generations (`int` or `None`, defaults to `2`):
            Completions sampled for each prompt.

        > RLOO objective

        beta (`float`, defaults to `0.05`):
            Weight of the sequence-level KL penalty subtracted from the reward. `0.0` loads no reference model.
        normalize_advantages (`bool`, defaults to `False`):
            Standardise the advantages over each generation batch (zero mean, unit variance).
        reward_clip_range (`tuple[float, float]` or `None`, defaults to `None`):
            Clip the (weighted) reward to `(min, max)` before the KL penalty. `None` disables clipping.
    """

    num_generations: int | None = field(
        default=2, metadata={"help": "Completions sampled per prompt (group size G). At least 2."}
    )
    beta: float = field(default=0.05, metadata={"help": "KL coefficient in the reward; 0.0 loads no reference."})
    normalize_advantages: bool = field(
        default=False, metadata={"help": "Standardise advantages over each generation batch."}
    )
    reward_clip_range: tuple[float, float] | None = field(
        default=None, metadata={"help": "(min, max) clipping of the reward; None disables it."}
    )

    def __post_init__(self):
        if self.reward_clip_range is not None:
            values = list(self.reward_clip_range)
            if len(values) != 2:
                raise ValueError(f"reward_clip_range must be a (min, max) pair; got {self.reward_clip_range!r}.")
            if float(values[0]) > float(values[1]):
                warn_trl_trains_anyway(
                    f"reward_clip_range={self.reward_clip_range!r} has min > max: every reward is clipped to max.",
                    "give (min, max) with min <= max unless this is intended.",
                    stacklevel=3,
                )
            self.reward_clip_range = (float(values[0]), float(values[1]))
        super().__post_init__()


RLOOConfig.__doc__ = RLOOConfig.__doc__.rstrip() + "\n" + ONLINE_FIELDS_DOC
