"""Configuration of the SDFT trainer."""

from dataclasses import dataclass, field
from typing import Literal

from .._self_distillation.config import _SelfDistillationConfig


@dataclass
class SDFTConfig(_SelfDistillationConfig):
    r"""Configuration for [`experimental.sdft.SDFTTrainer`] (self-distillation fine-tuning).

    The student generates from the plain prompt; the teacher is the same model (or a copy of it) reading the prompt
    together with privileged context (`teacher_prompt_template`); the student is trained to match the teacher's
    next-token distribution on the student's own completions.

    Rollout fields (`num_generations`, `max_prompt_length`, `max_completion_length`, sampling, `use_vllm`, ...) are
    those of [`GRPOConfig`] with the defaults of TRL's SDFT (e.g. `max_completion_length=256`, `top_k=0`).

    Args:
        teacher_model_kind (`str`, defaults to `"base"`):
            `"base"`: a frozen copy of the initial model (with PEFT: the model with adapters disabled); `"live"`: the
            student itself; `"ema"`: a copy (or with pure LoRA training, a `teacher` adapter) following the student
            as an exponential moving average. Any other value acts like `"base"`.
        teacher_update_rate (`float`, defaults to `0.05`):
            EMA rate of the `"ema"` teacher.
        teacher_sync_steps (`int`, defaults to `1`):
            Update the `"ema"` teacher every this many optimizer steps.
        distillation_alpha (`float`, defaults to `0.5`):
            Divergence: 0 forward KL(teacher || student), 1 reverse KL, in between the generalized JSD.
        distillation_mode (`str`, defaults to `"topk_logits"`):
            `"topk_logits"` (the student's top-k tokens), `"full_logits"` (whole vocabulary) or `"sampled_token"`
            (reverse KL estimated on the sampled tokens; needs `distillation_alpha=1`).
        distillation_topk (`int` or `None`, defaults to `100`):
            Support size of `"topk_logits"`.
        distillation_is_clip (`float` or `None`, defaults to `2.0`):
            Cap of the importance weight `pi / pi_old` applied to the per-token loss when old log-probabilities exist
            (generation batches reused over several steps).
        distillation_add_tail (`bool`, defaults to `False`):
            Keep the probability mass outside the top-k support as one extra bucket instead of renormalising.
        generate_from_teacher (`bool`, defaults to `False`):
            Sample completions from the teacher prompt instead of the student prompt.
        teacher_prompt_template (`str`, defaults to `"{prompt}\n\n{privileged_context}"`):
            How the teacher's prompt is built; must contain `{prompt}` and `{privileged_context}`.
        num_loss_tokens_to_skip (`int`, defaults to `0`):
            Leave the first completion tokens of every sequence out of the loss.
    """

    teacher_model_kind: str = field(default="base", metadata={"help": "'base', 'live' or 'ema'."})
    teacher_update_rate: float = field(default=0.05, metadata={"help": "EMA rate of the 'ema' teacher."})
    teacher_sync_steps: int = field(default=1, metadata={"help": "Update the 'ema' teacher every N steps."})
    distillation_alpha: float = field(
        default=0.5, metadata={"help": "0: forward KL, 1: reverse KL, in between: generalized JSD."}
    )
    distillation_mode: Literal["sampled_token", "full_logits", "topk_logits"] = field(
        default="topk_logits", metadata={"help": "'topk_logits', 'full_logits' or 'sampled_token'."}
    )
    distillation_topk: int | None = field(default=100, metadata={"help": "Support size of 'topk_logits'."})
    distillation_is_clip: float | None = field(
        default=2.0, metadata={"help": "Cap of the importance weight on the per-token loss (None: no weight)."}
    )
    distillation_add_tail: bool = field(
        default=False, metadata={"help": "Keep the mass outside the top-k as one bucket instead of renormalising."}
    )
    generate_from_teacher: bool = field(default=False, metadata={"help": "Sample from the teacher prompt."})
    teacher_prompt_template: str = field(
        default="{prompt}\n\n{privileged_context}",
        metadata={"help": "Teacher prompt; must contain {prompt} and {privileged_context}."},
    )
    num_loss_tokens_to_skip: int = field(
        default=0, metadata={"help": "Leave the first N completion tokens out of the loss."}
    )

    def __post_init__(self):
        super().__post_init__()
        if (
            "{prompt}" not in self.teacher_prompt_template
            or "{privileged_context}" not in self.teacher_prompt_template
        ):
            raise ValueError(
                "teacher_prompt_template must contain both `{prompt}` and `{privileged_context}` placeholders; got "
                f"{self.teacher_prompt_template!r}."
            )
