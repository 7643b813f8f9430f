"""Model-loading options shared by the TRL command-line scripts (`trl sft`, `trl dpo`, ...)."""

from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    """How a script loads its model, and whether it wraps it in LoRA adapters or quantizes it.

    This is a plain dataclass (not a `TrainingArguments`), parsed next to the trainer config by [`TrlParser`]. The
    LoRA fields are turned into a `peft.LoraConfig` by [`get_peft_config`] and the quantization fields into a
    `transformers.BitsAndBytesConfig` by [`get_quantization_config`].

    It has no `trust_remote_code` field: that option belongs to the training configs (`SFTConfig`, `DPOConfig`, ...),
    so that `HfArgumentParser((ScriptArguments, SFTConfig, ModelConfig))` defines `--trust_remote_code` once. The
    scripts pass `training_args.trust_remote_code` to model and processor loading.

    Args:
        model_name_or_path (`str` or `None`, defaults to `None`):
            Hub id or local directory of the model to train.
        model_revision (`str`, defaults to `"main"`):
            Branch, tag or commit of the model to load.
        dtype (`str` or `None`, defaults to `"float32"`):
            Precision the weights are loaded in: `"auto"`, `"bfloat16"`, `"float16"` or `"float32"`.
        attn_implementation (`str` or `None`, defaults to `None`):
            Attention kernel, for example `"sdpa"`, `"eager"` or `"flash_attention_2"`. `None` lets transformers pick.
        use_peft (`bool`, defaults to `False`):
            Train LoRA adapters instead of the full model.
        lora_r (`int`, defaults to `16`):
            Rank of the LoRA update matrices.
        lora_alpha (`int`, defaults to `32`):
            LoRA scaling numerator (the update is scaled by `lora_alpha / lora_r`).
        lora_dropout (`float`, defaults to `0.05`):
            Dropout applied to the LoRA input.
        lora_target_modules (`list[str]` or `None`, defaults to `None`):
            Module names to adapt. A single entry is unwrapped to a string, so `--lora_target_modules all-linear`
            selects every linear layer.
        lora_target_parameters (`list[str]` or `None`, defaults to `None`):
            Parameter names to adapt directly (peft `target_parameters`).
        lora_modules_to_save (`list[str]` or `None`, defaults to `None`):
            Modules trained in full and saved next to the adapters (for example a freshly initialised score head).
        lora_task_type (`str`, defaults to `"CAUSAL_LM"`):
            peft task type; use `"SEQ_CLS"` for reward models.
        use_rslora (`bool`, defaults to `False`):
            Rank-stabilised LoRA: scale by `lora_alpha / sqrt(lora_r)`.
        use_dora (`bool`, defaults to `False`):
            Weight-decomposed LoRA (DoRA): learn magnitude and direction separately.
        load_in_8bit (`bool`, defaults to `False`):
            Load the base model in 8 bits with bitsandbytes. Cannot be combined with `load_in_4bit`.
        load_in_4bit (`bool`, defaults to `False`):
            Load the base model in 4 bits with bitsandbytes.
        bnb_4bit_quant_type (`str`, defaults to `"nf4"`):
            4-bit data type: `"nf4"` or `"fp4"`.
        use_bnb_nested_quant (`bool`, defaults to `False`):
            Quantize the quantization constants too (double quantization).
        bnb_4bit_quant_storage (`str` or `None`, defaults to `None`):
            dtype used to store the packed 4-bit weights.
    """

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Hub id or local directory of the model to train."}
    )
    model_revision: str = field(default="main", metadata={"help": "Branch, tag or commit of the model to load."})
    dtype: str | None = field(
        default="float32",
        metadata={
            "help": "Precision the weights are loaded in.",
            "choices": ["auto", "bfloat16", "float16", "float32"],
        },
    )
    attn_implementation: str | None = field(
        default=None,
        metadata={"help": "Attention kernel, e.g. `sdpa`, `eager` or `flash_attention_2` (None: transformers picks)."},
    )
    use_peft: bool = field(default=False, metadata={"help": "Train LoRA adapters instead of the full model."})
    lora_r: int = field(default=16, metadata={"help": "Rank of the LoRA update matrices."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scaling numerator (scale = lora_alpha / lora_r)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout applied to the LoRA input."})
    lora_target_modules: list[str] | None = field(
        default=None,
        metadata={"help": "Module names to adapt; a single value such as `all-linear` is passed as a string."},
    )
    lora_target_parameters: list[str] | None = field(
        default=None, metadata={"help": "Parameter names to adapt directly (peft `target_parameters`)."}
    )
    lora_modules_to_save: list[str] | None = field(
        default=None, metadata={"help": "Modules trained in full and saved with the adapters."}
    )
    lora_task_type: str = field(
        default="CAUSAL_LM", metadata={"help": "peft task type; use `SEQ_CLS` for reward models."}
    )
    use_rslora: bool = field(
        default=False, metadata={"help": "Rank-stabilised LoRA: scale by lora_alpha / sqrt(lora_r)."}
    )
    use_dora: bool = field(
        default=False, metadata={"help": "Weight-decomposed LoRA (DoRA): learn magnitude and direction separately."}
    )
    load_in_8bit: bool = field(
        default=False, metadata={"help": "Load the base model in 8 bits (bitsandbytes); exclusive with 4-bit."}
    )
    load_in_4bit: bool = field(default=False, metadata={"help": "Load the base model in 4 bits (bitsandbytes)."})
    bnb_4bit_quant_type: str = field(default="nf4", metadata={"help": "4-bit data type.", "choices": ["fp4", "nf4"]})
    use_bnb_nested_quant: bool = field(
        default=False, metadata={"help": "Quantize the quantization constants too (double quantization)."}
    )
    bnb_4bit_quant_storage: str | None = field(
        default=None, metadata={"help": "dtype used to store the packed 4-bit weights."}
    )

    def __post_init__(self):
        if self.load_in_8bit and self.load_in_4bit:
            raise ValueError(
                "ModelConfig got load_in_8bit=True and load_in_4bit=True; a model is quantized one way only. Set one "
                "of them to False."
            )
        # argparse always yields a list for `nargs="+"`; peft needs a bare string for keywords such as `all-linear`.
        if isinstance(self.lora_target_modules, list) and len(self.lora_target_modules) == 1:
            self.lora_target_modules = self.lora_target_modules[0]
