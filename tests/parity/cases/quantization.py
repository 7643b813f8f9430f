"""Parity cases: bitsandbytes, for real on the CPU: QLoRA (a 4-bit or 8-bit base model with LoRA adapters) and
8-bit optimizer states (`optim="adamw_bnb_8bit"`, ...) through the trainers users reach for with them; and a
`PeftModel` passed in with an adapter trained already (the reference it implies)."""

from __future__ import annotations

from functools import partial

from . import COMMON_ARGS, QWEN, register, run_trainer, to_jsonable
from .offline import OFFLINE_TRAINERS, TINY_LORA
from .online import ONLINE_ARGS, toy_reward


def quantized_model(ctx, bits: int, kind: str = "causal", bf16: bool = False, **quantization):
    """The tiny model loaded through bitsandbytes in `bits` bits (4: NF4 unless `quantization` says otherwise),
    computing in fp32 (with `bf16`: loaded and computing in bf16)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, BitsAndBytesConfig

    if bits == 4:
        config = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=quantization.pop("quant_type", "nf4"),
            bnb_4bit_compute_dtype=torch.bfloat16 if bf16 else torch.float32,
            **quantization,
        )
    else:
        config = BitsAndBytesConfig(load_in_8bit=True, **quantization)
    model_class = AutoModelForSequenceClassification if kind == "reward" else AutoModelForCausalLM
    extra = {"num_labels": 1} if kind == "reward" else {}
    dtype = torch.bfloat16 if bf16 else torch.float32
    return model_class.from_pretrained(ctx.model(QWEN), quantization_config=config, dtype=dtype, **extra)


def trainable_dtypes(trainer) -> list[str]:
    """The dtypes of the trained parameters after construction (TRL casts some trainers' adapters to bf16)."""
    return sorted({str(p.dtype) for p in trainer.model.parameters() if p.requires_grad})


def train_then_evaluate(trainer) -> dict:
    """`run_trainer` without the evaluation before training: on the CPU, bitsandbytes (0.50) packs a 4-bit weight for
    inference on its first call without gradients, after which a biased layer's training forward raises "a view of a
    leaf Variable that requires grad is being used in an in-place operation", under TRL as here."""
    dtypes = trainable_dtypes(trainer)
    out = run_trainer(trainer, evaluate=False)
    out["eval_after"] = to_jsonable(trainer.evaluate())
    return {**out, "trainable_dtypes": dtypes}


def lora(task_type: str = "CAUSAL_LM", **overrides):
    from peft import LoraConfig

    return LoraConfig(**{**TINY_LORA, **overrides}, task_type=task_type)


def qlora_offline_case(
    ctx,
    kind: str,
    bits: int = 4,
    quantization=None,
    bf16_model: bool = False,
    lora_overrides=None,
    **config,
) -> dict:
    """An offline trainer on a quantized base model with LoRA adapters (the reference: the adapters disabled)."""
    import trl

    prefix, dataset, _ = OFFLINE_TRAINERS[kind]
    args = getattr(trl, f"{prefix}Config")(output_dir=ctx.tmpdir(), **{**COMMON_ARGS, **config})
    kind_of_model = "reward" if kind == "reward" else "causal"
    model = quantized_model(ctx, bits, kind_of_model, bf16=bf16_model, **(quantization or {}))
    trainer = getattr(trl, f"{prefix}Trainer")(
        model=model,
        args=args,
        train_dataset=ctx.dataset(dataset, "train", 8),
        eval_dataset=ctx.dataset(dataset, "test", 8),
        peft_config=lora("SEQ_CLS" if kind == "reward" else "CAUSAL_LM", **(lora_overrides or {})),
    )
    return {"trainable_dtypes": trainable_dtypes(trainer), **train_then_evaluate(trainer)}


for _kind in ("sft", "dpo", "kto"):
    register(f"{_kind}/qlora_4bit", partial(qlora_offline_case, kind=_kind))
# No Reward case: TRL's bf16 score head (a `modules_to_save` copy) on an fp32 base fails in its first matmul, as here,
# and on a bf16 base every product rounds to bf16 (no fp32 comparison holds).
# A head in `modules_to_save`: its trained copy is bf16 on an fp32 base, the head's product is computed in fp32.
register(
    "sft/qlora_4bit/modules_to_save=lm_head",
    partial(qlora_offline_case, kind="sft", lora_overrides={"modules_to_save": ["lm_head"]}),
)
register(
    "dpo/qlora_4bit/modules_to_save=lm_head",
    partial(qlora_offline_case, kind="dpo", lora_overrides={"modules_to_save": ["lm_head"]}),
)


def qlora_peft_model_case(ctx, kind: str) -> dict:
    """A `PeftModel` on a 4-bit base passed in, without a `peft_config`."""
    from peft import get_peft_model

    import trl

    prefix, dataset, _ = OFFLINE_TRAINERS[kind]
    args = getattr(trl, f"{prefix}Config")(output_dir=ctx.tmpdir(), **COMMON_ARGS)
    trainer = getattr(trl, f"{prefix}Trainer")(
        model=get_peft_model(quantized_model(ctx, 4), lora()),
        args=args,
        train_dataset=ctx.dataset(dataset, "train", 8),
        eval_dataset=ctx.dataset(dataset, "test", 8),
    )
    return train_then_evaluate(trainer)


register("sft/qlora_4bit/peft_model_given", partial(qlora_peft_model_case, kind="sft"))
register("dpo/qlora_4bit/peft_model_given", partial(qlora_peft_model_case, kind="dpo"))
register(
    "sft/qlora_4bit/fp4_double_quant",
    partial(qlora_offline_case, kind="sft", quantization={"quant_type": "fp4", "bnb_4bit_use_double_quant": True}),
)
register(
    "sft/qlora_4bit/gradient_checkpointing=False",
    partial(qlora_offline_case, kind="sft", gradient_checkpointing=False),
)
register("sft/qlora_4bit/packing", partial(qlora_offline_case, kind="sft", packing=True, max_length=64))
register("sft/qlora_8bit", partial(qlora_offline_case, kind="sft", bits=8))
register("dpo/qlora_4bit/loss_type=ipo", partial(qlora_offline_case, kind="dpo", loss_type="ipo"))


def qlora_model_init_case(ctx) -> dict:
    """A model path and a `quantization_config` in `model_init_kwargs`: the trainer loads the 4-bit model itself,
    as the CLI's `--load_in_4bit` asks it to."""
    import torch
    from transformers import BitsAndBytesConfig

    import trl

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)
    args = trl.SFTConfig(
        output_dir=ctx.tmpdir(),
        model_init_kwargs={"quantization_config": quantization, "dtype": "float32"},
        **COMMON_ARGS,
    )
    trainer = trl.SFTTrainer(
        model=ctx.model(QWEN),
        args=args,
        train_dataset=ctx.dataset("standard_language_modeling", "train", 8),
        eval_dataset=ctx.dataset("standard_language_modeling", "test", 8),
        peft_config=lora(),
    )
    return train_then_evaluate(trainer)


register("sft/qlora_4bit/model_init_kwargs", qlora_model_init_case)


def qlora_grpo_case(ctx, trainer_name: str = "GRPO", **config) -> dict:
    """GRPO/RLOO generating with, and training adapters on, a 4-bit base model."""
    import trl

    args = getattr(trl, f"{trainer_name}Config")(output_dir=ctx.tmpdir(), **{**ONLINE_ARGS, "max_steps": 2, **config})
    trainer = getattr(trl, f"{trainer_name}Trainer")(
        model=quantized_model(ctx, 4),
        reward_funcs=toy_reward,
        args=args,
        train_dataset=ctx.dataset("standard_prompt_only", "train", 16),
        peft_config=lora(),
    )
    return {"trainable_dtypes": trainable_dtypes(trainer), **run_trainer(trainer, evaluate=False)}


register("grpo/qlora_4bit", qlora_grpo_case)
register("grpo/qlora_4bit/beta=0.04", partial(qlora_grpo_case, beta=0.04))
register("rloo/qlora_4bit", partial(qlora_grpo_case, trainer_name="RLOO"))


# 8-bit optimizer states (full fine-tuning): transformers builds the bitsandbytes optimizer from `optim`.
for _kind, _optim in [
    ("sft", "adamw_bnb_8bit"),
    ("sft", "paged_adamw_8bit"),
    ("sft", "lion_8bit"),
    ("dpo", "adamw_bnb_8bit"),
    ("kto", "adamw_bnb_8bit"),
    ("reward", "adamw_bnb_8bit"),
]:
    register(
        f"{_kind}/optim={_optim}",
        lambda ctx, _kind=_kind, _optim=_optim: run_trainer(_offline_trainer(ctx, _kind, optim=_optim, max_steps=2)),
    )
register(
    "sft/optim=adamw_bnb_8bit/max_grad_norm=0",
    lambda ctx: run_trainer(_offline_trainer(ctx, "sft", optim="adamw_bnb_8bit", max_grad_norm=0.0, max_steps=2)),
)


def _offline_trainer(ctx, kind: str, **config):
    from .offline import build_offline

    trainer, _ = build_offline(ctx, kind, **config)
    return trainer


def grpo_8bit_optimizer_case(ctx) -> dict:
    import trl

    args = trl.GRPOConfig(output_dir=ctx.tmpdir(), **{**ONLINE_ARGS, "max_steps": 2, "optim": "adamw_bnb_8bit"})
    trainer = trl.GRPOTrainer(
        model=ctx.model(QWEN),
        reward_funcs=toy_reward,
        args=args,
        train_dataset=ctx.dataset("standard_prompt_only", "train", 16),
    )
    return run_trainer(trainer, evaluate=False)


register("grpo/optim=adamw_bnb_8bit", grpo_8bit_optimizer_case)


# ---------------------------------------------------------------------------------------------------------------------
# A `PeftModel` passed in with a trained adapter (SFT, then DPO on the same adapter): TRL's DPO, KTO, GRPO and RLOO
# take that adapter, as it is when training starts, as the reference.
# ---------------------------------------------------------------------------------------------------------------------
def trained_adapter_model(ctx):
    """The tiny model with a LoRA adapter whose B matrices are nonzero (seeded), as after a first fine-tuning."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ctx.model(QWEN), dtype=torch.float32)
    torch.manual_seed(0)
    peft_model = get_peft_model(model, lora())
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.5)
    return peft_model


def trained_adapter_case(ctx, kind: str, **config) -> dict:
    import trl

    prefix, dataset, _ = OFFLINE_TRAINERS[kind]
    args = getattr(trl, f"{prefix}Config")(output_dir=ctx.tmpdir(), **{**COMMON_ARGS, **config})
    trainer = getattr(trl, f"{prefix}Trainer")(
        model=trained_adapter_model(ctx),
        args=args,
        train_dataset=ctx.dataset(dataset, "train", 8),
        eval_dataset=ctx.dataset(dataset, "test", 8),
    )
    return {"adapters": sorted(trainer.model.peft_config), **run_trainer(trainer)}


def trained_adapter_online_case(ctx, trainer_name: str, **config) -> dict:
    import trl

    args = getattr(trl, f"{trainer_name}Config")(output_dir=ctx.tmpdir(), **{**ONLINE_ARGS, "max_steps": 2, **config})
    trainer = getattr(trl, f"{trainer_name}Trainer")(
        model=trained_adapter_model(ctx),
        reward_funcs=toy_reward,
        args=args,
        train_dataset=ctx.dataset("standard_prompt_only", "train", 16),
    )
    return {"adapters": sorted(trainer.model.peft_config), **run_trainer(trainer, evaluate=False)}


for _kind in ("dpo", "kto"):
    register(f"{_kind}/peft_model_trained_adapter", partial(trained_adapter_case, kind=_kind))
for _trainer, _beta in (("GRPO", 0.04), ("GRPO", 0.0), ("RLOO", 0.04)):
    register(
        f"{_trainer.lower()}/peft_model_trained_adapter/beta={_beta}",
        partial(trained_adapter_online_case, trainer_name=_trainer, beta=_beta),
    )
