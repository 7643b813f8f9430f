"""Configuration of the process reward model (PRM) trainer."""

from dataclasses import dataclass, field

from ...trainer.base_config import _BaseConfig


@dataclass
class PRMConfig(_BaseConfig):
    r"""Configuration for [`experimental.prm.PRMTrainer`]: training a process reward model on stepwise supervision.

    Only the fields TRL adds or whose default differs from [`~transformers.TrainingArguments`] are listed here; every
    other `TrainingArguments` field works as usual.

    Args:
        learning_rate (`float`, defaults to `1e-5`):
            Initial learning rate for AdamW (the parent default is `5e-5`).
        max_length (`int` or `None`, defaults to `1024`):
            Maximum length of the tokenized prompt plus steps; longer sequences are cut at the end. `None` disables
            this truncation.
        max_completion_length (`int` or `None`, defaults to `None`):
            Maximum length of the tokenized steps (all steps and separators together), applied before `max_length`.
            `None` disables it.
        disable_dropout (`bool`, defaults to `True`):
            Set every dropout probability of the model to zero.
        step_separator (`str`, defaults to `"\n"`):
            Text appended after every reasoning step. The label of a step is placed on the last token of its
            separator, so use the same separator when scoring steps at inference.
        train_on_last_step_only (`bool`, defaults to `False`):
            Only the label of the final step is trained; earlier steps get -100. Evaluation data always keeps every
            step's label.
        dataset_num_proc (`int` or `None`, defaults to `None`):
            Processes used by `Dataset.map` during preparation.
    """

    learning_rate: float = field(default=1e-5, metadata={"help": "Initial learning rate for AdamW."})
    max_length: int | None = field(
        default=1024, metadata={"help": "Maximum length of prompt plus steps (truncated at the end). None: no limit."}
    )
    max_completion_length: int | None = field(
        default=None, metadata={"help": "Maximum length of the steps, applied before max_length. None: no limit."}
    )
    disable_dropout: bool = field(default=True, metadata={"help": "Set every dropout probability to zero."})
    step_separator: str = field(
        default="\n", metadata={"help": "Text appended after each step; the step's label sits on its last token."}
    )
    train_on_last_step_only: bool = field(
        default=False, metadata={"help": "Train on the label of the final step only (evaluation keeps all steps)."}
    )
    dataset_num_proc: int | None = field(default=None, metadata={"help": "Processes used for dataset preparation."})

    def __post_init__(self):
        if not isinstance(self.step_separator, str) or self.step_separator == "":
            raise ValueError(
                f"step_separator must be a non-empty string (the label of each step is placed on its last token); "
                f"got {self.step_separator!r}."
            )
        for name in ("max_length", "max_completion_length"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be a positive integer or None; got {value}.")
        super().__post_init__()
