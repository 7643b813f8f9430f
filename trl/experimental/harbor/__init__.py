"""Harbor task environments for GRPO: sandboxed agentic tasks (a `task.toml`, an environment, tests) as
`train_dataset`, `environment_factory` and `reward_funcs`. Needs `pip install trl[harbor]` (Python >= 3.12) to run.

Experimental: the API may change or be removed in any release.
"""

from .environment import AGENTS, HarborBashEnv, HarborEnv
from .spec import HarborSpec


__all__ = ["AGENTS", "HarborBashEnv", "HarborEnv", "HarborSpec"]
