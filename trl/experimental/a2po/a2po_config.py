"""Configuration of the A*-PO (A2PO) trainer."""

from dataclasses import dataclass, field
from typing import Any

from ...trainer.base_config import _BaseConfig


@dataclass
class A2POConfig(_BaseConfig):
    r"""Configuration for [`experimental.a2po.A2POTrainer`]: A*-PO, an offline estimate of the optimal value of each
    prompt followed by on-policy least-squares regression of the optimal advantage.

    Only the fields TRL adds or whose default differs from [`~transformers.TrainingArguments`] are listed here; every
    other `TrainingArguments` field works as usual (`learning_rate` keeps its `5e-5` default).

    Args:
        remove_unused_columns (`bool`, defaults to `False`):
            Kept `False`: the reward functions receive every dataset column.

        > Model

        model_init_kwargs (`dict[str, Any]`, `str` or `None`, defaults to `None`):
            Keyword arguments for `from_pretrained` when the trainer's `model` is a string (a dict, or a JSON string on
            the command line).
        trust_remote_code (`bool`, defaults to `False`):
            Allow custom modelling code from the model repository when the trainer loads the model or tokenizer.

        > Generation

        max_prompt_length (`int` or `None`, defaults to `512`):
            Maximum prompt length in tokens; longer prompts are cut by the tokenizer on its `truncation_side`
            (the end, by default). `None` disables truncation.
        max_completion_length (`int` or `None`, defaults to `256`):
            Maximum number of generated tokens per completion.
        temperature (`float`, defaults to `1.0`):
            Sampling temperature.
        top_p (`float`, defaults to `1.0`):
            Nucleus sampling probability mass.
        top_k (`int` or `None`, defaults to `None`):
            Top-k sampling; `None` disables it.

        > A*-PO

        num_value_samples (`int`, defaults to `8`):
            Completions sampled from the reference model per prompt to estimate the optimal value `V*(x)` (stage 1).
        beta1 (`float`, defaults to `0.5`):
            Temperature of the value estimate `V*(x) = beta1 * (logsumexp(r_i / beta1) - log N)`.
        filter_all_incorrect (`bool`, defaults to `True`):
            Drop training prompts none of whose value samples got a reward.
        beta2 (`float`, defaults to `0.001`):
            Weight of the policy/reference log-ratio in the regression `(beta2 * log(pi / pi_ref) - (r - V*))^2`.
        reward_weights (`list[float]` or `None`, defaults to `None`):
            Weights of the reward functions; `None` weighs each by `1.0`.
    """

    _VALID_DICT_FIELDS = _BaseConfig._VALID_DICT_FIELDS + ["model_init_kwargs"]

    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Keep every dataset column (the reward functions read them)."}
    )
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={"help": "Keyword arguments for `from_pretrained` when `model` is a string (dict or JSON string)."},
    )
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Allow custom modelling code from the model repository."}
    )
    max_prompt_length: int | None = field(
        default=512,
        metadata={
            "help": "Maximum prompt length in tokens (cut on the tokenizer's truncation side). None disables it."
        },
    )
    max_completion_length: int | None = field(
        default=256, metadata={"help": "Maximum number of generated tokens per completion."}
    )
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling probability mass."})
    top_k: int | None = field(default=None, metadata={"help": "Top-k sampling; None disables it."})
    num_value_samples: int = field(
        default=8, metadata={"help": "Reference samples per prompt for the optimal value estimate V*(x)."}
    )
    beta1: float = field(default=0.5, metadata={"help": "Temperature of the optimal value estimate."})
    filter_all_incorrect: bool = field(
        default=True, metadata={"help": "Drop training prompts whose value samples all got reward 0."}
    )
    beta2: float = field(default=0.001, metadata={"help": "Weight of the policy/reference log-ratio."})
    reward_weights: list[float] | None = field(
        default=None, metadata={"help": "Weights of the reward functions (None: all 1.0)."}
    )

    def __post_init__(self):
        if self.num_value_samples < 1:
            raise ValueError(f"num_value_samples must be at least 1; got {self.num_value_samples}.")
        if self.beta1 <= 0:
            raise ValueError(f"beta1 must be positive (V* divides the rewards by it); got {self.beta1}.")
        super().__post_init__()
