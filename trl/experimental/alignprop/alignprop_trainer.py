"""AlignProp: fine-tuning a diffusion model by backpropagating a differentiable reward (Prabhudesai et al., 2023)."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from .._diffusion_trainer import _DiffusionRLTrainer
from .alignprop_config import AlignPropConfig


class AlignPropTrainer(_DiffusionRLTrainer):
    """Reward backpropagation through the denoising chain of a [`~trl.models.DDPOStableDiffusionPipeline`].

    Images are sampled with gradients kept through the UNet calls of the last denoising steps (truncated
    backpropagation, see [`AlignPropConfig`]), scored by a differentiable reward, and the UNet (or its LoRA adapter)
    follows the gradient of `10 - mean(reward)` (the constant only offsets the logged loss).

    Args:
        config ([`AlignPropConfig`]):
            The options.
        reward_function (`Callable[[torch.Tensor, tuple[str], tuple[Any]], tuple[torch.Tensor, Any]]`):
            `reward_function(images, prompts, prompt_metadata) -> (rewards, reward_metadata)`; the rewards must be
            differentiable functions of `images` (`(batch, 3, H, W)` in `[0, 1]`).
        prompt_function (`Callable[[], tuple[str, Any]]`):
            Returns one `(prompt, prompt_metadata)` pair per call.
        sd_pipeline ([`~trl.models.DDPOStableDiffusionPipeline`]):
            The pipeline to train; it must implement `rgb_with_grad`.
        image_samples_hook (`Callable[[dict, int, Any], Any]`, *optional*):
            Called every `log_image_freq` steps with the last batch (`{"images", "prompts", "prompt_metadata",
            "rewards"}`), the step and the first tracker. Without it the images go to every configured tracker that
            logs images.

    Logged per optimizer step: `reward_mean`, `reward_std`, `loss`, `epoch`.
    """

    _name = "AlignProp"
    _tag_names = ["trl", "alignprop"]

    def __init__(
        self, config: AlignPropConfig, reward_function, prompt_function, sd_pipeline, image_samples_hook=None
    ):
        if not isinstance(config, AlignPropConfig):
            raise TypeError(f"config must be an AlignPropConfig, got {type(config).__name__}.")
        super().__init__(config, reward_function, prompt_function, sd_pipeline, image_samples_hook)

    def compute_rewards(self, prompt_image_pairs) -> torch.Tensor:
        """Rewards of a sampled batch (`{"images", "prompts", "prompt_metadata"}`), differentiable in the images."""
        rewards, _ = self._call_reward(
            prompt_image_pairs["images"], prompt_image_pairs["prompts"], prompt_image_pairs["prompt_metadata"]
        )
        return rewards

    def calculate_loss(self, rewards: torch.Tensor) -> torch.Tensor:
        """`10 - mean(rewards)`: minimising it ascends the reward."""
        return 10.0 - rewards.mean()

    def _generate_samples(self, batch_size: int, with_grad: bool = True, prompts: list[str] | None = None):
        """Sample `batch_size` images (for `prompts`, or from `prompt_function`), with gradients if `with_grad`."""
        if prompts is None:
            prompts, prompt_metadata = self._sample_prompts(batch_size)
        else:
            prompt_metadata = [{} for _ in prompts]
        prompt_embeds = self._encode(prompts)
        kwargs = {
            "prompt_embeds": prompt_embeds,
            "negative_prompt_embeds": self.neg_prompt_embed.repeat(len(prompts), 1, 1),
            "num_inference_steps": self.config.sample_num_steps,
            "guidance_scale": self.config.sample_guidance_scale,
            "eta": self.config.sample_eta,
            "output_type": "pt",
        }
        if with_grad:
            output = self.sd_pipeline.rgb_with_grad(
                **kwargs,
                truncated_backprop_rand=self.config.truncated_backprop_rand,
                truncated_backprop_timestep=self.config.truncated_backprop_timestep,
                truncated_rand_backprop_minmax=self.config.truncated_rand_backprop_minmax,
            )
        else:
            output = self.sd_pipeline(**kwargs)
        return {"images": output.images, "prompts": prompts, "prompt_metadata": prompt_metadata}

    def step(self, epoch: int, global_step: int) -> int:
        """`train_gradient_accumulation_steps` sampled batches, one optimizer step; returns the new step count."""
        info = defaultdict(list)
        self.sd_pipeline.unet.train()
        for _ in range(self.config.train_gradient_accumulation_steps):
            with self.accelerator.accumulate(self.sd_pipeline.unet), self.autocast(), torch.enable_grad():
                prompt_image_pairs = self._generate_samples(batch_size=self.config.train_batch_size)
                rewards = self.compute_rewards(prompt_image_pairs)
                if not rewards.requires_grad:
                    raise ValueError(
                        "AlignProp backpropagates the reward: reward_function must return rewards computed from the "
                        "images with torch operations (they do not require grad here)."
                    )
                prompt_image_pairs["rewards"] = rewards
                gathered = self.accelerator.gather(rewards.detach()).float().cpu().numpy()
                loss = self.calculate_loss(rewards)
                self.accelerator.backward(loss)
                self._optimizer_step()
            info["reward_mean"].append(gathered.mean())
            info["reward_std"].append(gathered.std())
            info["loss"].append(loss.item())

        if not self.accelerator.sync_gradients:
            raise RuntimeError("The epoch ended between optimizer steps; this is a bug in the accumulation set-up.")
        logs = {
            key: torch.tensor(float(np.mean(values)), device=self.accelerator.device) for key, values in info.items()
        }
        logs = {key: value.item() for key, value in self.accelerator.reduce(logs, reduction="mean").items()}
        logs["epoch"] = epoch
        self._log(logs, step=global_step)
        global_step += 1
        if self.config.log_image_freq > 0 and global_step % self.config.log_image_freq == 0:
            self._log_images(prompt_image_pairs, global_step)
        return global_step

    @staticmethod
    def _last_images(prompt_image_data) -> torch.Tensor:
        return prompt_image_data["images"]
