"""Configuration of the DPO trainer."""

import warnings
from dataclasses import dataclass, field
from typing import Any

from .base_config import _BaseConfig, warn_trl_trains_anyway


# Every loss the trainer implements, in the order of the documentation table.
DPO_LOSS_TYPES = (
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
)
F_DIVERGENCE_TYPES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")


@dataclass
class DPOConfig(_BaseConfig):
    r"""Configuration for [`DPOTrainer`]: Direct Preference Optimization and its variants on preference pairs.

    Only the fields TRL adds or whose default differs from [`~transformers.TrainingArguments`] are listed here; every
    other `TrainingArguments` field works as usual.

    Args:
        learning_rate (`float`, defaults to `1e-6`):
            Initial learning rate for AdamW (the parent default is `5e-5`).

        > Model

        model_init_kwargs (`dict[str, Any]`, `str` or `None`, defaults to `None`):
            Keyword arguments for `from_pretrained` when the trainer's `model` is a string (a dict, or a JSON string on
            the command line). Its `revision` is reused when loading the processing class.
        trust_remote_code (`bool`, defaults to `False`):
            Allow custom modelling code from the model repository when the trainer loads the model or processor.
        router_aux_loss_coef (`float` or `None`, defaults to `None`):
            Weight of the mixture-of-experts load-balancing loss added to the DPO loss. `None` uses the model config's
            value, `0.0` turns it off. Setting it on a model without a router is an error.
        disable_dropout (`bool`, defaults to `True`):
            Set every dropout probability of the trained model (and of the reference model) to zero, so the policy
            and reference log-probabilities are deterministic.
        model_adapter_name (`str` or `None`, defaults to `None`):
            With a PEFT model holding several adapters: the adapter to train.
        ref_adapter_name (`str` or `None`, defaults to `None`):
            With a PEFT model holding several adapters: the adapter that acts as the reference model. `None` uses the
            model with all adapters disabled as the reference.

        > Dataset preparation

        dataset_num_proc (`int` or `None`, defaults to `None`):
            Processes used by `Dataset.map` during preparation.
        max_length (`int` or `None`, defaults to `1024`):
            Maximum length of prompt + completion, in tokens. Longer sequences are truncated (see `truncation_mode`)
            and, with `keep_start`, pairs whose prompt alone reaches `max_length` are dropped. `None` disables it.
        truncation_mode (`str`, defaults to `"keep_start"`):
            Which side survives truncation: `"keep_start"` or `"keep_end"` (deprecated, removed in TRL 2.0).
        padding_free (`bool`, defaults to `False`):
            Put all the sequences of a batch into one row. The trainer already avoids padding on its own whenever the
            model's attention can handle packed sequences (several sequences per row with restarting `position_ids`);
            this option forces a single row, which pays off with variable-length attention kernels
            (FlashAttention). With an attention that cannot handle packed sequences it warns and uses padded batches.
        pad_to_multiple_of (`int`, `str` or `None`, defaults to `"auto"`):
            Pad batch lengths to a multiple of this value. `"auto"` means 128 on Neuron devices and `None` elsewhere.
        precompute_ref_log_probs (`bool`, defaults to `False`):
            Compute the reference log-probabilities of the whole training (and evaluation) dataset once, before
            training, store them as dataset columns and drop the reference model. Saves the reference forward pass
            at every step and the memory of a reference model.
        precompute_ref_batch_size (`int` or `None`, defaults to `None`):
            Batch size of that pre-pass. `None` uses `per_device_train_batch_size` (`per_device_eval_batch_size` for
            evaluation data).

        > Loss

        loss_type (`str` or `list[str]`, defaults to `["sigmoid"]`):
            Loss, or list of losses summed with `loss_weights`. One of `"sigmoid"` (DPO), `"hinge"` (RSO/SLiC),
            `"ipo"` (IPO, on per-token mean log-probs), `"exo_pair"` (EXO), `"nca_pair"` (NCA), `"robust"` (robust
            DPO), `"bco_pair"` (BCO), `"sppo_hard"` (SPPO), `"aot"` / `"aot_unpaired"` (AOT), `"apo_zero"` /
            `"apo_down"` (APO), `"discopop"` (DiscoPOP), `"sft"` (negative log-likelihood of the chosen completions, averaged over their tokens in the batch)
            and `"sigmoid_norm"` (DPO on per-token mean log-probs). A string is turned into a one-element list.
        loss_weights (`list[float]` or `None`, defaults to `None`):
            One weight per entry of `loss_type`. `None` gives every loss a weight of 1.0.
        ld_alpha (`float` or `None`, defaults to `None`):
            LD-DPO: tokens of the longer completion past the length of the shorter one count with this weight
            (in `[0, 1]`) in the sequence log-probability. `None` is plain DPO.
        f_divergence_type (`str`, defaults to `"reverse_kl"`):
            Divergence of f-DPO: `"reverse_kl"` (standard DPO), `"forward_kl"`, `"js_divergence"` or
            `"alpha_divergence"`. Other values than the default only work with the sigmoid, sigmoid_norm, hinge, ipo,
            exo_pair, robust, discopop and sft losses.
        f_alpha_divergence_coef (`float`, defaults to `0.5`):
            Coefficient of the alpha-divergence, in TRL's parametrisation: 1 is the reverse KL, 0 the forward KL.
        label_smoothing (`float`, defaults to `0.0`):
            Probability that a preference label is flipped, in `[0, 0.5)`, read by the `robust`, `aot` and
            `aot_unpaired` losses; the epsilon of EXO (`exo_pair` needs a value above 0). As in TRL 1.16, `sigmoid`
            and `sigmoid_norm` do not read it (a warning says so when it is set).
        beta (`float`, defaults to `0.1`):
            Strength of the implicit KL penalty towards the reference: higher stays closer to it. For `ipo` it is the
            regularisation parameter tau.
        use_weighting (`bool`, defaults to `False`):
            WPO: weight each pair by the (length-normalised, sharpness-adjusted) probability of its two completions
            under the current policy. Not available with `aot` / `aot_unpaired`.
        discopop_tau (`float`, defaults to `0.05`):
            Temperature of the `discopop` loss.
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

        > Deprecated

        pad_token (`str` or `None`, defaults to `None`):
            Deprecated: set `tokenizer.pad_token` yourself.
    """

    _VALID_DICT_FIELDS = _BaseConfig._VALID_DICT_FIELDS + ["model_init_kwargs"]

    learning_rate: float = field(default=1e-6, metadata={"help": "Initial learning rate for AdamW."})

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
    truncation_mode: str = field(
        default="keep_start",
        metadata={"help": "Which side survives truncation.", "choices": ["keep_end", "keep_start"]},
    )
    padding_free: bool = field(
        default=False,
        metadata={"help": "Put every sequence of a batch into a single row (best with FlashAttention)."},
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
    loss_type: list[str] = field(
        default_factory=lambda: ["sigmoid"],
        metadata={
            "help": "Loss type(s); several are summed with loss_weights.",
            "choices": [
                "sigmoid",
                "hinge",
                "ipo",
                "exo_pair",
                "nca_pair",
                "robust",
                "bco_pair",
                "sppo_hard",
                "aot",
                "aot_unpaired",
                "apo_zero",
                "apo_down",
                "discopop",
                "sft",
                "sigmoid_norm",
            ],
        },
    )
    loss_weights: list[float] | None = field(
        default=None, metadata={"help": "One weight per loss_type entry. None: all 1.0."}
    )
    ld_alpha: float | None = field(
        default=None,
        metadata={"help": "LD-DPO weight of the tokens past the shorter completion's length, in [0, 1]."},
    )
    f_divergence_type: str = field(
        default="reverse_kl",
        metadata={
            "help": "f-DPO divergence.",
            "choices": ["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"],
        },
    )
    f_alpha_divergence_coef: float = field(default=0.5, metadata={"help": "Alpha of the alpha-divergence."})
    label_smoothing: float = field(
        default=0.0, metadata={"help": "Label-flip probability (robust, aot; in [0, 0.5)); EXO epsilon."}
    )
    beta: float = field(default=0.1, metadata={"help": "Strength of the implicit KL to the reference (tau for ipo)."})
    use_weighting: bool = field(default=False, metadata={"help": "WPO pair weighting (not with aot losses)."})
    discopop_tau: float = field(default=0.05, metadata={"help": "Temperature of the discopop loss."})
    activation_offloading: bool = field(default=False, metadata={"help": "Offload activations to CPU memory."})

    # Reference model synchronisation
    sync_ref_model: bool = field(
        default=False, metadata={"help": "TR-DPO: periodically blend the policy into the reference model."}
    )
    ref_model_mixup_alpha: float = field(
        default=0.6, metadata={"help": "Blend weight: ref = alpha * policy + (1 - alpha) * ref."}
    )
    ref_model_sync_steps: int = field(default=512, metadata={"help": "Blend every this many steps."})

    # Deprecated
    pad_token: str | None = field(
        default=None, metadata={"help": "Deprecated: set `tokenizer.pad_token` on the processing class instead."}
    )

    # Multi-adapter PEFT
    model_adapter_name: str | None = field(
        default=None, metadata={"help": "PEFT adapter to train when the model holds several adapters."}
    )
    ref_adapter_name: str | None = field(
        default=None, metadata={"help": "PEFT adapter used as the reference. None: adapters disabled."}
    )

    def __post_init__(self):
        from .sft_config import _resolve_pad_to_multiple_of

        self.pad_to_multiple_of = _resolve_pad_to_multiple_of(self.pad_to_multiple_of)

        if isinstance(self.loss_type, str):
            self.loss_type = [self.loss_type]
        self.loss_type = list(self.loss_type)
        if not self.loss_type:
            raise ValueError(f"loss_type must name at least one loss out of {list(DPO_LOSS_TYPES)}; got [].")
        unknown = [name for name in self.loss_type if name not in DPO_LOSS_TYPES]
        if unknown:
            raise ValueError(
                f"Unknown loss type: {unknown[0]}. Should be one of {list(DPO_LOSS_TYPES)} (unknown loss_type "
                f"entries: {unknown})."
            )
        if self.loss_weights is not None:
            self.loss_weights = [float(weight) for weight in self.loss_weights]
            if len(self.loss_weights) != len(self.loss_type):
                raise ValueError(
                    "`loss_weights` must have the same length as `loss_type` when combining multiple losses. Got "
                    f"{len(self.loss_weights)} weights for {len(self.loss_type)} loss types. loss_type={self.loss_type}, "
                    f"loss_weights={self.loss_weights}: give one weight per loss, or leave loss_weights=None for "
                    "equal weights."
                )
        if self.f_divergence_type not in F_DIVERGENCE_TYPES:
            raise ValueError(
                f"Unknown f_divergence_type: {self.f_divergence_type}. f_divergence_type must be one of "
                f"{list(F_DIVERGENCE_TYPES)}."
            )
        from .utils.dataset_rows import check_truncation_mode

        check_truncation_mode(self.truncation_mode)
        if self.truncation_mode == "keep_end":
            warnings.warn(
                "truncation_mode='keep_end' is deprecated and will be removed in TRL 2.0; it can cut the start of a "
                "prompt and the chat template's header. Prefer 'keep_start'.",
                FutureWarning,
                stacklevel=3,
            )
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(
                f"max_length must be at least 2 (a prompt token and a completion token) or None; got "
                f"{self.max_length}."
            )
        if self.ld_alpha is not None and not 0.0 <= self.ld_alpha <= 1.0:
            warn_trl_trains_anyway(
                f"ld_alpha={self.ld_alpha} is outside [0, 1]: the weight of the log-probabilities past the shared "
                "length extrapolates instead of interpolating.",
                "use a value in [0, 1] or None unless this is intended.",
                stacklevel=3,
            )
        if self.precompute_ref_batch_size is not None and self.precompute_ref_batch_size < 1:
            raise ValueError(
                f"precompute_ref_batch_size must be a positive integer or None; got {self.precompute_ref_batch_size}."
            )
        if self.pad_token is not None:
            warnings.warn(
                "DPOConfig.pad_token is deprecated and will be removed in TRL 2.0: set `tokenizer.pad_token` on the "
                "processing class you pass to the trainer instead.",
                FutureWarning,
                stacklevel=3,
            )
        super().__post_init__()
