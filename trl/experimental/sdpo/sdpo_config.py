"""Configuration of the SDPO trainer."""

from dataclasses import dataclass, field
from typing import Literal

from .._self_distillation.config import _SelfDistillationConfig


_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


@dataclass
class SDPOConfig(_SelfDistillationConfig):
    r"""Configuration for [`experimental.sdpo.SDPOTrainer`] (self-distillation policy optimization).

    Completions are sampled and scored by reward functions as in GRPO. A completion's teacher is the same model (or an
    EMA copy) reading the prompt followed by a successful sibling completion and/or the environment's feedback
    (`reprompt_template`); the student is trained to match that teacher on its own completion, optionally mixed with a
    PPO-clipped policy-gradient loss (`distillation_weight < 1`).

    Rollout fields (`num_generations`, `max_prompt_length`, `max_completion_length`, sampling, `use_vllm`, ...) and
    the teacher fields are those of [`experimental.sdft.SDFTConfig`].

    Args:
        loss_type (`str`, defaults to `"dapo"`):
            Aggregation of the policy loss: `"grpo"` (mean of each sequence's token mean), `"bnpo"` / `"dapo"` (token
            mean over the micro-batch) or `"dr_grpo"` (token sum over `batch_size * max_completion_length`).
        mask_truncated_completions (`bool`, defaults to `False`):
            Leave completions that did not end with an end-of-sequence token out of both losses.
        dont_reprompt_on_self_success (`bool`, defaults to `True`):
            A completion is never its own demonstration (a lone success in its group gets no teacher context).
        beta (`float`, defaults to `0.0`):
            Kept for compatibility; SDPO has no KL term.
        epsilon (`float`, defaults to `0.2`):
            Lower clipping range of the policy ratio.
        epsilon_high (`float` or `None`, defaults to `None`):
            Upper clipping range; `None` uses `epsilon`.
        importance_sampling_level (`str`, defaults to `"token"`):
            `"token"` ratios, or `"sequence"` (one ratio per completion from its mean log-ratio).
        reward_weights (`list[float]` or `None`, defaults to `None`):
            Weight of each reward function; `None` weighs them all 1.
        scale_rewards (`str`, defaults to `"group"`):
            Advantage scaling: `"group"` (group std), `"batch"` (batch std) or `"none"`. `True`/`False` mean
            `"group"`/`"none"`.
        distillation_alpha (`float`, defaults to `1.0`):
            Divergence: 0 forward KL(teacher || student), 1 reverse KL, in between the generalized JSD.
        distillation_mode (`str`, defaults to `"sampled_token"`):
            `"sampled_token"`, `"topk_logits"` or `"full_logits"` (see SDFT).
        distillation_topk (`int` or `None`, defaults to `None`):
            Support size of `"topk_logits"`.
        distillation_is_clip (`float` or `None`, defaults to `2.0`):
            Cap of the importance weight on the per-token distillation loss when old log-probabilities exist.
        distillation_add_tail (`bool`, defaults to `False`):
            Keep the mass outside the top-k support as one extra bucket instead of renormalising.
        distillation_weight (`float`, defaults to `1.0`):
            `w` in `(1 - w) * policy_loss + w * distillation_loss`; 1 trains on self-distillation only, 0 on the
            policy loss only. Must lie in [0, 1].
        teacher_model_kind (`str`, defaults to `"ema"`):
            `"ema"`, `"base"` or `"live"` (see SDFT).
        teacher_update_rate (`float`, defaults to `0.05`):
            EMA rate of the `"ema"` teacher.
        teacher_sync_steps (`int`, defaults to `1`):
            Update the `"ema"` teacher every this many optimizer steps.
        max_reprompt_len (`int`, defaults to `10240`):
            Keep at most this many tokens (the last ones) of a teacher prompt.
        use_successful_as_teacher (`bool`, defaults to `True`):
            Show the teacher a successful completion of the same prompt.
        success_reward_threshold (`float`, defaults to `1.0`):
            A completion whose total reward reaches this value is a success.
        reprompt_template (`str`):
            Teacher prompt, filled with `{prompt}`, `{solution}` and `{feedback}`.
        solution_template (`str`):
            Text of `{solution}`, filled with `{successful_previous_attempt}`.
        feedback_template (`str`):
            Text of `{feedback}`, filled with `{feedback_raw}` (the row's `privileged_context`).
        include_environment_feedback (`bool`, defaults to `False`):
            Show the teacher the row's `privileged_context` as feedback.
        environment_feedback_only_without_solution (`bool`, defaults to `False`):
            Show the feedback only when no successful completion is available.
        remove_thinking_from_demonstration (`bool`, defaults to `False`):
            Strip `<think>...</think>` blocks, then leading and trailing whitespace, from the demonstration.
        diagnostics_warning_interval (`int`, defaults to `10`):
            Warn about a degenerate state (flat rewards, no successes, no reprompted samples) at its first and every
            this-many-th consecutive occurrence; 0 disables the warnings.
        diagnostics_flat_tolerance (`float`, defaults to `1e-8`):
            A group whose reward std is at most this is flat.
    """

    loss_type: str = field(default="dapo", metadata={"help": "'grpo', 'bnpo', 'dr_grpo' or 'dapo'."})
    mask_truncated_completions: bool = field(
        default=False, metadata={"help": "Leave truncated completions out of the losses."}
    )
    dont_reprompt_on_self_success: bool = field(
        default=True, metadata={"help": "Never use a completion as its own demonstration."}
    )
    beta: float = field(default=0.0, metadata={"help": "Unused (no KL term); kept for compatibility."})
    epsilon: float = field(default=0.2, metadata={"help": "Lower clipping range of the policy ratio."})
    epsilon_high: float | None = field(default=None, metadata={"help": "Upper clipping range (None: epsilon)."})
    importance_sampling_level: str = field(default="token", metadata={"help": "'token' or 'sequence'."})
    reward_weights: list[float] | None = field(default=None, metadata={"help": "Weight of each reward function."})
    scale_rewards: str = field(default="group", metadata={"help": "'group', 'batch' or 'none'."})
    distillation_alpha: float = field(
        default=1.0, metadata={"help": "0: forward KL, 1: reverse KL, in between: generalized JSD."}
    )
    distillation_mode: Literal["sampled_token", "full_logits", "topk_logits"] = field(
        default="sampled_token", metadata={"help": "'sampled_token', 'topk_logits' or 'full_logits'."}
    )
    distillation_topk: int | None = field(default=None, metadata={"help": "Support size of 'topk_logits'."})
    distillation_is_clip: float | None = field(
        default=2.0, metadata={"help": "Cap of the importance weight on the per-token loss (None: no weight)."}
    )
    distillation_add_tail: bool = field(
        default=False, metadata={"help": "Keep the mass outside the top-k as one bucket instead of renormalising."}
    )
    distillation_weight: float = field(
        default=1.0, metadata={"help": "Weight of the self-distillation loss against the policy loss, in [0, 1]."}
    )
    teacher_model_kind: str = field(default="ema", metadata={"help": "'ema', 'base' or 'live'."})
    teacher_update_rate: float = field(default=0.05, metadata={"help": "EMA rate of the 'ema' teacher."})
    teacher_sync_steps: int = field(default=1, metadata={"help": "Update the 'ema' teacher every N steps."})
    max_reprompt_len: int = field(default=10240, metadata={"help": "Keep the last N tokens of a teacher prompt."})
    use_successful_as_teacher: bool = field(
        default=True, metadata={"help": "Show the teacher a successful completion of the same prompt."}
    )
    success_reward_threshold: float = field(default=1.0, metadata={"help": "Total reward of a success."})
    reprompt_template: str = field(
        default="{prompt}{solution}{feedback}\n\nCorrectly solve the original question.\n",
        metadata={"help": "Teacher prompt with {prompt}, {solution} and {feedback}."},
    )
    solution_template: str = field(
        default="\nCorrect solution:\n\n{successful_previous_attempt}\n\n",
        metadata={"help": "Text of {solution}, with {successful_previous_attempt}."},
    )
    feedback_template: str = field(
        default="\nThe following is feedback from your unsuccessful earlier attempt:\n\n{feedback_raw}\n\n",
        metadata={"help": "Text of {feedback}, with {feedback_raw}."},
    )
    include_environment_feedback: bool = field(
        default=False, metadata={"help": "Show the teacher the row's privileged_context as feedback."}
    )
    environment_feedback_only_without_solution: bool = field(
        default=False, metadata={"help": "Show the feedback only when no successful completion exists."}
    )
    remove_thinking_from_demonstration: bool = field(
        default=False, metadata={"help": "Strip <think>...</think> from the demonstration."}
    )
    diagnostics_warning_interval: int = field(
        default=10, metadata={"help": "Warn on the 1st and every N-th consecutive degenerate step (0: never)."}
    )
    diagnostics_flat_tolerance: float = field(
        default=1e-8, metadata={"help": "Reward std at or below which a group is flat."}
    )

    def __post_init__(self):
        if not 0.0 <= self.distillation_weight <= 1.0:
            raise ValueError(f"distillation_weight must lie in [0, 1], got {self.distillation_weight}.")
        if isinstance(self.scale_rewards, bool):
            self.scale_rewards = "group" if self.scale_rewards else "none"
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        super().__post_init__()
