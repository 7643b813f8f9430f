"""Configuration of the SFT trainer."""

import warnings
from dataclasses import dataclass, field
from typing import Any

from .base_config import _BaseConfig


@dataclass
class SFTConfig(_BaseConfig):
    r"""Configuration for [`SFTTrainer`]: supervised fine-tuning on text, prompt-completion or chat data.

    Only the fields TRL adds or whose default differs from [`~transformers.TrainingArguments`] are listed here; every
    other `TrainingArguments` field works as usual.

    Args:
        learning_rate (`float`, defaults to `2e-5`):
            Initial learning rate for AdamW (the parent default is `5e-5`).

        > Model

        model_init_kwargs (`dict[str, Any]`, `str` or `None`, defaults to `None`):
            Keyword arguments for `from_pretrained` when the trainer's `model` is a string (a dict, or a JSON string on
            the command line). Its `revision` is reused when loading the processing class.
        trust_remote_code (`bool`, defaults to `False`):
            Allow custom modelling code from the model repository when the trainer loads the model or processor.
        router_aux_loss_coef (`float` or `None`, defaults to `None`):
            Weight of the mixture-of-experts load-balancing loss. `None` uses the model config's value, `0.0` turns
            it off. Setting it on a model without a router is an error.
        chat_template_path (`str` or `None`, defaults to `None`):
            A tokenizer directory (or id) whose chat template is copied, or a `.jinja`/`.j2` file used as the template.

        > Dataset preparation

        dataset_text_field (`str`, defaults to `"text"`):
            Column holding raw text for language-modeling datasets.
        dataset_kwargs (`dict[str, Any]`, `str` or `None`, defaults to `None`):
            Dataset preparation options. The only supported key is `skip_prepare_dataset` (bool).
        dataset_num_proc (`int` or `None`, defaults to `None`):
            Processes used by `Dataset.map` during preparation.
        eos_token (`str` or `None`, defaults to `None`):
            End-of-turn token appended to non-conversational text and completions. `None` uses the processing class's
            `eos_token`. Must exist in the vocabulary.
        max_length (`int` or `None`, defaults to `1024`):
            Sequences longer than this are truncated (and the count is logged). Also the block length when packing.
            `None` disables truncation.
        truncation_mode (`str`, defaults to `"keep_start"`):
            Which side survives truncation: `"keep_start"` or `"keep_end"` (deprecated).
        shuffle_dataset (`bool`, defaults to `False`):
            Shuffle the training dataset after preparation.
        packing (`bool`, defaults to `False`):
            Pack several sequences into each `max_length` row.
        packing_strategy (`str`, defaults to `"bfd"`):
            `"bfd"` (best-fit decreasing, over-long sequences truncated), `"bfd_split"` (over-long sequences split
            into several pieces) or `"wrapped"` (concatenate everything and cut into blocks, crossing sequence
            boundaries). `"bfd-requeue"` is a deprecated alias of `"bfd_split"`.
        padding_free (`bool`, defaults to `False`):
            Concatenate each batch into a single row with `position_ids` restarting at every sequence, so no compute
            is spent on padding and sequences never attend to each other. Implied by `packing` with a bfd strategy.
        pad_to_multiple_of (`int`, `str` or `None`, defaults to `"auto"`):
            Pad batch lengths to a multiple of this value. `"auto"` means 128 on Neuron devices and `None` elsewhere.
        eval_packing (`bool` or `None`, defaults to `None`):
            Pack the evaluation set too. `None` follows `packing`.

        > Training

        completion_only_loss (`bool` or `None`, defaults to `None`):
            Compute the loss on completion tokens only. `None` means yes for prompt-completion data and the whole
            sequence for language-modeling data. `True` requires prompt-completion data.
        assistant_only_loss (`bool`, defaults to `False`):
            Compute the loss on assistant turns only (conversational data whose chat template has
            `{% generation %}` markers; see `get_training_chat_template`).
        loss_type (`str`, defaults to `"nll"`):
            `"nll"` (token-level cross-entropy) or `"dft"` (Dynamic Fine-Tuning: cross-entropy weighted by the detached
            probability of the target token). `"chunked_nll"` is a deprecated alias of `"nll"`.
        activation_offloading (`bool`, defaults to `False`):
            Offload activations to CPU memory between the forward and backward passes.
        pad_token (`str` or `None`, defaults to `None`):
            Deprecated: set `tokenizer.pad_token` yourself.
    """

    _VALID_DICT_FIELDS = _BaseConfig._VALID_DICT_FIELDS + ["model_init_kwargs", "dataset_kwargs"]

    learning_rate: float = field(default=2e-5, metadata={"help": "Initial learning rate for AdamW."})

    # Model
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={"help": "Keyword arguments for `from_pretrained` when `model` is a string (dict or JSON string)."},
    )
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Allow custom modelling code from the model repository."}
    )
    router_aux_loss_coef: float | None = field(
        default=None,
        metadata={"help": "Weight of the MoE load-balancing loss. None: model config value; 0.0 disables it."},
    )
    chat_template_path: str | None = field(
        default=None,
        metadata={"help": "Tokenizer directory/id whose chat template is copied, or a .jinja/.j2 template file."},
    )

    # Dataset preparation
    dataset_text_field: str = field(default="text", metadata={"help": "Column holding raw text."})
    dataset_kwargs: dict[str, Any] | str | None = field(
        default=None, metadata={"help": "Dataset preparation options; only `skip_prepare_dataset` is supported."}
    )
    dataset_num_proc: int | None = field(default=None, metadata={"help": "Processes used for dataset preparation."})
    eos_token: str | None = field(
        default=None, metadata={"help": "End-of-turn token. None uses the processing class's eos_token."}
    )
    max_length: int | None = field(
        default=1024, metadata={"help": "Maximum tokenized length (truncation and pack length). None disables it."}
    )
    truncation_mode: str = field(
        default="keep_start",
        metadata={"help": "Which side survives truncation.", "choices": ["keep_end", "keep_start"]},
    )
    shuffle_dataset: bool = field(default=False, metadata={"help": "Shuffle the training dataset."})
    packing: bool = field(default=False, metadata={"help": "Pack several sequences into each max_length row."})
    packing_strategy: str = field(
        default="bfd",
        metadata={"help": "Packing strategy.", "choices": ["bfd", "bfd_split", "wrapped", "bfd-requeue"]},
    )
    padding_free: bool = field(
        default=False,
        metadata={"help": "Flatten each batch into one row with position_ids (no padding, no cross-attention)."},
    )
    pad_to_multiple_of: int | str | None = field(
        default="auto",
        metadata={"help": "Pad lengths to a multiple of this value. 'auto': 128 on Neuron devices, else None."},
    )
    eval_packing: bool | None = field(default=None, metadata={"help": "Pack the eval set. None follows `packing`."})

    # Training
    completion_only_loss: bool | None = field(
        default=None,
        metadata={"help": "Loss on completion tokens only. None: yes for prompt-completion data, no otherwise."},
    )
    assistant_only_loss: bool = field(default=False, metadata={"help": "Loss on assistant turns only."})
    loss_type: str = field(
        default="nll",
        metadata={
            "help": "Loss: 'nll' or 'dft' ('chunked_nll' is deprecated).",
            "choices": ["nll", "dft", "chunked_nll"],
        },
    )
    activation_offloading: bool = field(default=False, metadata={"help": "Offload activations to CPU memory."})
    pad_token: str | None = field(
        default=None, metadata={"help": "Deprecated: set `tokenizer.pad_token` on the processing class instead."}
    )

    def __post_init__(self):
        self.pad_to_multiple_of = _resolve_pad_to_multiple_of(self.pad_to_multiple_of)

        if self.loss_type == "chunked_nll":
            warnings.warn(
                "loss_type='chunked_nll' is deprecated and now the same as 'nll' (the loss is always computed without "
                "a full-vocabulary pass over padding). Use loss_type='nll'.",
                FutureWarning,
                stacklevel=3,
            )
            self.loss_type = "nll"
        if self.loss_type not in ("nll", "dft"):
            raise ValueError(
                f"Invalid `loss_type` {self.loss_type} passed. Supported values are 'nll' and 'dft'. Set "
                "loss_type='nll' (cross-entropy) or 'dft' (dynamic fine-tuning)."
            )

        if self.packing_strategy == "bfd-requeue":
            warnings.warn(
                "packing_strategy='bfd-requeue' is deprecated; use the equivalent packing_strategy='bfd_split'.",
                FutureWarning,
                stacklevel=3,
            )
            self.packing_strategy = "bfd_split"
        from .._data.packing import check_packing_strategy

        check_packing_strategy(self.packing_strategy)
        from .utils.dataset_rows import check_truncation_mode

        check_truncation_mode(self.truncation_mode)
        if self.truncation_mode == "keep_end":
            warnings.warn(
                "truncation_mode='keep_end' is deprecated and will be removed in TRL 2.0; it can cut the start of a "
                "prompt and the chat template's header. Prefer 'keep_start'.",
                FutureWarning,
                stacklevel=3,
            )
        if self.pad_token is not None:
            warnings.warn(
                "SFTConfig.pad_token is deprecated and will be removed in TRL 2.0: set `tokenizer.pad_token` on the "
                "processing class you pass to the trainer instead.",
                FutureWarning,
                stacklevel=3,
            )
        if self.max_length is not None and self.max_length <= 0:
            raise ValueError(f"max_length must be a positive integer or None; got {self.max_length}.")
        super().__post_init__()


def _resolve_pad_to_multiple_of(value: int | str | None) -> int | None:
    """Turn the `pad_to_multiple_of` option into an int or None ('auto' -> 128 on Neuron devices, else None)."""
    if value is None or isinstance(value, int):
        return value
    text = str(value).strip().lower()
    if text in ("none", "null", ""):
        return None
    if text == "auto":
        try:
            from transformers.utils import is_torch_neuroncore_available

            return 128 if is_torch_neuroncore_available() else None
        except ImportError:
            return None
    if text.isdigit():
        return int(text)
    raise ValueError(
        f"invalid literal for int() with base 10: {value!r}. pad_to_multiple_of must be an int, 'auto', 'none' or "
        "None."
    )
