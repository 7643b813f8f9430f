"""Configuration of the XPO (Exploratory Preference Optimization) trainer."""

from dataclasses import dataclass, field

from ..online_dpo.online_dpo_config import OnlineDPOConfig, _resolve_schedule, _schedule_values


@dataclass
class XPOConfig(OnlineDPOConfig):
    r"""Configuration for [`experimental.xpo.XPOTrainer`]: every [`experimental.online_dpo.OnlineDPOConfig`] field,
    plus the weight of the exploration term.

    Args:
        alpha (`float` or `list[float]`, defaults to `[1e-05]`):
            Weight of XPO's exploration term, `alpha` times the policy's log-probability of completions sampled from
            the reference model (added to the loss, so minimising it pushes the policy away from what the reference
            already produces). A list gives one value per epoch, the last one being reused afterwards; a one-element
            list becomes that number.
    """

    alpha: list[float] = field(
        default_factory=lambda: [1e-5],
        metadata={"help": "Weight of the exploration term. Several values: one per epoch, the last one reused."},
    )

    def __post_init__(self):
        self.alpha = _resolve_schedule("alpha", self.alpha)
        if any(value < 0 for value in _schedule_values(self.alpha)):
            raise ValueError(f"alpha weighs XPO's exploration term and must be >= 0 at every epoch; got {self.alpha}.")
        super().__post_init__()
