"""What DDPO and AlignProp share: accelerate set-up, trackers, optimizer, checkpoints, prompts and image logging.

Both trainers drive a [`~trl.models.modeling_sd_base.DDPOStableDiffusionPipeline`] in their own epoch loop (not
`transformers.Trainer`: there is no dataset, each epoch samples fresh images). A subclass implements `step(epoch,
global_step) -> global_step` and, where it differs, `_check_runtime`.

Checkpoints: `accelerator.save_state()` after every `save_freq` completed epochs, into
`<logdir>/checkpoints/checkpoint_<n>` (accelerate's automatic naming, at most `num_checkpoint_limit` kept), with the
trained weights written by the pipeline's `save_checkpoint` hook and the epoch and step in `trainer_state.json`.
`resume_from` names one such directory, or the `checkpoints` folder to take the latest.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..trainer.run_report.standalone import StandaloneRunReport


logger = logging.getLogger(__name__)

_STATE_FILE = "trainer_state.json"


def ddpo_clipped_loss(advantages: torch.Tensor, clip_range: float, ratio: torch.Tensor) -> torch.Tensor:
    r"""PPO's clipped surrogate: `mean(max(-A * r, -A * clip(r, 1 - c, 1 + c)))`.

    Args:
        advantages (`torch.Tensor`): `A`, one per sample.
        clip_range (`float`): `c`.
        ratio (`torch.Tensor`): `r = exp(log pi_theta - log pi_old)`, one per sample.
    """
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return torch.mean(torch.maximum(unclipped, clipped))


def _checkpoint_indices(directory: str) -> list[int]:
    if not os.path.isdir(directory):
        return []
    names = [d for d in os.listdir(directory) if d.startswith("checkpoint_") and d.split("_")[-1].isdigit()]
    return [int(d.split("_")[-1]) for d in names]


def _find_checkpoint(path: str) -> str:
    path = os.path.normpath(os.path.expanduser(path))
    if not os.path.isdir(path):
        raise ValueError(
            f"resume_from={path!r} is not a directory; expected a checkpoint_<n> directory or its parent."
        )
    if os.path.basename(path).startswith("checkpoint_"):
        return path
    # `trainer_state.json` is written last: a checkpoint without it was cut short (a kill during the save).
    indices = [
        i for i in _checkpoint_indices(path) if os.path.isfile(os.path.join(path, f"checkpoint_{i}", _STATE_FILE))
    ]
    if not indices:
        raise ValueError(f"No complete checkpoint_<n> directory (with {_STATE_FILE}) in resume_from={path!r}.")
    return os.path.join(path, f"checkpoint_{max(indices)}")


class _DiffusionRLTrainer:
    """Base of [`DDPOTrainer`] and [`AlignPropTrainer`]; see the module docstring."""

    _name = "Diffusion RL"
    _tag_names = ["trl"]

    def __init__(
        self,
        config,
        reward_function: Callable,
        prompt_function: Callable[[], tuple[str, Any]],
        sd_pipeline,
        image_samples_hook: Callable[[Any, int, Any], Any] | None = None,
    ):
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState
        from accelerate.utils import ProjectConfiguration, set_seed

        if not callable(reward_function) or not callable(prompt_function):
            raise TypeError(
                "reward_function and prompt_function must be callables: prompt_function() -> (prompt, metadata), "
                "reward_function(images, prompts, metadata) -> (rewards, reward_metadata)."
            )
        self.config = config
        self.reward_fn = reward_function
        self.prompt_fn = prompt_function
        self.sd_pipeline = sd_pipeline
        self.image_samples_hook = image_samples_hook

        resume_dir = _find_checkpoint(config.resume_from) if config.resume_from else None
        project_config = ProjectConfiguration(
            **{
                "project_dir": config.logdir,
                "automatic_checkpoint_naming": True,
                "total_limit": config.num_checkpoint_limit,
                **config.project_kwargs,
            }
        )
        # A trainer built earlier in this process may have left accelerate's shared state at another mixed precision;
        # start from a fresh one, as transformers' TrainingArguments does.
        AcceleratorState._reset_state(reset_partial_state=True)
        self.accelerator = Accelerator(
            log_with=config.log_with,
            mixed_precision=config.mixed_precision,
            project_config=project_config,
            gradient_accumulation_steps=self._accumulation_steps(),
            **config.accelerator_kwargs,
        )
        self._check_runtime()
        if self.accelerator.is_main_process and config.log_with is not None:
            init_kwargs = dict(config.tracker_kwargs)
            if config.run_name and "wandb" not in init_kwargs:
                init_kwargs["wandb"] = {"name": config.run_name}
            self.accelerator.init_trackers(
                config.tracker_project_name, config=config.to_dict(), init_kwargs=init_kwargs
            )
        logger.info("%s config: %s", self._name, config)
        set_seed(config.seed, device_specific=True)

        self._place_pipeline()
        sd_pipeline.set_progress_bar_config(
            position=1,
            disable=not self.accelerator.is_local_main_process,
            leave=False,
            desc="Timestep",
            dynamic_ncols=True,
        )
        if config.allow_tf32 and torch.cuda.is_available():
            torch.backends.cuda.matmul.allow_tf32 = True

        trainable = sd_pipeline.get_trainable_layers()
        self.optimizer = self._setup_optimizer(
            trainable.parameters() if isinstance(trainable, torch.nn.Module) else trainable
        )
        self.neg_prompt_embed = self._encode([config.negative_prompts or ""])
        self.autocast = sd_pipeline.autocast or self.accelerator.autocast
        self.accelerator.register_save_state_pre_hook(self._save_model_hook)
        self.accelerator.register_load_state_pre_hook(self._load_model_hook)
        if isinstance(trainable, torch.nn.Module):
            self.trainable_layers, self.optimizer = self.accelerator.prepare(trainable, self.optimizer)
        else:
            self.trainable_layers = list(trainable)
            self.optimizer = self.accelerator.prepare(self.optimizer)

        self._run_report = StandaloneRunReport(
            config.logdir, bool(getattr(config, "save_run_report", True)) and self.accelerator.is_main_process
        )
        self.first_epoch, self.global_step = 0, 0
        if resume_dir is not None:
            logger.info("Resuming from %s", resume_dir)
            self.accelerator.load_state(resume_dir)
            with open(os.path.join(resume_dir, _STATE_FILE)) as f:
                state = json.load(f)
            self.first_epoch, self.global_step = state["epoch"] + 1, state["global_step"]
            # New checkpoints go after every existing one (resuming from an older checkpoint must not overwrite).
            existing = _checkpoint_indices(os.path.join(self.accelerator.project_dir, "checkpoints"))
            resumed_index = int(os.path.basename(resume_dir).split("_")[-1])
            self.accelerator.project_configuration.iteration = max([resumed_index, *existing]) + 1

    # -- set-up hooks -------------------------------------------------------------------------------------------------

    def _accumulation_steps(self) -> int:
        """Backward passes per optimizer step, as accelerate counts them."""
        return self.config.train_gradient_accumulation_steps

    def _check_runtime(self) -> None:
        """Checks that need the accelerator (process count); the config checked the rest."""

    def _place_pipeline(self) -> None:
        """Frozen parts in the inference dtype on the device; trained (LoRA) parameters stay float32."""
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(self.accelerator.mixed_precision)
        frozen = {"device": self.accelerator.device, **({"dtype": dtype} if dtype is not None else {})}
        self.sd_pipeline.vae.to(**frozen)
        self.sd_pipeline.text_encoder.to(**frozen)
        unet = self.sd_pipeline.unet
        if getattr(self.sd_pipeline, "use_lora", False):
            unet.to(**frozen)
            for param in unet.parameters():
                if param.requires_grad:
                    param.data = param.data.to(torch.float32)
        else:
            unet.to(self.accelerator.device)

    def _setup_optimizer(self, trainable_layers_parameters):
        params = [p for p in trainable_layers_parameters if p.requires_grad]
        if not params:
            raise ValueError("The pipeline has no trainable parameters (get_trainable_layers() requires no grad).")
        if self.config.train_use_8bit_adam:
            try:
                import bitsandbytes
            except ImportError as error:
                raise ImportError(
                    "train_use_8bit_adam=True needs bitsandbytes (`pip install bitsandbytes`); or set it to False."
                ) from error
            optimizer_cls = bitsandbytes.optim.AdamW8bit
        else:
            optimizer_cls = torch.optim.AdamW
        return optimizer_cls(
            params,
            lr=self.config.train_learning_rate,
            betas=(self.config.train_adam_beta1, self.config.train_adam_beta2),
            weight_decay=self.config.train_adam_weight_decay,
            eps=self.config.train_adam_epsilon,
        )

    def _save_model_hook(self, models, weights, output_dir):
        self.sd_pipeline.save_checkpoint(models, weights, output_dir)
        weights.clear()  # the pipeline wrote what is trained; accelerate need not save the whole model again

    def _load_model_hook(self, models, input_dir):
        self.sd_pipeline.load_checkpoint(models, input_dir)
        models.clear()

    # -- shared pieces of a step --------------------------------------------------------------------------------------

    def _encode(self, prompts: list[str]) -> torch.Tensor:
        """Text-encoder embeddings of `prompts` (padded to the tokenizer's maximum length)."""
        tokenizer = self.sd_pipeline.tokenizer
        ids = tokenizer(
            list(prompts),
            return_tensors="pt",
            padding="max_length",
            truncation=True,
            max_length=tokenizer.model_max_length,
        ).input_ids.to(self.accelerator.device)
        with torch.no_grad():
            return self.sd_pipeline.text_encoder(ids)[0]

    def _sample_prompts(self, batch_size: int) -> tuple[tuple[str, ...], tuple[Any, ...]]:
        pairs = [self.prompt_fn() for _ in range(batch_size)]
        for pair in pairs:
            if not (isinstance(pair, tuple | list) and len(pair) == 2 and isinstance(pair[0], str)):
                raise ValueError(f"prompt_function must return (prompt: str, metadata), got {pair!r}.")
        prompts, metadata = zip(*pairs, strict=True)
        return prompts, metadata

    def _call_reward(self, images, prompts, metadata):
        result = self.reward_fn(images, prompts, metadata)
        if not (isinstance(result, tuple | list) and len(result) == 2):
            raise ValueError(
                "reward_function must return (rewards, reward_metadata) with one reward per image, got "
                f"{type(result).__name__}."
            )
        rewards, reward_metadata = result
        rewards = torch.as_tensor(rewards, device=self.accelerator.device) if not torch.is_tensor(rewards) else rewards
        if rewards.shape != (len(prompts),):
            raise ValueError(
                f"reward_function returned rewards of shape {tuple(rewards.shape)}; expected ({len(prompts)},)."
            )
        return rewards, reward_metadata

    def _optimizer_step(self) -> None:
        if self.accelerator.sync_gradients:
            params = (
                self.trainable_layers.parameters()
                if isinstance(self.trainable_layers, torch.nn.Module)
                else self.trainable_layers
            )
            self.accelerator.clip_grad_norm_(params, self.config.train_max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad()

    def _log_images(self, prompt_image_data, global_step: int) -> None:
        """The user's hook if given (with the first tracker), else the images go to every tracker that takes them."""
        if self.image_samples_hook is not None:
            tracker = self.accelerator.trackers[0] if self.accelerator.trackers else None
            self.image_samples_hook(prompt_image_data, global_step, tracker)
            return
        images = self._images_to_log(prompt_image_data)
        for tracker in self.accelerator.trackers:
            if hasattr(tracker, "log_images"):
                try:
                    tracker.log_images({"images": images}, step=global_step)
                except NotImplementedError:
                    continue

    def _images_to_log(self, prompt_image_data) -> np.ndarray:
        """The images of the last sampled batch as `(batch, H, W, 3)` uint8."""
        images = self._last_images(prompt_image_data)
        return (images.detach().float().clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy() * 255).astype(np.uint8)

    @staticmethod
    def _last_images(prompt_image_data) -> torch.Tensor:
        raise NotImplementedError

    def _maybe_save_checkpoint(self, epoch: int, global_step: int) -> None:
        if (epoch + 1) % self.config.save_freq != 0:
            return
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            self.accelerator.save_state()
            iteration = self.accelerator.project_configuration.iteration - 1
            directory = os.path.join(self.accelerator.project_dir, "checkpoints", f"checkpoint_{iteration}")
            with open(os.path.join(directory, _STATE_FILE), "w") as f:
                json.dump({"epoch": epoch, "global_step": global_step}, f)
            self._run_report.checkpoint(global_step, os.path.abspath(directory))

    # -- public API ---------------------------------------------------------------------------------------------------

    def step(self, epoch: int, global_step: int) -> int:
        """One epoch of sampling and training; returns the updated optimizer-step count."""
        raise NotImplementedError

    def loss(self, advantages: torch.Tensor, clip_range: float, ratio: torch.Tensor) -> torch.Tensor:
        """PPO's clipped surrogate ([`ddpo_clipped_loss`])."""
        return ddpo_clipped_loss(advantages, clip_range, ratio)

    def train(self, epochs: int | None = None) -> None:
        """Run epochs `first_epoch .. epochs - 1` (`epochs` defaults to `config.num_epochs`)."""
        global_step = self.global_step
        epochs = self.config.num_epochs if epochs is None else epochs
        model = getattr(self.sd_pipeline, "pretrained_model", None)
        self._run_report.start(global_step, type(self).__name__, model, self.config)
        for epoch in range(self.first_epoch, epochs):
            global_step = self.step(epoch, global_step)
            self._maybe_save_checkpoint(epoch, global_step)
        self.global_step = global_step
        self.first_epoch = max(self.first_epoch, epochs)
        self._run_report.end(global_step)
        self.accelerator.end_training()

    def _log(self, logs: dict[str, Any], step: int) -> None:
        """Send `logs` to the trackers (`log_with`) and to the run report."""
        self.accelerator.log(logs, step=step)
        self._run_report.log(step, logs)

    def save_pretrained(self, save_directory: str) -> None:
        """Write the trained weights (the pipeline's `save_pretrained`) and a model card to `save_directory`."""
        self._save_pretrained(save_directory)

    def _save_pretrained(self, save_directory) -> None:
        os.makedirs(save_directory, exist_ok=True)
        self.sd_pipeline.save_pretrained(save_directory)
        self.create_model_card(output_dir=str(save_directory))

    def push_to_hub(self, repo_id: str, folder: str | None = None, commit_message: str = "End of training") -> str:
        """Upload `folder` (default: the trained weights saved to a temporary directory) to the hub repo `repo_id`.

        Returns:
            `str`: The URL of the commit.
        """
        import tempfile

        from huggingface_hub import create_repo, upload_folder

        create_repo(repo_id, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            if folder is None:
                folder = tmp
                self._save_pretrained(folder)
            return upload_folder(repo_id=repo_id, folder_path=folder, commit_message=commit_message).commit_url

    def create_model_card(
        self,
        model_name: str | None = None,
        dataset_name: str | None = None,
        tags: str | list[str] | None = None,
        output_dir: str | None = None,
    ) -> None:
        """Write `README.md` describing the run into `output_dir` (default: `config.logdir`)."""
        from ..trainer.utils.reporting import generate_model_card

        output_dir = output_dir or self.config.logdir
        base_model = getattr(self.sd_pipeline, "pretrained_model", None)
        if base_model is not None and os.path.isdir(base_model):
            base_model = None  # a local path is no hub reference
        tags = [tags] if isinstance(tags, str) else list(tags or [])
        card = generate_model_card(
            base_model=base_model,
            model_name=model_name or self.config.exp_name,
            hub_model_id=model_name or self.config.exp_name,
            dataset_name=dataset_name,
            tags=[*self._tag_names, *tags],
            wandb_url=None,
            trackio_url=None,
            trainer_name=self._name,
        )
        os.makedirs(output_dir, exist_ok=True)
        card.save(os.path.join(output_dir, "README.md"))
