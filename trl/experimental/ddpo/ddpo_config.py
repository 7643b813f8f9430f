"""Configuration of [`DDPOTrainer`]."""

from __future__ import annotations

from dataclasses import dataclass, field

from .._diffusion_config import _DiffusionRLConfig


@dataclass
class DDPOConfig(_DiffusionRLConfig):
    """Options of [`DDPOTrainer`] (Denoising Diffusion Policy Optimization, Black et al. 2023).

    Each epoch samples `sample_num_batches_per_epoch` batches of `sample_batch_size` images per process, scores them
    with the reward function, turns rewards into advantages (normalised over the epoch, or per prompt with
    `per_prompt_stat_tracking`), then runs `train_num_inner_epochs` passes of the clipped policy-gradient loss over
    the denoising steps in batches of `train_batch_size`. Batch sizes are checked here: `sample_batch_size` must be a
    multiple of `train_batch_size`, and the samples of an epoch must split into whole optimizer steps
    (`train_batch_size * train_gradient_accumulation_steps`).

    The shared fields (run, logging, checkpoints, `sample_num_steps`, `sample_eta`, `sample_guidance_scale`,
    `train_batch_size`, optimizer) are described in the field metadata.
    """

    sample_batch_size: int = field(default=1, metadata={"help": "Per-process batch size of a sampling call."})
    sample_num_batches_per_epoch: int = field(
        default=2, metadata={"help": "Sampling calls per epoch (each of `sample_batch_size` images per process)."}
    )
    train_num_inner_epochs: int = field(default=1, metadata={"help": "Training passes over each epoch's samples."})
    train_cfg: bool = field(
        default=True, metadata={"help": "Apply classifier-free guidance in the training forward pass too."}
    )
    train_adv_clip_max: float = field(default=5.0, metadata={"help": "Advantages are clipped to [-max, max]."})
    train_clip_range: float = field(
        default=1e-4, metadata={"help": "PPO clip range of the probability ratio: [1 - c, 1 + c]."}
    )
    train_timestep_fraction: float = field(
        default=1.0, metadata={"help": "Fraction of each chain's denoising steps trained on (a random subset)."}
    )
    per_prompt_stat_tracking: bool = field(
        default=False, metadata={"help": "Normalise rewards per prompt (running buffer) instead of over the epoch."}
    )
    per_prompt_stat_tracking_buffer_size: int = field(
        default=16, metadata={"help": "Rewards kept per prompt by the stat tracker."}
    )
    per_prompt_stat_tracking_min_count: int = field(
        default=16,
        metadata={"help": "Below this many buffered rewards, a prompt is normalised with the batch's statistics."},
    )
    async_reward_computation: bool = field(
        default=False, metadata={"help": "Compute rewards in a thread pool while sampling continues."}
    )
    max_workers: int = field(default=2, metadata={"help": "Threads of the asynchronous reward computation."})
    negative_prompts: str = field(default="", metadata={"help": "Negative prompt of classifier-free guidance."})

    def __post_init__(self):
        super().__post_init__()
        for name in ("sample_batch_size", "sample_num_batches_per_epoch", "train_num_inner_epochs", "max_workers"):
            self._require_positive(name)
        if self.sample_eta <= 0:
            raise ValueError(
                f"DDPO needs a stochastic sampler to have a policy log-probability: sample_eta must be > 0, got "
                f"{self.sample_eta}."
            )
        if not 0 < self.train_timestep_fraction <= 1:
            raise ValueError(f"train_timestep_fraction must be in (0, 1], got {self.train_timestep_fraction}.")
        if self.sample_batch_size < self.train_batch_size:
            raise ValueError(
                f"The sample batch size (sample_batch_size={self.sample_batch_size}) must be at least the train batch "
                f"size (train_batch_size={self.train_batch_size}): training batches are cut from the sampled ones. "
                f"Lower train_batch_size or raise sample_batch_size."
            )
        if self.sample_batch_size % self.train_batch_size != 0:
            raise ValueError(
                f"sample_batch_size ({self.sample_batch_size}) must be divisible by train_batch_size "
                f"({self.train_batch_size}), e.g. sample_batch_size={2 * self.train_batch_size}."
            )
        samples_per_epoch = self.sample_batch_size * self.sample_num_batches_per_epoch
        per_optimizer_step = self.train_batch_size * self.train_gradient_accumulation_steps
        if samples_per_epoch % per_optimizer_step != 0:
            raise ValueError(
                f"The samples of an epoch (sample_batch_size * sample_num_batches_per_epoch = {samples_per_epoch} per "
                f"process) must split into whole optimizer steps (train_batch_size * "
                f"train_gradient_accumulation_steps = {per_optimizer_step}); change one of these four values."
            )
        if self.per_prompt_stat_tracking:
            self._require_positive("per_prompt_stat_tracking_buffer_size")
            self._require_positive("per_prompt_stat_tracking_min_count")
