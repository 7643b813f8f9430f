"""Fields shared by the diffusion RL configs (DDPO, AlignProp): run, logging, checkpointing, sampling, optimizer."""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


def _script_name() -> str:
    return Path(sys.argv[0]).stem if sys.argv and sys.argv[0] else "diffusion"


@dataclass
class _DiffusionRLConfig:
    """Options common to [`DDPOConfig`] and [`AlignPropConfig`]; not used on its own."""

    exp_name: str = field(
        default_factory=_script_name, metadata={"help": "Experiment name; defaults to the running script's name."}
    )
    run_name: str = field(default="", metadata={"help": "Run name handed to the trackers (empty: the tracker's own)."})
    seed: int = field(default=0, metadata={"help": "Seed for sampling and initialisation (offset per process)."})
    log_with: str | None = field(
        default=None,
        metadata={"help": "Tracker(s) to log to through accelerate: 'wandb', 'tensorboard', 'all', ... or None."},
    )
    tracker_kwargs: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "Per-tracker init keyword arguments (accelerate `init_kwargs`)."}
    )
    accelerator_kwargs: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "Extra keyword arguments for `accelerate.Accelerator`."}
    )
    project_kwargs: dict[str, Any] = field(
        default_factory=dict,
        metadata={"help": "Extra keyword arguments for `accelerate.utils.ProjectConfiguration` (checkpoint layout)."},
    )
    tracker_project_name: str = field(default="trl", metadata={"help": "Project name for the trackers."})
    logdir: str = field(
        default="logs", metadata={"help": "Directory of the tracker logs and of `checkpoints/checkpoint_<n>`."}
    )
    num_epochs: int = field(default=100, metadata={"help": "Number of epochs `train()` runs."})
    save_freq: int = field(default=1, metadata={"help": "Save a checkpoint every this many completed epochs."})
    num_checkpoint_limit: int = field(default=5, metadata={"help": "Keep at most this many checkpoints."})
    mixed_precision: str = field(
        default="fp16",
        metadata={
            "help": "'no', 'fp16' or 'bf16': the frozen parts run in this dtype, the trained ones under autocast."
        },
    )
    allow_tf32: bool = field(default=True, metadata={"help": "Allow TF32 matrix products on Ampere GPUs."})
    resume_from: str = field(
        default="",
        metadata={"help": "Checkpoint directory (`.../checkpoint_<n>`) or checkpoints folder (latest one) to resume."},
    )
    sample_num_steps: int = field(default=50, metadata={"help": "Number of DDIM denoising steps per image."})
    sample_eta: float = field(default=1.0, metadata={"help": "DDIM noise weight eta (0: deterministic DDIM)."})
    sample_guidance_scale: float = field(default=5.0, metadata={"help": "Classifier-free guidance scale."})
    train_batch_size: int = field(default=1, metadata={"help": "Per-process batch size of a training step."})
    train_use_8bit_adam: bool = field(
        default=False, metadata={"help": "Use bitsandbytes' 8-bit AdamW (needs bitsandbytes and a GPU)."}
    )
    train_learning_rate: float = field(default=3e-4, metadata={"help": "AdamW learning rate."})
    train_adam_beta1: float = field(default=0.9, metadata={"help": "AdamW beta1."})
    train_adam_beta2: float = field(default=0.999, metadata={"help": "AdamW beta2."})
    train_adam_weight_decay: float = field(default=1e-4, metadata={"help": "AdamW weight decay."})
    train_adam_epsilon: float = field(default=1e-8, metadata={"help": "AdamW epsilon."})
    train_gradient_accumulation_steps: int = field(
        default=1, metadata={"help": "Batches accumulated into one optimizer step."}
    )
    train_max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping norm."})
    push_to_hub: bool = field(
        default=False, metadata={"help": "Read by the example scripts: push the trained weights after training."}
    )
    save_run_report: bool = field(
        default=True,
        metadata={"help": "Write `metrics.jsonl` and `report.html` (curves, config) into `logdir` (not a TRL field)."},
    )

    def __post_init__(self):
        for name in ("num_epochs", "save_freq", "num_checkpoint_limit", "sample_num_steps", "train_batch_size"):
            self._require_positive(name)
        self._require_positive("train_gradient_accumulation_steps")
        if self.mixed_precision not in ("no", "fp16", "bf16"):
            raise ValueError(
                f"mixed_precision must be 'no', 'fp16' or 'bf16', got {self.mixed_precision!r}; on a CPU use 'no'."
            )

    def _require_positive(self, name: str) -> None:
        value = getattr(self, name)
        if value < 1:
            raise ValueError(f"{type(self).__name__}.{name} must be a positive integer, got {value}.")

    def to_dict(self) -> dict[str, Any]:
        """The options as a flat dict (what the trackers receive as the run's config)."""
        return asdict(self)
