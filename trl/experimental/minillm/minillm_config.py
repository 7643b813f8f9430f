"""Configuration of the MiniLLM trainer."""

from dataclasses import dataclass, field
from typing import Any

from ...trainer.grpo_config import GRPOConfig


@dataclass
class MiniLLMConfig(GRPOConfig):
    r"""Configuration for [`experimental.minillm.MiniLLMTrainer`]: GRPO whose advantages add the reverse KL to a
    teacher, plus the single-step decomposition of that KL (MiniLLM).

    Only the fields added to [`GRPOConfig`] (or whose default differs) are listed.

    Args:
        disable_dropout (`bool`, defaults to `True`):
            Zero dropout in the student and the teacher (GRPO: `False`).
        teacher_model_init_kwargs (`dict[str, Any]`, `str` or `None`, defaults to `None`):
            Keyword arguments for `from_pretrained` when `teacher_model` is a string.
        rkl_advantage (`bool`, defaults to `True`):
            Add the per-token reverse-KL advantage (teacher minus student log-probability, accumulated over the
            following tokens) to the reward advantage.
        single_step_decomposition (`bool`, defaults to `True`):
            Add the exact per-step KL `KL(student || teacher)` over the vocabulary, averaged over every position.
        kd_temperature (`float`, defaults to `1.0`):
            Distillation temperature.
        gamma (`float`, defaults to `0.0`):
            Discount of the accumulated reverse-KL advantage (`0`: each token's own term).
        length_normalization (`bool`, defaults to `True`):
            Divide the accumulated reverse-KL advantage by the accumulated discount weights.
    """

    _VALID_DICT_FIELDS = GRPOConfig._VALID_DICT_FIELDS + ["teacher_model_init_kwargs"]

    disable_dropout: bool = field(default=True, metadata={"help": "Zero dropout in the student and the teacher."})
    teacher_model_init_kwargs: dict[str, Any] | str | None = field(
        default=None, metadata={"help": "Keyword arguments for `from_pretrained` when `teacher_model` is a string."}
    )
    rkl_advantage: bool = field(default=True, metadata={"help": "Add the reverse-KL advantage."})
    single_step_decomposition: bool = field(default=True, metadata={"help": "Add the single-step KL term."})
    kd_temperature: float = field(default=1.0, metadata={"help": "Distillation temperature."})
    gamma: float = field(default=0.0, metadata={"help": "Discount of the reverse-KL advantage."})
    length_normalization: bool = field(default=True, metadata={"help": "Length-normalise the reverse-KL advantage."})
