"""Configuration of the GFPO trainer."""

from dataclasses import dataclass, field

from ...trainer.grpo_config import GRPOConfig


@dataclass
class GFPOConfig(GRPOConfig):
    r"""Configuration for [`experimental.gfpo.GFPOTrainer`]; every [`GRPOConfig`] field applies as well.

    Args:
        num_remains_in_group (`int` or `None`, defaults to `None`):
            Completions kept per group of `num_generations` after scoring them with the trainer's `group_filter_func`
            (the highest scores are kept). Between 2 and `num_generations - 1`; None trains on every completion, as
            GRPO.
    """

    num_remains_in_group: int | None = field(
        default=None,
        metadata={
            "help": "Completions kept per group after `group_filter_func` scores them (the highest are kept); between "
            "2 and num_generations - 1. None keeps them all."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        kept = self.num_remains_in_group
        if kept is None:
            return
        if kept >= self.num_generations:
            raise ValueError(
                f"Number remains in Group {kept} must be less than num_generations : {self.num_generations}. "
                "Lower num_remains_in_group or raise num_generations."
            )
        if kept < 2:
            raise ValueError(
                f"num_remains_in_group must be at least 2 (the advantages are normalised by the standard deviation "
                f"of the kept completions); got {kept}."
            )
