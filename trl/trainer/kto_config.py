"""Configuration of the KTO trainer."""

from dataclasses import dataclass, field
from typing import Any

from .base_config import _BaseConfig, warn_trl_trains_anyway


KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")


@dataclass
class KTOConfig(_BaseConfig):
    r"""Configuration for [`KTOTrainer`]: Kahneman-Tversky Optimization on unpaired desirable / undesirable data.

    Only the fields TRL adds or whose default differs from [`~transformers.TrainingArguments`] are listed here; every
    other `TrainingArguments` field works as usual.

    Args:
        learning_rate (`float`, defaults to `1e-6`):
            Initial learning rate for AdamW (the parent default is `5e-5`). KTO is sensitive to it: keep it between
            `5e-7` and `5e-6`, and lower it together with `beta`.
        train_sampling_strategy (`str`, defaults to `"sequential"`):
            Order in which training examples are drawn (the parent default is `"random"`). The trainer fixes the
            mismatched "KL" completion of every example once, from its neighbours in a batch-sized chunk of the
            prepared dataset; reading the data in order keeps those neighbours in the same batch, so `loss_type="kto"`
            refuses any other strategy (as TRL does). Shuffle your dataset beforehand if it is sorted (for example by
            label).

        > Model

        model_init_kwargs (`dict[str, Any]`, `str` or `None`, defaults to `None`):
            Keyword arguments for `from_pretrained` when the trainer's `model` is a string (a dict, or a JSON string on
            the command line). Its `revision` is reused when loading the processing class.
        trust_remote_code (`bool`, defaults to `False`):
            Allow custom modelling code from the model repository when the trainer loads the model or processor.
        router_aux_loss_coef (`float` or `None`, defaults to `None`):
            Weight of the mixture-of-experts load-balancing loss added to the KTO loss. `None` uses the model config's
            value when the config sets `output_router_logits=True`, `0.0` turns it off. Setting it on a model without
            a router is an error.
        disable_dropout (`bool`, defaults to `True`):
            Set every dropout probability of the trained model (and of the reference model) to zero, so the policy
            and reference log-probabilities are deterministic.

        > Dataset preparation

        dataset_num_proc (`int` or `None`, defaults to `None`):
            Processes used by `Dataset.map` during preparation.
        max_length (`int` or `None`, defaults to `1024`):
            Maximum length of prompt + completion, in tokens; longer sequences are cut at the end. Examples whose
            prompt alone reaches `max_length` are dropped. `None` disables truncation.
        pad_to_multiple_of (`int`, `str` or `None`, defaults to `"auto"`):
            Pad batch lengths to a multiple of this value. `"auto"` means 128 on Neuron devices and `None` elsewhere.
        precompute_ref_log_probs (`bool`, defaults to `False`):
            Compute the reference log-probabilities of the whole training (and evaluation) dataset once, before
            training, including those of the KL completions, store them as dataset columns and drop the reference
            model. Saves the reference forward pass at every step and the memory of a reference model.
        precompute_ref_batch_size (`int` or `None`, defaults to `None`):
            Batch size of that pre-pass. `None` uses `per_device_train_batch_size` (`per_device_eval_batch_size` for
            evaluation data).

        > Loss

        loss_type (`str`, defaults to `"kto"`):
            `"kto"`: the KTO loss, whose reference point is the policy-to-reference KL estimated on mismatched
            prompt/completion pairs of the batch. `"apo_zero_unpaired"`: the unpaired APO-zero loss (raise the
            likelihood of desirable completions, lower that of undesirable ones; no KL term).
        beta (`float`, defaults to `0.1`):
            Strength of the implicit KL penalty towards the reference: higher stays closer to it.
        desirable_weight (`float`, defaults to `1.0`):
            Weight of the losses of desirable (`label=True`) examples.
        undesirable_weight (`float`, defaults to `1.0`):
            Weight of the losses of undesirable (`label=False`) examples. With unbalanced data, pick the weights so
            that `desirable_weight * #desirable` to `undesirable_weight * #undesirable` lies between 1:1 and 4:3.
        activation_offloading (`bool`, defaults to `False`):
            Offload activations to CPU memory between the forward and backward passes.

        > Reference model synchronisation (TR-DPO)

        sync_ref_model (`bool`, defaults to `False`):
            Periodically blend the policy into the reference model. Needs a separate reference model (not with a
            PEFT reference or precomputed reference log-probs).
        ref_model_mixup_alpha (`float`, defaults to `0.6`):
            Blend weight: `ref = alpha * policy + (1 - alpha) * ref`.
        ref_model_sync_steps (`int`, defaults to `512`):
            Blend every this many optimisation steps.
    """

    _VALID_DICT_FIELDS = _BaseConfig._VALID_DICT_FIELDS + ["model_init_kwargs"]

    learning_rate: float = field(default=1e-6, metadata={"help": "Initial learning rate for AdamW."})
    train_sampling_strategy: str = field(
        default="sequential",
        metadata={
            "help": "Sampler for training; the KL completions are fixed per batch-sized chunk of the data, so "
            "'sequential' keeps them inside the batch.",
            "choices": ["random", "sequential", "group_by_length"],
        },
    )

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
    disable_dropout: bool = field(
        default=True, metadata={"help": "Disable dropout in the trained model and the reference model."}
    )

    # Dataset preparation
    dataset_num_proc: int | None = field(default=None, metadata={"help": "Processes used for dataset preparation."})
    max_length: int | None = field(
        default=1024, metadata={"help": "Maximum length of prompt + completion in tokens. None disables it."}
    )
    pad_to_multiple_of: int | str | None = field(
        default="auto",
        metadata={"help": "Pad lengths to a multiple of this value. 'auto': 128 on Neuron devices, else None."},
    )
    precompute_ref_log_probs: bool = field(
        default=False,
        metadata={"help": "Compute reference log-probs for the whole dataset before training (no reference model)."},
    )
    precompute_ref_batch_size: int | None = field(
        default=None,
        metadata={"help": "Batch size of the reference pre-pass. None: per_device_train/eval_batch_size."},
    )

    # Loss
    loss_type: str = field(
        default="kto",
        metadata={"help": "Loss: 'kto' or 'apo_zero_unpaired'.", "choices": list(KTO_LOSS_TYPES)},
    )
    beta: float = field(default=0.1, metadata={"help": "Strength of the implicit KL to the reference."})
    desirable_weight: float = field(default=1.0, metadata={"help": "Weight of the desirable (label=True) losses."})
    undesirable_weight: float = field(
        default=1.0, metadata={"help": "Weight of the undesirable (label=False) losses."}
    )
    activation_offloading: bool = field(default=False, metadata={"help": "Offload activations to CPU memory."})

    # Reference model synchronisation
    sync_ref_model: bool = field(
        default=False, metadata={"help": "TR-DPO: periodically blend the policy into the reference model."}
    )
    ref_model_mixup_alpha: float = field(
        default=0.6, metadata={"help": "Blend weight: ref = alpha * policy + (1 - alpha) * ref."}
    )
    ref_model_sync_steps: int = field(default=512, metadata={"help": "Blend every this many steps."})

    def __post_init__(self):
        from .sft_config import _resolve_pad_to_multiple_of

        self.pad_to_multiple_of = _resolve_pad_to_multiple_of(self.pad_to_multiple_of)
        if self.loss_type not in KTO_LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {list(KTO_LOSS_TYPES)}; got {self.loss_type!r}.")
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(
                f"max_length must be at least 2 (a prompt token and a completion token) or None; got "
                f"{self.max_length}."
            )
        if self.desirable_weight < 0 or self.undesirable_weight < 0:
            warn_trl_trains_anyway(
                f"desirable_weight={self.desirable_weight} / undesirable_weight={self.undesirable_weight}: a negative "
                "weight turns that part of the loss around (the model is pushed away from what the label asks).",
                "use weights >= 0 unless this is intended.",
                stacklevel=3,
            )
        if self.precompute_ref_batch_size is not None and self.precompute_ref_batch_size < 1:
            raise ValueError(
                f"precompute_ref_batch_size must be a positive integer or None; got {self.precompute_ref_batch_size}."
            )
        super().__post_init__()
