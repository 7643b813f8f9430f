"""Configuration of the reward (outcome reward model) trainer."""

import warnings
from dataclasses import dataclass, field
from typing import Any

from .base_config import _BaseConfig, warn_trl_trains_anyway
from .sft_config import _resolve_pad_to_multiple_of


@dataclass
class RewardConfig(_BaseConfig):
    r"""Configuration for [`RewardTrainer`]: training an outcome reward model on pairwise preference data.

    Only the fields TRL adds or whose default differs from [`~transformers.TrainingArguments`] are listed here; every
    other `TrainingArguments` field works as usual.

    Args:
        learning_rate (`float`, defaults to `1e-4`):
            Initial learning rate for AdamW (the parent default is `5e-5`).

        > Model

        model_init_kwargs (`dict[str, Any]`, `str` or `None`, defaults to `None`):
            Keyword arguments for `AutoModelForSequenceClassification.from_pretrained` when the trainer's `model` is a
            string (a dict, or a JSON string on the command line). `num_labels` is always 1 and cannot be changed.
            Its `revision` is reused when loading the tokenizer.
        trust_remote_code (`bool`, defaults to `False`):
            Allow custom modelling code from the model repository when the trainer loads the model or tokenizer.
        chat_template_path (`str` or `None`, defaults to `None`):
            A tokenizer directory (or id) whose chat template is copied, or a `.jinja`/`.j2` file used as the template.
            Applied before conversational data is tokenized.
        disable_dropout (`bool`, defaults to `True`):
            Set every dropout probability of the model to zero, so the two rewards of a pair are computed by the
            same deterministic function.

        > Dataset preparation

        dataset_num_proc (`int` or `None`, defaults to `None`):
            Processes used by `Dataset.map` during preparation.
        eos_token (`str` or `None`, defaults to `None`):
            End-of-sequence token appended to standard (non-conversational) chosen and rejected texts. `None` uses the
            tokenizer's `eos_token`. Must exist in the vocabulary.
        max_length (`int` or `None`, defaults to `1024`):
            Pairs whose chosen or rejected sequence is longer than this many tokens are dropped (not truncated, since
            the reward is read at the last token); the count is logged. `None` keeps every pair.
        pad_to_multiple_of (`int`, `str` or `None`, defaults to `"auto"`):
            Pad batch lengths to a multiple of this value. `"auto"` means 128 on Neuron devices and `None` elsewhere.

        > Training

        center_rewards_coefficient (`float` or `None`, defaults to `None`):
            Weight of the auxiliary term `mean((r_chosen + r_rejected) ** 2)` that pulls rewards towards zero mean
            (Eisenstein et al., 2023; `1e-2` is a typical value). `None` disables it.
        activation_offloading (`bool`, defaults to `False`):
            Offload activations to CPU memory between the forward and backward passes.
        pad_token (`str` or `None`, defaults to `None`):
            Deprecated: set `tokenizer.pad_token` yourself. When given, used as the padding token.
    """

    _VALID_DICT_FIELDS = _BaseConfig._VALID_DICT_FIELDS + ["model_init_kwargs"]

    learning_rate: float = field(default=1e-4, metadata={"help": "Initial learning rate for AdamW."})

    # Model
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "Keyword arguments for `AutoModelForSequenceClassification.from_pretrained` when `model` is a "
            "string (dict or JSON string). num_labels is always 1."
        },
    )
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Allow custom modelling code from the model repository."}
    )
    chat_template_path: str | None = field(
        default=None,
        metadata={"help": "Tokenizer directory/id whose chat template is copied, or a .jinja/.j2 template file."},
    )
    disable_dropout: bool = field(default=True, metadata={"help": "Set every dropout probability to zero."})

    # Dataset preparation
    dataset_num_proc: int | None = field(default=None, metadata={"help": "Processes used for dataset preparation."})
    eos_token: str | None = field(
        default=None,
        metadata={"help": "End-of-sequence token appended to standard texts. None uses the tokenizer's eos_token."},
    )
    max_length: int | None = field(
        default=1024,
        metadata={"help": "Pairs with a chosen or rejected sequence longer than this are dropped. None keeps all."},
    )
    pad_to_multiple_of: int | str | None = field(
        default="auto",
        metadata={"help": "Pad lengths to a multiple of this value. 'auto': 128 on Neuron devices, else None."},
    )

    # Training
    center_rewards_coefficient: float | None = field(
        default=None,
        metadata={"help": "Weight of mean((r_chosen + r_rejected)^2), pulling rewards to zero mean. None: off."},
    )
    activation_offloading: bool = field(default=False, metadata={"help": "Offload activations to CPU memory."})
    pad_token: str | None = field(
        default=None, metadata={"help": "Deprecated: set `tokenizer.pad_token` on the tokenizer instead."}
    )

    def __post_init__(self):
        self.pad_to_multiple_of = _resolve_pad_to_multiple_of(self.pad_to_multiple_of)
        if self.max_length is not None and self.max_length <= 0:
            raise ValueError(f"max_length must be a positive integer or None; got {self.max_length}.")
        if self.center_rewards_coefficient is not None and self.center_rewards_coefficient < 0:
            warn_trl_trains_anyway(
                f"center_rewards_coefficient={self.center_rewards_coefficient} is negative: it would reward large "
                "rewards instead of centring them.",
                "use a value >= 0 or None unless this is intended.",
                stacklevel=3,
            )
        if self.pad_token is not None:
            warnings.warn(
                "RewardConfig.pad_token is deprecated and will be removed in TRL 2.0: set `tokenizer.pad_token` on the "
                "tokenizer you pass to the trainer instead.",
                FutureWarning,
                stacklevel=3,
            )
        super().__post_init__()
