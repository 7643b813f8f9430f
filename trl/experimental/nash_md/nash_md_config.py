"""Configuration of the Nash-MD (Nash Mirror Descent) trainer."""

from dataclasses import dataclass, field

from ..online_dpo.online_dpo_config import OnlineDPOConfig, _resolve_schedule, _schedule_values


@dataclass
class NashMDConfig(OnlineDPOConfig):
    r"""Configuration for [`experimental.nash_md.NashMDTrainer`]: every [`experimental.online_dpo.OnlineDPOConfig`]
    field, plus the mixture coefficient of the opponent policy.

    `loss_type` is not used by Nash-MD (its loss is a policy gradient on the preference probability); `beta` weighs
    the KL regulariser.

    Args:
        mixture_coef (`float` or `list[float]`, defaults to `[0.5]`):
            Weight of the reference model in the geometric mixture the opponent completions are sampled from:
            `pi_mix ∝ pi^(1 - mixture_coef) * pi_ref^mixture_coef` (0: the policy itself, 1: the reference). Values
            lie in [0, 1]. A list gives one value per epoch, the last one being reused afterwards; a one-element
            list becomes that number.
    """

    mixture_coef: list[float] = field(
        default_factory=lambda: [0.5],
        metadata={"help": "Reference weight of the geometric mixture in [0, 1]. Several values: one per epoch."},
    )

    def __post_init__(self):
        self.mixture_coef = _resolve_schedule("mixture_coef", self.mixture_coef)
        if any(not 0.0 <= value <= 1.0 for value in _schedule_values(self.mixture_coef)):
            raise ValueError(f"mixture_coef values must lie in [0, 1]; got {self.mixture_coef}.")
        super().__post_init__()
