"""Configuration of the Triple Preference Optimization (TPO) trainer."""

from dataclasses import dataclass, field
from typing import Any

from ...trainer.base_config import _BaseConfig


TPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "tpo-l")


@dataclass
class TPOConfig(_BaseConfig):
    r"""Configuration for [`experimental.tpo.TPOTrainer`]: preference optimisation on triples (chosen, rejected and a
    gold reference completion) without a reference model.

    Only the fields TRL adds or whose default differs from [`~transformers.TrainingArguments`] are listed here; every
    other `TrainingArguments` field works as usual.

    Args:
        learning_rate (`float`, defaults to `5e-7`):
            Initial learning rate for AdamW (the parent default is `5e-5`).

        > Model

        model_init_kwargs (`dict[str, Any]`, `str` or `None`, defaults to `None`):
            Keyword arguments for `from_pretrained` when the trainer's `model` is a string (a dict, or a JSON string on
            the command line).
        trust_remote_code (`bool`, defaults to `False`):
            Allow custom modelling code from the model repository when the trainer loads the model or processor.
        disable_dropout (`bool`, defaults to `True`):
            Set every dropout probability of the trained model to zero.

        > Data

        dataset_num_proc (`int` or `None`, defaults to `None`):
            Processes used by `Dataset.map` during preparation.
        max_length (`int` or `None`, defaults to `1024`):
            Maximum length of each `prompt + completion` sequence, in tokens (see `truncation_mode`). Triples whose
            chosen or rejected completion keeps no token after truncation are dropped. `None` disables it.
        truncation_mode (`str`, defaults to `"keep_start"`):
            `"keep_start"` keeps the first `max_length` tokens of a sequence, `"keep_end"` the last ones.
        pad_to_multiple_of (`int` or `None`, defaults to `None`):
            Pad the batch's sequence length to a multiple of this value.

        > Loss

        loss_type (`str`, defaults to `"sigmoid"`):
            Preference term: `"sigmoid"`, `"hinge"`, `"ipo"` or `"tpo-l"` (the sigmoid loss on length-normalised
            log-probabilities with a target margin `tpo_l_gamma`). `ipo` and `tpo-l` use per-token mean log-probs.
        beta (`float`, defaults to `0.01`):
            Temperature of the preference term; the implicit rewards are `beta` times the sequence log-probabilities.
        label_smoothing (`float`, defaults to `0.0`):
            Probability of a flipped preference label (`sigmoid` and `tpo-l`); ignored with a warning by `hinge` and
            `ipo`.
        tpo_alpha (`float`, defaults to `1.0`):
            Weight of the cross-entropy of the reference (gold) completions. `0` leaves the reference rows out of the
            batch entirely.
        tpo_l_gamma (`float`, defaults to `0.5`):
            Target reward margin of `tpo-l`.
    """

    _VALID_DICT_FIELDS = _BaseConfig._VALID_DICT_FIELDS + ["model_init_kwargs"]

    learning_rate: float = field(default=5e-7, metadata={"help": "Initial learning rate for AdamW."})
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={"help": "Keyword arguments for `from_pretrained` when `model` is a string (dict or JSON string)."},
    )
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Allow custom modelling code from the model repository."}
    )
    disable_dropout: bool = field(default=True, metadata={"help": "Disable dropout in the trained model."})
    dataset_num_proc: int | None = field(default=None, metadata={"help": "Processes used for dataset preparation."})
    max_length: int | None = field(
        default=1024, metadata={"help": "Maximum length of prompt + completion in tokens. None disables it."}
    )
    truncation_mode: str = field(
        default="keep_start",
        metadata={"help": "Which end of a too-long sequence to keep.", "choices": ["keep_end", "keep_start"]},
    )
    pad_to_multiple_of: int | None = field(
        default=None, metadata={"help": "Pad the sequence length to a multiple of this value."}
    )
    loss_type: str = field(
        default="sigmoid",
        metadata={"help": "Preference loss: sigmoid, hinge, ipo or tpo-l.", "choices": list(TPO_LOSS_TYPES)},
    )
    beta: float = field(default=0.01, metadata={"help": "Temperature of the preference loss."})
    label_smoothing: float = field(
        default=0.0, metadata={"help": "Probability of a flipped preference label (sigmoid and tpo-l)."}
    )
    tpo_alpha: float = field(default=1.0, metadata={"help": "Weight of the reference completions' cross-entropy."})
    tpo_l_gamma: float = field(default=0.5, metadata={"help": "Target reward margin of the tpo-l loss."})

    def __post_init__(self):
        if self.loss_type not in TPO_LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {list(TPO_LOSS_TYPES)}; got {self.loss_type!r}.")
        from ...trainer.utils.dataset_rows import check_truncation_mode

        check_truncation_mode(self.truncation_mode)
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(
                f"max_length must be at least 2 (a prompt token and a completion token) or None; got "
                f"{self.max_length}."
            )
        if self.loss_type in ("ipo", "tpo-l") and self.beta == 0:
            raise ValueError(f"loss_type={self.loss_type!r} divides by beta, which must not be 0.")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1); got {self.label_smoothing}.")
        super().__post_init__()
