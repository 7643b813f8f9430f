"""Configuration of the Odds Ratio Preference Optimization (ORPO) trainer."""

from dataclasses import dataclass, field
from typing import Any

from ...trainer.base_config import _BaseConfig, warn_trl_trains_anyway


@dataclass
class ORPOConfig(_BaseConfig):
    r"""Configuration for [`experimental.orpo.ORPOTrainer`]: supervised fine-tuning plus an odds-ratio preference term.

    Only the fields TRL adds or whose default differs from [`~transformers.TrainingArguments`] are listed here; every
    other `TrainingArguments` field works as usual.

    Args:
        learning_rate (`float`, defaults to `1e-6`):
            Initial learning rate for AdamW (the parent default is `5e-5`).
        max_length (`int` or `None`, defaults to `1024`):
            Maximum length of prompt + completion, in tokens. Prompts are kept whole and completions are cut to the
            room left; pairs whose prompt alone reaches the limit are dropped (with a warning). `None` disables it.
            Not used for encoder-decoder models (see `max_completion_length`).
        max_completion_length (`int` or `None`, defaults to `None`):
            Number of tokens sampled per prompt by `generate_during_eval` (`None`: up to `max_length`). Training
            completions of decoder-only models are limited by `max_length` only, as in TRL; those of encoder-decoder
            models are cut to this length (128 when `None`).
        beta (`float`, defaults to `0.1`):
            Weight (lambda in the paper) of the odds-ratio term added to the NLL of the chosen sequences.
        disable_dropout (`bool`, defaults to `True`):
            Set every dropout probability of the trained model to zero.
        padding_value (`int` or `None`, defaults to `None`):
            Token id used to pad `input_ids`; `None` uses the tokenizer's pad token.
        generate_during_eval (`bool`, defaults to `False`):
            At every evaluation, sample completions for a batch of evaluation prompts and log them as a table to
            Weights & Biases or Comet (one of them must be installed and in `report_to`).
        is_encoder_decoder (`bool` or `None`, defaults to `None`):
            Declares whether the model (e.g. the one built by `model_init`) is an encoder-decoder model; `None`
            reads it from the model's config. Encoder-decoder models get the prompt as encoder input and the
            completions as decoder labels; a declaration contradicting the model's config is an error.
        model_init_kwargs (`dict[str, Any]`, `str` or `None`, defaults to `None`):
            Keyword arguments for `AutoModelForCausalLM.from_pretrained` (`AutoModelForSeq2SeqLM` for an
            encoder-decoder checkpoint) when `model` is a string (a dict, or a JSON string on the command line). A
            string `dtype` is turned into the `torch.dtype`; `"auto"` is kept.
        trust_remote_code (`bool`, defaults to `False`):
            Allow custom modelling code from the model repository when the trainer loads the model or processor.
        dataset_num_proc (`int` or `None`, defaults to `None`):
            Processes used by `Dataset.map` during preparation.
    """

    _VALID_DICT_FIELDS = _BaseConfig._VALID_DICT_FIELDS + ["model_init_kwargs"]

    learning_rate: float = field(default=1e-6, metadata={"help": "Initial learning rate for AdamW."})
    max_length: int | None = field(
        default=1024, metadata={"help": "Maximum length of prompt + completion in tokens. None disables it."}
    )
    max_completion_length: int | None = field(
        default=None, metadata={"help": "Tokens sampled per prompt by generate_during_eval. None: up to max_length."}
    )
    beta: float = field(default=0.1, metadata={"help": "Weight (lambda) of the odds-ratio term."})
    disable_dropout: bool = field(default=True, metadata={"help": "Disable dropout in the trained model."})
    padding_value: int | None = field(
        default=None, metadata={"help": "Token id used to pad input_ids. None: the tokenizer's pad token."}
    )
    generate_during_eval: bool = field(
        default=False,
        metadata={"help": "Sample completions at evaluation and log them to Weights & Biases / Comet."},
    )
    is_encoder_decoder: bool | None = field(
        default=None, metadata={"help": "Whether the model from `model_init` is an encoder-decoder model."}
    )
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={"help": "Keyword arguments for `from_pretrained` when `model` is a string (dict or JSON string)."},
    )
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Allow custom modelling code from the model repository."}
    )
    dataset_num_proc: int | None = field(default=None, metadata={"help": "Processes used for dataset preparation."})

    def __post_init__(self):
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(
                f"max_length must be at least 2 (a prompt token and a completion token) or None; got "
                f"{self.max_length}."
            )
        if self.max_completion_length is not None and self.max_completion_length < 1:
            raise ValueError(f"max_completion_length must be positive or None; got {self.max_completion_length}.")
        if self.beta < 0:
            warn_trl_trains_anyway(
                f"beta={self.beta} is negative: beta weighs the odds-ratio term, which a negative value turns around.",
                "set beta >= 0 unless this is intended.",
                stacklevel=3,
            )
        super().__post_init__()
