"""Example image rewards for the diffusion trainers (DDPO, AlignProp), computed from pixels: nothing to download.

They follow the diffusion trainers' protocol, `reward_fn(images, prompts, prompt_metadata) -> (rewards,
reward_metadata)`, with `images` a `(batch, 3, H, W)` tensor in `[0, 1]`; both are differentiable in the images, so
AlignProp can backpropagate them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def image_brightness_reward(images, prompts: Sequence[str], prompt_metadata: Sequence[Any]):
    """Mean pixel value of each image, in `[0, 1]` (brighter is better).

    Returns:
        `tuple[torch.Tensor, dict]`: `(batch,)` rewards and an empty metadata dict.
    """
    return images.float().mean(dim=(1, 2, 3)), {}


def get_color_target_reward(target: Sequence[float]) -> Callable:
    """A reward for images whose mean colour is close to `target`.

    Args:
        target (`Sequence[float]`):
            RGB colour in `[0, 1]`, e.g. `(1.0, 0.0, 0.0)` for red.

    Returns:
        `Callable`: `reward_fn(images, prompts, prompt_metadata) -> (rewards, {"mean_color": (batch, 3)})` with
        reward `-||mean_rgb(image) - target||^2`, at most 0.
    """
    if len(target) != 3 or not all(0.0 <= float(c) <= 1.0 for c in target):
        raise ValueError(f"target must be three RGB values in [0, 1], got {tuple(target)!r}.")
    target = tuple(float(c) for c in target)

    def color_target_reward(images, prompts: Sequence[str], prompt_metadata: Sequence[Any]):
        mean_color = images.float().mean(dim=(2, 3))
        goal = mean_color.new_tensor(target)
        return -((mean_color - goal) ** 2).sum(dim=1), {"mean_color": mean_color.detach()}

    return color_target_reward
