"""Configuration of the Generalized Knowledge Distillation (GKD) trainer."""

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ...trainer.sft_config import SFTConfig


@dataclass
class GKDConfig(SFTConfig):
    r"""Configuration for [`experimental.gkd.GKDTrainer`]; every [`SFTConfig`] field applies as well.

    Args:
        temperature (`float`, defaults to `0.9`):
            Sampling temperature of the on-policy (student) and sequence-level (teacher) generations.
        lmbda (`float`, defaults to `0.5`):
            Probability, drawn once per training batch, that the batch's completions are replaced by the student's
            own samples (on-policy distillation). 0 never generates, 1 always does.
        beta (`float`, defaults to `0.5`):
            Interpolation of the generalized Jensen-Shannon divergence: 0 is the forward KL `KL(teacher || student)`,
            1 the reverse KL `KL(student || teacher)`.
        max_new_tokens (`int`, defaults to `128`):
            Maximum number of tokens generated per completion.
        teacher_model_name_or_path (`str` or `None`, defaults to `None`):
            Path or hub id of the teacher, used when the trainer's `teacher_model` argument is None.
        teacher_model_init_kwargs (`dict[str, Any]`, `str` or `None`, defaults to `None`):
            Keyword arguments for `from_pretrained` when the teacher is given as a string (a dict, or a JSON string on
            the command line).
        disable_dropout (`bool`, defaults to `True`):
            Set every dropout probability of the student and of the teacher to zero.
        seq_kd (`bool`, defaults to `False`):
            Sequence-level KD: on batches that are not on-policy, the teacher generates the completions the student is
            trained on (instead of the dataset's).
    """

    # `beta` interpolates two divergences here: its [0, 1] range is checked below, not by the shared rule.
    _checks_own_beta: ClassVar[bool] = True

    _VALID_DICT_FIELDS = SFTConfig._VALID_DICT_FIELDS + ["teacher_model_init_kwargs"]

    temperature: float = field(default=0.9, metadata={"help": "Sampling temperature of the generations."})
    lmbda: float = field(
        default=0.5, metadata={"help": "Probability per batch of training on student-generated completions."}
    )
    beta: float = field(
        default=0.5,
        metadata={"help": "Generalized JSD interpolation: 0 forward KL(teacher||student), 1 reverse KL."},
    )
    max_new_tokens: int = field(default=128, metadata={"help": "Maximum number of tokens generated per completion."})
    teacher_model_name_or_path: str | None = field(
        default=None, metadata={"help": "Teacher path or hub id, used when no teacher model is passed."}
    )
    teacher_model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "Keyword arguments for `from_pretrained` when the teacher is a string (dict or JSON string)."
        },
    )
    disable_dropout: bool = field(default=True, metadata={"help": "Disable dropout in the student and the teacher."})
    seq_kd: bool = field(
        default=False, metadata={"help": "Sequence-level KD: train on teacher-generated completions."}
    )

    def __post_init__(self):
        super().__post_init__()
        check_distillation_ranges(self.lmbda, self.beta, self.temperature, "max_new_tokens", self.max_new_tokens)


def check_distillation_ranges(lmbda: float, beta: float, temperature: float, length_name: str, length: int) -> None:
    """Range checks shared by the GKD and GOLD configs."""
    if not 0.0 <= lmbda <= 1.0:
        raise ValueError(f"lmbda must be in the range [0.0, 1.0]. Got {lmbda}.")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in the range [0.0, 1.0]. Got {beta}.")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (it divides the logits), got {temperature}.")
    if length < 1:
        raise ValueError(f"{length_name} must be a positive number of tokens, got {length}.")
