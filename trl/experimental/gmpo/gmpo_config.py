"""Configuration of the GMPO trainer."""

from dataclasses import dataclass, field

from ...trainer.grpo_config import GRPOConfig


@dataclass
class GMPOConfig(GRPOConfig):
    r"""Configuration for [`experimental.gmpo.GMPOTrainer`]; every [`GRPOConfig`] field applies as well.

    GMPO reads the clipping bounds in log space: a token's log-ratio is clipped to `[-epsilon, epsilon_high]`, i.e. the
    ratio to `(exp(-epsilon), exp(epsilon_high))`. `loss_type`, `importance_sampling_level`, `delta`, the vLLM
    importance-sampling correction and the off-policy mask do not apply to its loss.

    Args:
        epsilon (`float`, defaults to `0.4`):
            Lower clipping bound of the per-token log-ratio (log space; wider than GRPO's 0.2 because the geometric
            mean is less sensitive to outlier tokens). `epsilon_high` (None: equal to `epsilon`) is the upper bound.
    """

    epsilon: float = field(
        default=0.4,
        metadata={"help": "Clipping bound of the per-token log-ratio (log space): ratios clipped to (e^-eps, e^eps)."},
    )
