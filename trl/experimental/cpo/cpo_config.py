"""Configuration of the Contrastive Preference Optimization (CPO) trainer and its SimPO / AlphaPO variants."""

import warnings
from dataclasses import dataclass, field
from typing import Any

from ...trainer.base_config import _BaseConfig, warn_trl_trains_anyway


_CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo", "alphapo")


@dataclass
class CPOConfig(_BaseConfig):
    r"""Configuration for [`experimental.cpo.CPOTrainer`]: reference-free preference optimisation (CPO, SimPO, AlphaPO).

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
            Temperature of the preference loss: the implicit reward is `beta` times the (shaped) log-probability.
            For `loss_type="ipo"` it is the regularisation strength tau.
        label_smoothing (`float`, defaults to `0.0`):
            Probability that a preference label is flipped (conservative loss), used by `sigmoid` and `simpo`; in
            `[0, 0.5]`.
        loss_type (`str`, defaults to `"sigmoid"`):
            `"sigmoid"` (CPO), `"hinge"` (SLiC), `"ipo"`, `"simpo"` (SimPO: length-normalised, target margin
            `simpo_gamma`) or `"alphapo"` (AlphaPO: SimPO with reward shaping `alpha`). `"alphapo"` is stored as
            `"simpo"` with `cpo_alpha=0`, as in TRL.
        disable_dropout (`bool`, defaults to `True`):
            Set every dropout probability of the trained model to zero.
        cpo_alpha (`float`, defaults to `1.0`):
            Weight of the behaviour-cloning term (NLL of the chosen completions). `0` gives pure SimPO.
        simpo_gamma (`float`, defaults to `0.5`):
            Target reward margin of SimPO / AlphaPO.
        alpha (`float`, defaults to `0.0`):
            AlphaPO reward shape: the log-probability `l` becomes `(1 - exp(-alpha * l)) / alpha`; `0` keeps `l`.
            Applies to every loss type.
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
    beta: float = field(default=0.1, metadata={"help": "Temperature of the preference loss (tau for ipo)."})
    label_smoothing: float = field(
        default=0.0, metadata={"help": "Probability of a flipped preference label (sigmoid and simpo losses)."}
    )
    loss_type: str = field(
        default="sigmoid",
        metadata={"help": "Loss: sigmoid, hinge, ipo, simpo or alphapo.", "choices": list(_CPO_LOSS_TYPES)},
    )
    disable_dropout: bool = field(default=True, metadata={"help": "Disable dropout in the trained model."})
    cpo_alpha: float = field(default=1.0, metadata={"help": "Weight of the NLL (behaviour-cloning) term."})
    simpo_gamma: float = field(default=0.5, metadata={"help": "Target reward margin of SimPO / AlphaPO."})
    alpha: float = field(default=0.0, metadata={"help": "AlphaPO reward shape; 0 keeps the log-probability."})
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
        if self.loss_type not in _CPO_LOSS_TYPES:
            raise ValueError(
                f"Unknown loss type: {self.loss_type}. Should be one of {list(_CPO_LOSS_TYPES)}. For the DPO losses "
                "use trl.DPOTrainer."
            )
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(
                f"max_length must be at least 2 (a prompt token and a completion token) or None; got "
                f"{self.max_length}."
            )
        if self.max_completion_length is not None and self.max_completion_length < 1:
            raise ValueError(f"max_completion_length must be positive or None; got {self.max_completion_length}.")
        if not 0.0 <= self.label_smoothing <= 0.5:
            raise ValueError(
                f"label_smoothing is the probability of a flipped label and must be in [0, 0.5]; got "
                f"{self.label_smoothing}."
            )
        if self.beta == 0 and self.loss_type in ("ipo", "simpo", "alphapo"):
            raise ValueError(
                f"beta must not be 0 with loss_type={self.loss_type!r}: the loss divides by it (TRL fails with "
                "ZeroDivisionError). Set beta > 0."
            )
        if self.beta == 0:
            # TRL trains with it (a negative beta warns in the shared range checks).
            warn_trl_trains_anyway(
                f"beta=0 with loss_type={self.loss_type!r} switches the preference term off (its gradient is 0): only "
                "the NLL term trains.",
                "set beta > 0 unless this is intended.",
                stacklevel=3,
            )
        if self.loss_type == "alphapo":
            # AlphaPO is SimPO with shaped rewards and no behaviour-cloning term (TRL stores it this way).
            if self.cpo_alpha not in (0.0, 1.0):
                warnings.warn(
                    f"loss_type='alphapo' trains without the NLL term, so cpo_alpha={self.cpo_alpha} is replaced by 0. "
                    "Use loss_type='simpo' with alpha != 0 to keep an NLL term.",
                    UserWarning,
                    stacklevel=3,
                )
            self.loss_type = "simpo"
            self.cpo_alpha = 0.0
        super().__post_init__()
