"""DDPO: policy-gradient fine-tuning of a diffusion model on a reward of its images (Black et al., 2023)."""

from __future__ import annotations

from collections import defaultdict
from concurrent import futures

import numpy as np
import torch

from .._diffusion_trainer import _DiffusionRLTrainer
from .ddpo_config import DDPOConfig
from .stat_tracker import PerPromptStatTracker


class DDPOTrainer(_DiffusionRLTrainer):
    """Denoising Diffusion Policy Optimization on a [`~trl.models.DDPOStableDiffusionPipeline`].

    Every denoising step of a stochastic DDIM sampler (`sample_eta > 0`) is an action with a Gaussian
    log-probability. An epoch samples images with their latent chains and log-probabilities, rewards them, turns the
    rewards into advantages, then maximises PPO's clipped surrogate `min(r A, clip(r, 1 - c, 1 + c) A)` over the
    steps, `r` being the ratio of the current UNet's step probability to the sampler's.

    Args:
        config ([`DDPOConfig`]):
            The options.
        reward_function (`Callable[[torch.Tensor, tuple[str], tuple[Any]], tuple[torch.Tensor, Any]]`):
            `reward_function(images, prompts, prompt_metadata) -> (rewards, reward_metadata)`, images a
            `(batch, 3, H, W)` tensor in `[0, 1]`, one reward per image.
        prompt_function (`Callable[[], tuple[str, Any]]`):
            Returns one `(prompt, prompt_metadata)` pair per call.
        sd_pipeline ([`~trl.models.DDPOStableDiffusionPipeline`]):
            The pipeline to train, e.g. [`~trl.models.DefaultDDPOStableDiffusionPipeline`].
        image_samples_hook (`Callable[[list, int, Any], Any]`, *optional*):
            Called once per epoch with the epoch's `[images, prompts, prompt_metadata, rewards, reward_metadata]`
            batches, the step and the first tracker. Without it, the last batch's images go to every configured
            tracker that logs images.

    Logged (through the accelerate trackers): per epoch `reward` (every reward), `reward_mean`, `reward_std`,
    `epoch`; per optimizer step `loss`, `approx_kl` (`mean((log p - log p_old)^2) / 2`), `clipfrac` (share of
    ratios outside the clip range), `epoch`, `inner_epoch`.
    """

    _name = "DDPO"
    _tag_names = ["trl", "ddpo"]

    def __init__(
        self,
        config: DDPOConfig,
        reward_function,
        prompt_function,
        sd_pipeline,
        image_samples_hook=None,
    ):
        if not isinstance(config, DDPOConfig):
            raise TypeError(f"config must be a DDPOConfig, got {type(config).__name__}.")
        self.num_train_timesteps = int(config.sample_num_steps * config.train_timestep_fraction)
        if self.num_train_timesteps < 1:
            raise ValueError(
                f"sample_num_steps * train_timestep_fraction = {config.sample_num_steps} * "
                f"{config.train_timestep_fraction} leaves no denoising step to train on; raise either."
            )
        super().__init__(config, reward_function, prompt_function, sd_pipeline, image_samples_hook)
        self.stat_tracker = (
            PerPromptStatTracker(
                config.per_prompt_stat_tracking_buffer_size, config.per_prompt_stat_tracking_min_count
            )
            if config.per_prompt_stat_tracking
            else None
        )
        self.executor = (
            futures.ThreadPoolExecutor(max_workers=config.max_workers) if config.async_reward_computation else None
        )

    def _accumulation_steps(self) -> int:
        # accelerate counts one backward per trained denoising step.
        return self.config.train_gradient_accumulation_steps * self.num_train_timesteps

    def _config_check(self) -> tuple[bool, str]:
        """Kept for compatibility: the batch-size rules are checked by [`DDPOConfig`] on construction."""
        return True, ""

    # -- sampling and rewards -----------------------------------------------------------------------------------------

    def _generate_samples(self, iterations: int, batch_size: int):
        """`iterations` sampling calls of `batch_size` images: the training tensors and the `[images, prompts,
        metadata]` triples of each call."""
        samples, prompt_image_pairs = [], []
        self.sd_pipeline.unet.eval()
        negative = self.neg_prompt_embed.repeat(batch_size, 1, 1)
        for _ in range(iterations):
            prompts, prompt_metadata = self._sample_prompts(batch_size)
            prompt_embeds = self._encode(prompts)
            with self.autocast():
                output = self.sd_pipeline(
                    prompt_embeds=prompt_embeds,
                    negative_prompt_embeds=negative,
                    num_inference_steps=self.config.sample_num_steps,
                    guidance_scale=self.config.sample_guidance_scale,
                    eta=self.config.sample_eta,
                    output_type="pt",
                )
            latents = torch.stack(output.latents, dim=1)  # (batch, steps + 1, C, h, w)
            log_probs = torch.stack(output.log_probs, dim=1)  # (batch, steps)
            timesteps = self.sd_pipeline.scheduler.timesteps.repeat(batch_size, 1)
            samples.append(
                {
                    "prompt_embeds": prompt_embeds,
                    "timesteps": timesteps,
                    "latents": latents[:, :-1],
                    "next_latents": latents[:, 1:],
                    "log_probs": log_probs,
                    "negative_prompt_embeds": negative,
                    "prompts": list(prompts),
                }
            )
            prompt_image_pairs.append([output.images, prompts, prompt_metadata])
        return samples, prompt_image_pairs

    def compute_rewards(self, prompt_image_pairs, is_async: bool = False):
        """`(rewards, reward_metadata)` of each `[images, prompts, metadata]` batch, in a thread pool if `is_async`."""
        if not is_async:
            return [self._call_reward(images, prompts, metadata) for images, prompts, metadata in prompt_image_pairs]
        pending = [self.executor.submit(self._call_reward, *pair) for pair in prompt_image_pairs]
        return [job.result() for job in pending]

    # -- training -----------------------------------------------------------------------------------------------------

    def _advantages(self, rewards: np.ndarray, prompts: list[str]) -> np.ndarray:
        if self.stat_tracker is not None:
            return self.stat_tracker.update(np.array(prompts), rewards)
        return (rewards - rewards.mean()) / (rewards.std() + 1e-8)

    def step(self, epoch: int, global_step: int) -> int:
        """Sample, reward and train for one epoch; returns the new optimizer-step count."""
        samples, prompt_image_data = self._generate_samples(
            iterations=self.config.sample_num_batches_per_epoch, batch_size=self.config.sample_batch_size
        )
        rewards_and_metadata = self.compute_rewards(prompt_image_data, is_async=self.config.async_reward_computation)
        for batch, (rewards, reward_metadata) in zip(prompt_image_data, rewards_and_metadata, strict=True):
            batch.extend([rewards, reward_metadata])
        self._log_images(prompt_image_data, global_step)

        prompts = [p for sample in samples for p in sample.pop("prompts")]
        samples = {key: torch.cat([s[key] for s in samples]) for key in samples[0]}
        local_rewards = torch.cat([r for r, _ in rewards_and_metadata]).float()
        rewards = self.accelerator.gather(local_rewards).cpu().numpy()
        self._log(
            {"reward": rewards, "epoch": epoch, "reward_mean": rewards.mean(), "reward_std": rewards.std()},
            step=global_step,
        )
        all_prompts = self._gather_prompts(prompts)
        advantages = torch.as_tensor(self._advantages(rewards, all_prompts), dtype=torch.float32)
        samples["advantages"] = advantages.reshape(self.accelerator.num_processes, -1)[
            self.accelerator.process_index
        ].to(self.accelerator.device)

        total_batch_size, num_timesteps = samples["timesteps"].shape
        for inner_epoch in range(self.config.train_num_inner_epochs):
            order = torch.randperm(total_batch_size, device=self.accelerator.device)
            samples = {key: value[order] for key, value in samples.items()}
            # Each chain trains on its own random order of denoising steps (the first num_train_timesteps of it).
            step_orders = torch.stack(
                [torch.randperm(num_timesteps, device=self.accelerator.device) for _ in range(total_batch_size)]
            )
            rows = torch.arange(total_batch_size, device=self.accelerator.device)[:, None]
            for key in ("timesteps", "latents", "next_latents", "log_probs"):
                samples[key] = samples[key][rows, step_orders]
            batches = [
                {key: value[i : i + self.config.train_batch_size] for key, value in samples.items()}
                for i in range(0, total_batch_size, self.config.train_batch_size)
            ]
            self.sd_pipeline.unet.train()
            global_step = self._train_batched_samples(inner_epoch, epoch, global_step, batches)
            if not self.accelerator.sync_gradients:
                raise RuntimeError(
                    "An epoch ended between optimizer steps; DDPOConfig's batch-size checks should have prevented it."
                )
        return global_step

    def _gather_prompts(self, prompts: list[str]) -> list[str]:
        if self.accelerator.num_processes == 1:
            return prompts
        from accelerate.utils import gather_object

        return gather_object(prompts)

    def calculate_loss(self, latents, timesteps, next_latents, log_probs, advantages, embeds):
        """Loss, approximate KL and clip fraction of one denoising step of a batch of chains."""
        with self.autocast():
            if self.config.train_cfg:
                noise_pred = self.sd_pipeline.unet(torch.cat([latents] * 2), torch.cat([timesteps] * 2), embeds).sample
                noise_uncond, noise_text = noise_pred.chunk(2)
                noise_pred = noise_uncond + self.config.sample_guidance_scale * (noise_text - noise_uncond)
            else:
                noise_pred = self.sd_pipeline.unet(latents, timesteps, embeds).sample
            log_prob = self.sd_pipeline.scheduler_step(
                noise_pred, timesteps, latents, eta=self.config.sample_eta, prev_sample=next_latents
            ).log_probs
        advantages = torch.clamp(advantages, -self.config.train_adv_clip_max, self.config.train_adv_clip_max)
        ratio = torch.exp(log_prob - log_probs)
        loss = self.loss(advantages, self.config.train_clip_range, ratio)
        approx_kl = 0.5 * torch.mean((log_prob - log_probs) ** 2)
        clipfrac = torch.mean((torch.abs(ratio - 1.0) > self.config.train_clip_range).float())
        return loss, approx_kl, clipfrac

    def _train_batched_samples(self, inner_epoch: int, epoch: int, global_step: int, batched_samples) -> int:
        info = defaultdict(list)
        for sample in batched_samples:
            if self.config.train_cfg:
                embeds = torch.cat([sample["negative_prompt_embeds"], sample["prompt_embeds"]])
            else:
                embeds = sample["prompt_embeds"]
            for j in range(self.num_train_timesteps):
                with self.accelerator.accumulate(self.sd_pipeline.unet):
                    loss, approx_kl, clipfrac = self.calculate_loss(
                        sample["latents"][:, j],
                        sample["timesteps"][:, j],
                        sample["next_latents"][:, j],
                        sample["log_probs"][:, j],
                        sample["advantages"],
                        embeds,
                    )
                    info["approx_kl"].append(approx_kl.detach())
                    info["clipfrac"].append(clipfrac.detach())
                    info["loss"].append(loss.detach())
                    self.accelerator.backward(loss)
                    self._optimizer_step()
            if self.accelerator.sync_gradients:
                logs = {key: torch.mean(torch.stack(values)) for key, values in info.items()}
                logs = self.accelerator.reduce(logs, reduction="mean")
                logs = {key: value.item() for key, value in logs.items()}
                logs.update({"epoch": epoch, "inner_epoch": inner_epoch})
                self._log(logs, step=global_step)
                global_step += 1
                info = defaultdict(list)
        return global_step

    @staticmethod
    def _last_images(prompt_image_data) -> torch.Tensor:
        return prompt_image_data[-1][0]

    def __repr__(self) -> str:
        return f"DDPOTrainer(pipeline={type(self.sd_pipeline).__name__}, config={self.config!r})"


__all__ = ["DDPOTrainer"]
