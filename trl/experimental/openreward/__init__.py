"""OpenReward (Open Reward Standard) environments for GRPO: an ORS environment's tasks and tools as `train_dataset`,
`environment_factory` and `reward_funcs`. Needs `pip install trl[openreward]` to run.

Experimental: the API may change or be removed in any release.
"""

from .spec import OpenRewardSpec


__all__ = ["OpenRewardSpec"]
