"""Configuration of the on-policy distillation trainer."""

from dataclasses import dataclass, field
from typing import Any, ClassVar

from .base_config import _BaseConfig
from .online_config import _RolloutFields


@dataclass
class DistillationConfig(_RolloutFields, _BaseConfig):
    r"""Configuration for [`DistillationTrainer`]: on-policy knowledge distillation.

    The student samples one completion per prompt and is trained to match a frozen teacher's next-token distribution
    on it, token by token, with the generalized Jensen-Shannon divergence of GKD (Agarwal et al., 2024). Only the
    fields TRL adds or whose default differs from [`~transformers.TrainingArguments`] are listed; every other
    `TrainingArguments` field works as usual. One generation round covers one optimizer step: its
    `per_device_train_batch_size * num_processes * gradient_accumulation_steps` prompts are generated together and
    split into the micro-batches of that step.

    Args:
        learning_rate (`float`, defaults to `1e-6`):
            Initial learning rate for AdamW (the parent default is `5e-5`).
        remove_unused_columns (`bool` or `None`, defaults to `False`):
            Keep the dataset columns other than `prompt` (a per-row `chat_template_kwargs` or `tools`, for example).

        > Models

        model_init_kwargs (`dict[str, Any]`, `str` or `None`, defaults to `None`):
            Keyword arguments for `from_pretrained` when the student is given as a string (a dict, or a JSON string on
            the command line). Its `revision` is reused when loading the processing class.
        trust_remote_code (`bool`, defaults to `False`):
            Allow custom modelling code from the model repositories when the trainer loads models or processors.
        teacher_model_name_or_path (`str` or `None`, defaults to `None`):
            Path or hub id of the teacher, loaded when the trainer is given no `teacher_model` (the `trl
            distillation` command passes it as `teacher_model`).
        teacher_model_revision (`str` or `None`, defaults to `None`):
            Revision (branch, tag or commit) of the teacher when it is loaded from a string.
        teacher_model_init_kwargs (`dict[str, Any]`, `str` or `None`, defaults to `None`):
            Keyword arguments for the teacher's `from_pretrained` (for example `{"dtype": "bfloat16"}`).
        disable_dropout (`bool`, defaults to `False`):
            Set every dropout probability of the student and the teacher to zero.

        > Generation

        max_completion_length (`int` or `None`, defaults to `512`):
            Maximum number of tokens the student generates per completion.
        ds3_gather_for_generation (`bool`, defaults to `True`), shuffle_dataset (`bool` or `None`, defaults to
        `True`), pad_to_multiple_of (`int`, `str` or `None`, defaults to `"auto"`):
            ZeRO-3 weight gathering for generation, prompt shuffling and length padding, as in [`GRPOConfig`].
        temperature (`float`, defaults to `1.0`):
            Sampling temperature, and the temperature both models' logits are divided by in the divergence.
        top_p (`float`, defaults to `1.0`), top_k (`int`, defaults to `0`), min_p (`float` or `None`, defaults to
        `None`), repetition_penalty (`float`, defaults to `1.0`), cache_implementation (`str` or `None`, defaults to
        `None`):
            Sampling settings of the student, as in [`GRPOConfig`].
        generation_kwargs (`dict`, `str` or `None`, defaults to `None`):
            Extra arguments for the transformers `GenerationConfig` (or vLLM `SamplingParams`); they override the
            fields above (`{"do_sample": false}` for greedy completions).
        chat_template_kwargs (`dict`, `str` or `None`, defaults to `None`):
            Extra keyword arguments for `apply_chat_template` when rendering conversational prompts.
        use_vllm (`bool`, defaults to `False`), vllm_* :
            Generate with vLLM (colocated or a `trl vllm-serve` server), with the same fields as [`GRPOConfig`].

        > Divergence

        beta (`float`, defaults to `1.0`):
            Interpolation of the generalized JSD, in `[0, 1]`: `0` is the forward KL `KL(teacher || student)`, `0.5`
            the Jensen-Shannon divergence, `1` the reverse KL `KL(student || teacher)`.

        > Tools

        max_tool_calling_iterations (`int` or `None`, defaults to `None`):
            Maximum rounds of tool calls per completion when the trainer is given `tools`. `None`: until the model
            stops calling tools or the completion budget is spent.

        > Logging

        log_completions (`bool`, defaults to `False`):
            Log a table of sampled prompts and completions at each logging step (printed with `rich`, written as
            parquet under `output_dir/completions`, sent to wandb when it is a reporter).
        num_completions_to_print (`int` or `None`, defaults to `None`):
            Rows of that table printed to the console. `None`: all.
        log_unique_prompts (`bool`, defaults to `False`):
            Show each prompt only once in the logged tables.
    """

    # `beta` interpolates two divergences here: its [0, 1] range is checked below, not by the shared rule.
    _checks_own_beta: ClassVar[bool] = True

    _VALID_DICT_FIELDS = _BaseConfig._VALID_DICT_FIELDS + [
        "model_init_kwargs",
        "teacher_model_init_kwargs",
        "generation_kwargs",
        "chat_template_kwargs",
    ]

    # Read by the shared online rollout machinery (`_OnlineTrainer`), which serves GRPO-style configs too: one
    # completion per prompt, each generation round trained on once, no reward shaping. Class constants, not fields:
    # TRL's DistillationConfig has no such options.
    num_generations: ClassVar[int] = 1
    num_iterations: ClassVar[int] = 1
    mask_truncated_completions: ClassVar[bool] = False
    reward_weights: ClassVar[None] = None

    # Models (the student's `model_init_kwargs`, `trust_remote_code`, `disable_dropout`, the generation, sampling,
    # vLLM and logging fields come from `_RolloutFields`)
    teacher_model_name_or_path: str | None = field(
        default=None, metadata={"help": "Path or hub id of the teacher when no teacher model is passed."}
    )
    teacher_model_revision: str | None = field(
        default=None, metadata={"help": "Revision of the teacher loaded from a string."}
    )
    teacher_model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={"help": "Keyword arguments for the teacher's `from_pretrained` (dict or JSON string)."},
    )

    # Divergence
    beta: float = field(
        default=1.0,
        metadata={"help": "Generalized JSD interpolation in [0, 1]: 0 forward KL, 0.5 JSD, 1 reverse KL."},
    )

    # Tools
    max_tool_calling_iterations: int | None = field(
        default=None, metadata={"help": "Maximum rounds of tool calls per completion. None: no limit."}
    )

    def __post_init__(self):
        self._prepare_rollout_fields()
        super().__post_init__()
        self._reject_context_parallelism()
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(
                f"beta must be in [0.0, 1.0], got {self.beta}. Use 0 for the forward KL KL(teacher || student), 0.5 "
                "for the Jensen-Shannon divergence and 1 for the reverse KL KL(student || teacher)."
            )
        self._check_generation_fields()
        if self.max_tool_calling_iterations is not None and self.max_tool_calling_iterations < 0:
            raise ValueError(
                f"max_tool_calling_iterations must be >= 0 or None; got {self.max_tool_calling_iterations}."
            )

    @property
    def steps_per_generation(self) -> int:
        """Micro-steps that consume one generation round: one optimizer step (`gradient_accumulation_steps`)."""
        return self.gradient_accumulation_steps

    @property
    def generation_batch_size(self) -> int:
        """Prompts (one completion each) generated per round, across all processes."""
        return self.per_device_train_batch_size * self.world_size * self.gradient_accumulation_steps
