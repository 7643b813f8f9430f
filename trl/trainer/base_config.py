"""The configuration base shared by every TRL trainer config."""

import logging
import warnings
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from .run_report.config_summary import record_fields_set


logger = logging.getLogger(__name__)


def _has_bf16_accelerator() -> bool:
    """Whether an accelerator that can train in bfloat16 is present (CPU-only machines return False)."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return True
    try:
        from transformers.utils import is_torch_npu_available

        if is_torch_npu_available():
            return True
    except ImportError:
        pass
    return False


def _has_any_accelerator() -> bool:
    import torch

    if torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available()):
        return True
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def warn_trl_trains_anyway(what: str, advice: str, stacklevel: int = 4) -> None:
    """Warn about a setting TRL accepts and trains with although it is probably a mistake (a check stricter than TRL
    warns instead of refusing). The message says what the setting does, that training goes on as in TRL, and `advice`.

    Args:
        what: What the setting does, as a sentence.
        advice: How to get the usual behaviour.
        stacklevel: Passed to `warnings.warn` (the default points at the config's construction).
    """
    warnings.warn(f"{what} Training goes on as in TRL; {advice}", UserWarning, stacklevel=stacklevel)


def _values(value: Any) -> list:
    """The numbers of a scalar-or-list option (per-epoch schedules such as Online DPO's `beta` are lists)."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


# Options shared by several configs, each checked wherever a config has it: (name, lowest legal value, whether the
# bound itself is legal, what the option does). transformers' TrainingArguments accepts all of these out of range and
# fails later (`gradient_accumulation_steps=0` with a ZeroDivisionError in the first step). A negative `beta` is the
# exception: TRL trains with it (the preference or KL term turned around), so it only warns (`_WARN_ONLY`).
_LOWER_BOUNDS = (
    ("gradient_accumulation_steps", 1, True, "the number of micro-batches summed before each optimizer step"),
    ("per_device_train_batch_size", 1, True, "the number of training examples per device and micro-batch"),
    ("per_device_eval_batch_size", 1, True, "the number of evaluation examples per device and batch"),
    ("learning_rate", 0.0, True, "the optimizer's step size"),
    ("dataset_num_proc", 1, True, "the number of dataset-preparation processes (None for one)"),
    ("beta", 0.0, True, "the strength of the reference (KL) term"),
    ("repetition_penalty", 0.0, False, "the divisor of already generated tokens' logits (1.0 disables it)"),
)
_WARN_ONLY = ("beta",)


def _check_common_ranges(config: Any) -> None:
    """Refuse out-of-range values of the options listed in `_LOWER_BOUNDS`, and of a few cross-field rules, before
    anything runs."""
    # In the distillation configs `beta` interpolates two divergences; they check its [0, 1] range themselves.
    own_beta_rule = getattr(type(config), "_checks_own_beta", False)
    for name, bound, inclusive, meaning in _LOWER_BOUNDS:
        value = getattr(config, name, None)
        if value is None or isinstance(value, str) or (name == "beta" and own_beta_rule):
            continue
        for number in _values(value):
            if isinstance(number, (int, float)) and (number < bound or (number == bound and not inclusive)):
                relation = ">=" if inclusive else ">"
                if name in _WARN_ONLY:
                    warn_trl_trains_anyway(
                        f"{name}={value} is below {bound}: it is {meaning}, and a negative value turns that term "
                        "around.",
                        f"set {name} {relation} {bound} unless this is intended.",
                        stacklevel=5,
                    )
                    break
                raise ValueError(
                    f"{name} must be {relation} {bound}; got {value}. It is {meaning}; set it to a value "
                    f"{relation} {bound}."
                )
    if getattr(config, "max_steps", None) == 0:
        # transformers (and TRL) run one step at learning rate 0 and save the untouched model as if it were trained.
        # A warning, not an error: TRL completes such a run.
        warnings.warn(
            "max_steps=0 trains nothing: transformers runs one optimizer step at learning rate 0 and saves the model "
            "unchanged. Set max_steps to the number of optimizer steps to run, or leave it at -1 (the default) to "
            "train for num_train_epochs.",
            UserWarning,
            stacklevel=4,
        )
    min_p = getattr(config, "min_p", None)
    if min_p is not None and not 0.0 <= min_p <= 1.0:
        raise ValueError(
            f"`min_p` has to be a float in the [0, 1] interval, but is {min_p}. min_p is a share of the top token's "
            "probability; set it in [0, 1] or None."
        )
    if getattr(config, "sync_ref_model", False):
        alpha, steps = config.ref_model_mixup_alpha, config.ref_model_sync_steps
        if not 0.0 <= alpha <= 1.0:
            warn_trl_trains_anyway(
                f"ref_model_mixup_alpha={alpha} is outside [0, 1]: each reference update extrapolates past the policy "
                "or the old reference instead of blending them.",
                "use a value in [0, 1] (the policy's share in the reference update) unless this is intended.",
            )
        if steps < 1:
            raise ValueError(
                f"ref_model_sync_steps must be a positive integer with sync_ref_model=True (the reference is "
                f"updated every that many steps); got {steps}."
            )


@dataclass
class _BaseConfig(TrainingArguments):
    """Defaults shared by all TRL trainer configs, on top of [`~transformers.TrainingArguments`].

    Compared with `TrainingArguments`, TRL logs more often (`logging_steps=10`), turns gradient checkpointing on
    (`gradient_checkpointing=True`) and trains in bfloat16 unless fp16 is requested (`bf16=None`).

    With `use_cpu=True`, `bf16=None` resolves to `True` (CPU bfloat16 autocast), as in TRL. On a machine with no
    accelerator and without `use_cpu`, TRL's `True` would be refused by transformers ("Your setup doesn't support
    bf16/gpu"); there it resolves to `False` (plain float32) so that a run starts without extra flags, and the choice
    is logged.

    Args:
        logging_steps (`float`, defaults to `10`):
            Log every X update steps. An integer, or a float in `[0, 1)` taken as a ratio of the total steps.
        gradient_checkpointing (`bool`, defaults to `True`):
            Trade compute for memory by recomputing activations in the backward pass.
        bf16 (`bool` or `None`, defaults to `None`):
            Train in bfloat16 mixed precision. `None` means `not fp16` when a bf16-capable accelerator is present or
            `use_cpu=True`, `False` otherwise.
        lr_scheduler_kwargs (`dict`, `str` or `None`, defaults to `None`):
            Extra arguments for the learning-rate scheduler (a dict, or a JSON string on the command line).
        use_liger_kernel (`bool`, defaults to `False`):
            Patch the model with Liger kernels (requires `liger-kernel`).
        torch_empty_cache_steps (`int` or `None`, defaults to `None`):
            Call `torch.*.empty_cache()` every this many steps to lower peak memory (slower).
        save_run_report (`bool`, defaults to `True`):
            Write `metrics.jsonl` and `report.html` into `output_dir` (an addition of this project; TRL has no such
            field). See `docs/run_report.md`.
    """

    logging_steps: float = field(
        default=10,
        metadata={
            "help": "Log every X update steps: an integer, or a float in [0, 1) taken as a ratio of total steps."
        },
    )
    gradient_checkpointing: bool = field(
        default=True,
        metadata={"help": "Recompute activations in the backward pass to save memory at the cost of compute."},
    )
    bf16: bool | None = field(
        default=None,
        metadata={
            "help": "Train in bfloat16 mixed precision. None means `not fp16` when a bf16-capable accelerator is "
            "present or `use_cpu=True`, and False on a CPU-only machine without `use_cpu`."
        },
    )
    lr_scheduler_kwargs: dict | str | None = field(
        default=None,
        metadata={"help": "Extra arguments for the learning-rate scheduler (dict or JSON string)."},
    )
    use_liger_kernel: bool = field(
        default=False,
        metadata={
            "help": "Patch the model with Liger kernels to lower memory and raise throughput (needs liger-kernel)."
        },
    )
    torch_empty_cache_steps: int | None = field(
        default=None,
        metadata={"help": "Empty the accelerator cache every this many steps (lower peak memory, slower)."},
    )
    save_run_report: bool = field(
        default=True,
        metadata={"help": "Write metrics.jsonl and report.html (curves, data, config) into output_dir."},
    )

    def __post_init__(self):
        record_fields_set(self)  # before any default is resolved: the run report lists what the user set
        _check_common_ranges(self)
        if self.dataloader_pin_memory and not _has_any_accelerator():
            self.dataloader_pin_memory = False  # pinning only helps host-to-device copies; avoids a torch warning
        if self.bf16 is None:
            if self.fp16:
                self.bf16 = False
            elif not getattr(self, "use_cpu", False) and not _has_bf16_accelerator():
                self.bf16 = False
                logger.info("bf16=None resolved to False: no bf16-capable accelerator found, training in float32.")
            else:
                self.bf16 = True
        # transformers 5 renamed gradient_checkpointing to activation_checkpointing; TRL's documented name stays
        # `gradient_checkpointing`, so map it here instead of letting every config emit a FutureWarning.
        if getattr(self, "activation_checkpointing", False) is None and self.gradient_checkpointing is not None:
            self.activation_checkpointing = self.gradient_checkpointing
        if (
            getattr(self, "activation_checkpointing_kwargs", False) is None
            and self.gradient_checkpointing_kwargs is not None
        ):
            self.activation_checkpointing_kwargs = self.gradient_checkpointing_kwargs
        super().__post_init__()
