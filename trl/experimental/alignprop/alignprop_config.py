"""Configuration of [`AlignPropTrainer`]."""

from __future__ import annotations

from dataclasses import dataclass, field

from .._diffusion_config import _DiffusionRLConfig


@dataclass
class AlignPropConfig(_DiffusionRLConfig):
    """Options of [`AlignPropTrainer`] (reward backpropagation, Prabhudesai et al. 2023).

    Each epoch runs `train_gradient_accumulation_steps` sampling calls of `train_batch_size` images per process with
    gradients through the last denoising steps, and backpropagates `-reward` into the UNet (or its LoRA adapter).
    Truncated backpropagation: the UNet call of denoising step `i` keeps its graph only if `i >= K`, with `K` drawn
    uniformly from `truncated_rand_backprop_minmax` at every step (`truncated_backprop_rand=True`) or fixed to
    `truncated_backprop_timestep`. `K` is capped at `sample_num_steps - 1`, so the last step always carries the
    gradient.
    """

    log_image_freq: int = field(
        default=1, metadata={"help": "Call the image hook every this many optimizer steps (-1: never)."}
    )
    train_learning_rate: float = field(default=1e-3, metadata={"help": "AdamW learning rate."})
    negative_prompts: str | None = field(
        default=None, metadata={"help": "Negative prompt of classifier-free guidance."}
    )
    truncated_backprop_rand: bool = field(
        default=True, metadata={"help": "Draw the gradient threshold K at random at every denoising step."}
    )
    truncated_backprop_timestep: int = field(
        default=49, metadata={"help": "First denoising step keeping gradients when not drawn at random."}
    )
    truncated_rand_backprop_minmax: tuple[int, int] = field(
        default=(0, 50), metadata={"help": "Inclusive range K is drawn from (steps i >= K keep their gradient)."}
    )

    def __post_init__(self):
        super().__post_init__()
        self.truncated_rand_backprop_minmax = tuple(self.truncated_rand_backprop_minmax)
        if len(self.truncated_rand_backprop_minmax) != 2:
            raise ValueError(
                f"truncated_rand_backprop_minmax must be two integers (low, high), got "
                f"{self.truncated_rand_backprop_minmax!r}."
            )
        low, high = self.truncated_rand_backprop_minmax
        if self.truncated_backprop_rand and not 0 <= low <= high:
            raise ValueError(
                f"truncated_rand_backprop_minmax must be (low, high) with 0 <= low <= high, got {(low, high)}."
            )
        if self.truncated_backprop_rand and low >= self.sample_num_steps:
            raise ValueError(
                f"truncated_rand_backprop_minmax[0] ({low}) must be below sample_num_steps ({self.sample_num_steps}), "
                f"otherwise no denoising step carries a gradient."
            )
        if not self.truncated_backprop_rand and not 0 <= self.truncated_backprop_timestep < self.sample_num_steps:
            raise ValueError(
                f"truncated_backprop_timestep ({self.truncated_backprop_timestep}) must be in [0, sample_num_steps) = "
                f"[0, {self.sample_num_steps}): steps from it on keep their gradient, so at least one must remain."
            )
        if self.log_image_freq == 0 or self.log_image_freq < -1:
            raise ValueError(
                f"log_image_freq must be a positive number of steps or -1 (never), got {self.log_image_freq}."
            )
