"""Parity cases: TRL 1.16's newer experimental methods and building blocks (TPO, `trl.kernels`, the fused LM head,
selective activation checkpointing, the CPO / ORPO legacy helpers)."""

from __future__ import annotations

from functools import partial

from . import (
    COMMON_ARGS,
    QWEN,
    case,
    expect_error,
    predict_eval_dataset,
    register,
    run_trainer,
    to_jsonable,
    tokenizer,
)


TINY_LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])


# ---------------------------------------------------------------------------------------------------------------------
# TPO: triples built from the tiny preference datasets, the gold reference a lengthened chosen completion
# ---------------------------------------------------------------------------------------------------------------------
def _with_reference(example: dict) -> dict:
    chosen = example["chosen"]
    if isinstance(chosen, str):
        return {"reference": chosen + " indeed"}
    last = chosen[-1]
    return {"reference": [*chosen[:-1], {**last, "content": last["content"] + " indeed"}]}


def triples(ctx, dataset: str, split: str, n: int = 8):
    return ctx.dataset(dataset, split, n).map(_with_reference)


def build_tpo(ctx, dataset="standard_preference", model=QWEN, peft=False, **config):
    from trl.experimental.tpo import TPOConfig, TPOTrainer

    args = TPOConfig(output_dir=ctx.tmpdir(), **{**COMMON_ARGS, **config})
    kwargs = {}
    if peft:
        from peft import LoraConfig

        kwargs["peft_config"] = LoraConfig(**TINY_LORA, task_type="CAUSAL_LM")
    return TPOTrainer(
        model=ctx.model(model),
        args=args,
        train_dataset=triples(ctx, dataset, "train"),
        eval_dataset=triples(ctx, dataset, "test"),
        **kwargs,
    )


def tpo_case(ctx, **kwargs) -> dict:
    trainer = build_tpo(ctx, **kwargs)
    out = run_trainer(trainer)
    out["first_train_row"] = to_jsonable(trainer.train_dataset[0])
    return out


for _name, _kwargs in {
    "standard_preference": {},
    "loss_type=hinge": dict(loss_type="hinge"),
    "loss_type=ipo": dict(loss_type="ipo"),
    "loss_type=tpo-l": dict(loss_type="tpo-l"),
    "loss_type=tpo-l/tpo_l_gamma=2": dict(loss_type="tpo-l", tpo_l_gamma=2.0, beta=0.5),
    "label_smoothing=0.2": dict(label_smoothing=0.2, beta=0.3),
    "tpo_alpha=0": dict(tpo_alpha=0.0),
    "tpo_alpha=0.3": dict(tpo_alpha=0.3),
    "conversational_preference": dict(dataset="conversational_preference"),
    "standard_implicit_prompt_preference": dict(dataset="standard_implicit_prompt_preference"),
    "conversational_implicit_prompt_preference": dict(dataset="conversational_implicit_prompt_preference"),
    "max_length=9": dict(max_length=9),
    "truncation_mode=keep_end": dict(max_length=9, truncation_mode="keep_end"),
    "pad_to_multiple_of=8": dict(pad_to_multiple_of=8),
    "gradient_accumulation_steps=2": dict(per_device_train_batch_size=2, gradient_accumulation_steps=2),
    "llama": dict(dataset="conversational_preference", model="tiny-LlamaForCausalLM"),
    "peft_lora": dict(peft=True),
}.items():
    register(f"tpo/{_name}", partial(tpo_case, **_kwargs))


@case("tpo/predict")
def _tpo_predict(ctx):
    return predict_eval_dataset(build_tpo(ctx))


@case("tpo/collator")
def _tpo_collator(ctx):
    from trl.experimental.tpo.tpo_trainer import DataCollatorForTriplePreference

    example = {"prompt_ids": [1, 2], "chosen_ids": [3], "rejected_ids": [4, 5], "reference_ids": [6, 7, 8]}
    out = {}
    for name, kwargs in {
        "default": {},
        "no_reference": dict(include_reference=False),
        "keep_end": dict(max_length=3, truncation_mode="keep_end"),
        "keep_start/pad_to_multiple_of=4": dict(max_length=3, pad_to_multiple_of=4),
    }.items():
        collator = DataCollatorForTriplePreference(pad_token_id=0, **kwargs)
        out[name] = to_jsonable(collator([example, {**example, "chosen_ids": [9, 9, 9]}]))
    return out


@case("tpo/missing_reference_column", phrases=("reference",))
def _tpo_missing_reference(ctx):
    from trl.experimental.tpo import TPOConfig, TPOTrainer

    args = TPOConfig(output_dir=ctx.tmpdir(), **COMMON_ARGS)
    data = ctx.dataset("standard_preference", "train", 4)
    return expect_error(lambda: TPOTrainer(model=ctx.model(QWEN), args=args, train_dataset=data))


@case("tpo/implicit_prompt_reference_mismatch", phrases=("reference", "prompt"))
def _tpo_reference_mismatch(ctx):
    from trl.experimental.tpo import TPOConfig, TPOTrainer

    args = TPOConfig(output_dir=ctx.tmpdir(), **COMMON_ARGS)
    data = ctx.dataset("standard_implicit_prompt_preference", "train", 4).map(lambda row: {"reference": " other"})
    return expect_error(lambda: TPOTrainer(model=ctx.model(QWEN), args=args, train_dataset=data))


@case("tpo/tokenized_columns")
def _tpo_tokenized(ctx):
    trainer = build_tpo(ctx, dataset="conversational_preference")
    tok = tokenizer(ctx)
    rows = [trainer.train_dataset[i] for i in range(3)]
    keys = ("prompt_ids", "chosen_ids", "rejected_ids", "reference_ids")
    return {"rows": [{k: row[k] for k in keys} for row in rows], "pad": tok.pad_token_id}
