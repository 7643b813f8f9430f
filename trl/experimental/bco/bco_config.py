"""Configuration of the Binary Classifier Optimization (BCO) trainer."""

from dataclasses import dataclass, field
from typing import Any

from ...trainer.base_config import _BaseConfig


@dataclass
class BCOConfig(_BaseConfig):
    r"""Configuration for [`experimental.bco.BCOTrainer`]: Binary Classifier Optimization on unpaired data.

    Only the fields TRL adds or whose default differs from [`~transformers.TrainingArguments`] are listed here; every
    other `TrainingArguments` field works as usual.

    Args:
        learning_rate (`float`, defaults to `5e-7`):
            Initial learning rate for AdamW (the parent default is `5e-5`).
        max_length (`int` or `None`, defaults to `1024`):
            Maximum length of prompt + completion, in tokens; longer sequences are cut at the end, and examples whose
            prompt alone reaches it are dropped. `None` disables truncation.
        max_completion_length (`int` or `None`, defaults to `None`):
            Maximum length of a completion, in tokens: longer completions are cut before `max_length` applies, and
            completions generated during evaluation (`generate_during_eval`) stop there. `None` means no limit of its
            own (generation then stops at `max_length`).
        beta (`float`, defaults to `0.1`):
            Strength of the implicit KL penalty towards the reference: higher stays closer to it. The implied reward
            is `beta * log(pi / pi_ref)`.
        disable_dropout (`bool`, defaults to `True`):
            Set every dropout probability of the trained model (and of the reference model) to zero.
        generate_during_eval (`bool`, defaults to `False`):
            At every evaluation, sample completions from the model and from the reference model for a batch of
            evaluation prompts and log them as a table to Weights & Biases or Comet (one of them must be installed and
            in `report_to`).
        is_encoder_decoder (`bool` or `None`, defaults to `None`):
            Declares whether the model built by `model_init` is an encoder-decoder model; `None` reads it from the
            model's config. This trainer supports decoder-only causal language models.
        precompute_ref_log_probs (`bool`, defaults to `False`):
            Compute the reference log-probabilities of the whole training (and evaluation) dataset once, before
            training, store them as dataset columns and drop the reference model.
        model_init_kwargs (`dict[str, Any]`, `str` or `None`, defaults to `None`):
            Keyword arguments for `AutoModelForCausalLM.from_pretrained` when `model` (or `ref_model`) is a string (a
            dict, or a JSON string on the command line). A string `dtype` is turned into the `torch.dtype`; `"auto"` is
            kept.
        trust_remote_code (`bool`, defaults to `False`):
            Allow custom modelling code from the model repository when the trainer loads the model or processor.
        dataset_num_proc (`int` or `None`, defaults to `None`):
            Processes used by `Dataset.map` during preparation.
        prompt_sample_size (`int`, defaults to `1024`):
            Underlying distribution matching (UDM): number of desirable and of undesirable prompts (each, at most the
            number available) embedded to fit the density-ratio classifier.
        min_density_ratio (`float`, defaults to `0.5`):
            UDM: lower clamp of the estimated density ratio used as the weight of undesirable examples.
        max_density_ratio (`float`, defaults to `10.0`):
            UDM: upper clamp of that density ratio.
    """

    _VALID_DICT_FIELDS = _BaseConfig._VALID_DICT_FIELDS + ["model_init_kwargs"]

    learning_rate: float = field(default=5e-7, metadata={"help": "Initial learning rate for AdamW."})
    max_length: int | None = field(
        default=1024, metadata={"help": "Maximum length of prompt + completion in tokens. None disables it."}
    )
    max_completion_length: int | None = field(
        default=None, metadata={"help": "Maximum completion length in tokens (also for generation). None: no limit."}
    )
    beta: float = field(default=0.1, metadata={"help": "Strength of the implicit KL to the reference."})
    disable_dropout: bool = field(
        default=True, metadata={"help": "Disable dropout in the trained model and the reference model."}
    )
    generate_during_eval: bool = field(
        default=False,
        metadata={"help": "Sample completions from the model and the reference at evaluation; log them to W&B/Comet."},
    )
    is_encoder_decoder: bool | None = field(
        default=None, metadata={"help": "Whether the model from `model_init` is an encoder-decoder model."}
    )
    precompute_ref_log_probs: bool = field(
        default=False,
        metadata={"help": "Compute reference log-probs for the whole dataset before training (no reference model)."},
    )
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={"help": "Keyword arguments for `from_pretrained` when `model` is a string (dict or JSON string)."},
    )
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Allow custom modelling code from the model repository."}
    )
    dataset_num_proc: int | None = field(default=None, metadata={"help": "Processes used for dataset preparation."})
    prompt_sample_size: int = field(
        default=1024, metadata={"help": "UDM: desirable and undesirable prompts each fed to the density classifier."}
    )
    min_density_ratio: float = field(default=0.5, metadata={"help": "UDM: lower clamp of the density ratio."})
    max_density_ratio: float = field(default=10.0, metadata={"help": "UDM: upper clamp of the density ratio."})

    def __post_init__(self):
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(
                f"max_length must be at least 2 (a prompt token and a completion token) or None; got "
                f"{self.max_length}."
            )
        if self.max_completion_length is not None and self.max_completion_length < 1:
            raise ValueError(f"max_completion_length must be positive or None; got {self.max_completion_length}.")
        if self.prompt_sample_size < 1:
            raise ValueError(f"prompt_sample_size must be a positive integer; got {self.prompt_sample_size}.")
        if not 0 < self.min_density_ratio <= self.max_density_ratio:
            raise ValueError(
                "The density-ratio clamp needs 0 < min_density_ratio <= max_density_ratio; got "
                f"min_density_ratio={self.min_density_ratio} and max_density_ratio={self.max_density_ratio}."
            )
        super().__post_init__()
