"""Ready-made reward functions for the online trainers (GRPO, RLOO, ...), resolved lazily.

Every function follows the reward-function protocol of those trainers: keyword arguments (`completions`,
`completion_ids`, dataset columns such as `solution`, ...; unknown ones are ignored) and one reward (or None) per
completion. The `get_*` helpers build such a function from a few parameters. `image_rewards` holds the image rewards of
the diffusion trainers (DDPO, AlignProp), which follow their protocol instead.
"""

import sys
from typing import TYPE_CHECKING

from .._lazy_module import _LazyModule


_import_structure = {
    "accuracy_rewards": ["accuracy_reward", "reasoning_accuracy_reward"],
    "format_rewards": ["think_format_reward"],
    "image_rewards": ["get_color_target_reward", "image_brightness_reward"],
    "other_rewards": ["get_cosine_scaled_reward", "get_repetition_penalty_reward", "get_soft_overlong_punishment"],
}

if TYPE_CHECKING:
    from .accuracy_rewards import accuracy_reward, reasoning_accuracy_reward
    from .format_rewards import think_format_reward
    from .image_rewards import get_color_target_reward, image_brightness_reward
    from .other_rewards import get_cosine_scaled_reward, get_repetition_penalty_reward, get_soft_overlong_punishment
else:
    sys.modules[__name__] = _LazyModule(__name__, globals()["__file__"], _import_structure, module_spec=__spec__)
