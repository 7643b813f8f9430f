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


# ---------------------------------------------------------------------------------------------------------------------
# trl.kernels.chunked_divergence
# ---------------------------------------------------------------------------------------------------------------------
def _divergence_inputs(seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    student = torch.randn(5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 8, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(11, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(5, 6, generator=g, dtype=torch.float64)
    teacher_weight = torch.randn(11, 6, generator=g, dtype=torch.float64)
    return student, weight, bias, teacher, teacher_weight


@case("kernels/chunked_divergence")
def _chunked_divergence(ctx):
    from trl.kernels.chunked_divergence import TOKEN_CHUNK_SIZE, VOCAB_CHUNK_SIZE, ChunkedDivergenceFunction

    out = {"constants": [TOKEN_CHUNK_SIZE, VOCAB_CHUNK_SIZE]}
    settings = {
        "beta=0": (0.0, 1.0, 1.0, None, 1.0, None),
        "beta=1": (1.0, 1.0, 1.0, None, 1.0, None),
        "beta=0.5/T=0.7": (0.5, 0.7, 1.0, None, 1.0, None),
        "beta=0.3/scale/softcap": (0.3, 1.0, 0.5, 3.0, 2.0, 4.0),
    }
    for name, (beta, temperature, s_scale, s_cap, t_scale, t_cap) in settings.items():
        student, weight, bias, teacher, teacher_weight = _divergence_inputs()
        divergence, entropy = ChunkedDivergenceFunction.apply(
            student, weight, bias, teacher, teacher_weight, None, beta, temperature, s_scale, s_cap, t_scale, t_cap
        )
        divergence.sum().backward()
        out[name] = to_jsonable(
            {
                "divergence": divergence,
                "entropy": entropy,
                "dtypes": [str(divergence.dtype), str(entropy.dtype)],
                "entropy_requires_grad": entropy.requires_grad,
                "grad_hidden": student.grad,
                "grad_weight_norm": weight.grad.norm(),
                "grad_bias": bias.grad,
            }
        )
    return out


@case("kernels/chunked_logprob_constants")
def _chunked_logprob_constants(ctx):
    from trl.kernels import chunked_logprob

    return {"token_chunk": chunked_logprob.TOKEN_CHUNK_SIZE, "outputs": list(chunked_logprob.OPTIONAL_OUTPUTS)}


@case("trainer_utils/selective_log_softmax_and_entropy_signature")
def _slse_signature(ctx):
    import torch

    from trl.trainer.utils import selective_log_softmax_and_entropy

    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(0), requires_grad=True)
    index = torch.tensor([[1, 2, 3], [4, 5, 6]])
    logps, entropy = selective_log_softmax_and_entropy(logits, index, False, 0.8)
    masked = selective_log_softmax_and_entropy(logits, index, True, 1.0, torch.tensor([[1, 0, 1], [0, 1, 1]]))
    return to_jsonable(
        {"logps": logps, "entropy": entropy, "entropy_grad": entropy.requires_grad, "masked": list(masked)}
    )


# ---------------------------------------------------------------------------------------------------------------------
# trl.trainer.add_fused_lm_head
# ---------------------------------------------------------------------------------------------------------------------
def _fused_model(ctx, **kwargs):
    import torch
    from transformers import AutoModelForCausalLM

    from trl.trainer import add_fused_lm_head

    model = AutoModelForCausalLM.from_pretrained(ctx.model(QWEN))
    add_fused_lm_head(model, **kwargs)
    ids = torch.randint(0, 200, (2, 7), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, :3] = -100
    return model, ids, labels


def _fused_fingerprint(output) -> dict:
    return to_jsonable({key: value for key, value in output.items()})


@case("fused_lm_head/outputs")
def _fused_outputs(ctx):
    import inspect

    from transformers import AutoModelForCausalLM

    reference = inspect.signature(AutoModelForCausalLM.from_pretrained(ctx.model(QWEN)).forward)
    all_outputs = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    model, ids, labels = _fused_model(ctx, temperature=0.7, outputs=all_outputs)
    fused = model(input_ids=ids, labels=labels, fused_lm_head=True)
    fused.loss.backward()
    plain = model(input_ids=ids, labels=labels)
    return {
        "signature_kept": inspect.signature(model.forward) == reference,
        "type": type(fused).__name__,
        "fused": _fused_fingerprint(fused),
        "plain_type": type(plain).__name__,
        "plain_loss": plain.loss.item(),
        "lm_head_grad_norm": model.lm_head.weight.grad.norm().item(),
    }


@case("fused_lm_head/shift_labels_num_items")
def _fused_shift_labels(ctx):
    model, ids, labels = _fused_model(ctx, cast_lm_head_to_fp32=True)
    out = model(input_ids=ids, shift_labels=labels, num_items_in_batch=5, fused_lm_head=True)
    attention = model(input_ids=ids, attention_mask=(ids > 20).long(), labels=labels, fused_lm_head=True)
    return {"shift": _fused_fingerprint(out), "attention_mask": _fused_fingerprint(attention)}


@case("fused_lm_head/generate_still_works")
def _fused_generate(ctx):
    model, ids, _ = _fused_model(ctx)
    return to_jsonable(model.generate(input_ids=ids[:, :3], max_new_tokens=3, do_sample=False))


@case("fused_lm_head/output_fields")
def _fused_output_fields(ctx):
    import dataclasses

    from trl.trainer.utils import FusedCausalLMOutput, maybe_gather_lm_head_ctx

    with maybe_gather_lm_head_ctx(None):
        entered = True
    return {"fields": [f.name for f in dataclasses.fields(FusedCausalLMOutput)], "null_context": entered}


# ---------------------------------------------------------------------------------------------------------------------
# Selective activation checkpointing (trl.models, SFT's gradient_checkpointing_kwargs={"selective": True})
# ---------------------------------------------------------------------------------------------------------------------
def _sft_selective(ctx, **config):
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=ctx.tmpdir(), **{**COMMON_ARGS, **config})
    data = ctx.dataset("standard_language_modeling", "train", 8)
    return SFTTrainer(model=ctx.model(QWEN), args=args, train_dataset=data)


@case("sft/gradient_checkpointing_kwargs=selective")
def _sft_selective_train(ctx):
    trainer = _sft_selective(
        ctx, gradient_checkpointing=True, gradient_checkpointing_kwargs={"selective": True}, max_length=32
    )
    out = run_trainer(trainer, evaluate=False)
    out["wrapped"] = bool(getattr(trainer.model.gradient_checkpointing_enable, "_is_sac_wrapped", False))
    out["kwargs_after"] = to_jsonable(trainer.args.gradient_checkpointing_kwargs)
    return out


@case("sft/gradient_checkpointing_kwargs=selective_false")
def _sft_selective_false(ctx):
    trainer = _sft_selective(ctx, gradient_checkpointing=True, gradient_checkpointing_kwargs={"selective": False})
    return {"kwargs_after": to_jsonable(trainer.args.gradient_checkpointing_kwargs)}


@case(
    "errors/sft_selective_without_gradient_checkpointing",
    phrases=("`gradient_checkpointing_kwargs={'selective': True}` requires `gradient_checkpointing=True`.",),
)
def _sft_selective_no_gc(ctx):
    return expect_error(
        lambda: _sft_selective(ctx, gradient_checkpointing=False, gradient_checkpointing_kwargs={"selective": True})
    )


@case(
    "errors/sft_selective_reentrant",
    phrases=(
        "`gradient_checkpointing_kwargs={'selective': True}` requires non-reentrant gradient checkpointing. Set "
        "`use_reentrant` to `False`, or leave it unset.",
    ),
)
def _sft_selective_reentrant(ctx):
    return expect_error(
        lambda: _sft_selective(
            ctx, gradient_checkpointing=True, gradient_checkpointing_kwargs={"selective": True, "use_reentrant": True}
        )
    )


@case("models/enable_selective_activation_checkpointing")
def _sac_model(ctx):
    import torch
    from transformers import AutoModelForCausalLM

    from trl.models import enable_selective_activation_checkpointing

    model = AutoModelForCausalLM.from_pretrained(ctx.model(QWEN))
    enable_selective_activation_checkpointing(model)
    first = model.gradient_checkpointing_enable
    enable_selective_activation_checkpointing(model)
    model.gradient_checkpointing_enable()
    model.train()
    ids = torch.randint(0, 200, (2, 6), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return {
        "idempotent": model.gradient_checkpointing_enable is first,
        "marked": bool(getattr(first, "_is_sac_wrapped", False)),
        "loss": loss.item(),
        "grad_sum": sum(p.grad.double().sum().item() for p in model.parameters() if p.grad is not None),
    }


# ---------------------------------------------------------------------------------------------------------------------
# CPO / ORPO legacy helpers on a batch in TRL's layout (built by hand, so both sides get the same input)
# ---------------------------------------------------------------------------------------------------------------------
def _trl_layout_batch(tok):
    import torch

    pairs = [("3 + 18 =", " 21", " 22"), ("The sky is", " blue today", " green")]
    pad_id = tok.pad_token_id
    rows = {"chosen": [], "rejected": []}
    prompts = []
    for prompt, chosen, rejected in pairs:
        prompt_ids = tok(prompt)["input_ids"]
        prompts.append(prompt_ids)
        for side, text in (("chosen", chosen), ("rejected", rejected)):
            ids = prompt_ids + tok(text)["input_ids"] + [tok.eos_token_id]
            rows[side].append((ids, [-100] * len(prompt_ids) + ids[len(prompt_ids) :]))
    batch = {}
    for side, items in rows.items():
        width = max(len(ids) for ids, _ in items)
        batch[f"{side}_input_ids"] = torch.tensor([ids + [pad_id] * (width - len(ids)) for ids, _ in items])
        batch[f"{side}_attention_mask"] = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in items])
        batch[f"{side}_labels"] = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in items])
    width = max(len(p) for p in prompts)
    batch["prompt_input_ids"] = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    batch["prompt_attention_mask"] = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return batch


def legacy_helpers_case(ctx, kind: str, **config) -> dict:
    import importlib

    import torch

    module = importlib.import_module(f"trl.experimental.{kind}")
    prefix = kind.upper()
    args = getattr(module, f"{prefix}Config")(output_dir=ctx.tmpdir(), **{**COMMON_ARGS, **config})
    trainer = getattr(module, f"{prefix}Trainer")(
        model=ctx.model(QWEN), args=args, train_dataset=ctx.dataset("standard_preference", "train", 4)
    )
    tok = tokenizer(ctx)
    batch = _trl_layout_batch(tok)
    trainer_class = type(trainer)
    forward = trainer.concatenated_forward(trainer.model, batch)
    loss, metrics = trainer.get_batch_loss_metrics(trainer.model, batch)
    _, eval_metrics = trainer.get_batch_loss_metrics(trainer.model, batch, train_eval="eval")
    loss.backward()
    return to_jsonable(
        {
            "tokenized": [
                trainer.build_tokenized_answer(p, a)
                for p, a in (("The sky is", " blue"), ("hello wor", "ld"), ("3 + 18 =", " 21"))
            ],
            "concatenated": trainer_class.concatenated_inputs(batch, padding_value=7),
            "forward": {
                "count": len(forward),
                "logps": forward[:2],
                "logits_shapes": [list(t.shape) for t in forward[2:4]],
                "logits_sums": [t.double().sum().item() for t in forward[2:4]],
                "nll": forward[4],
            },
            "loss": loss,
            "metrics": metrics,
            "eval_metrics": eval_metrics,
            "grad_norm": torch.sqrt(sum((p.grad.double() ** 2).sum() for p in trainer.model.parameters())),
        }
    )


for _kind, _name, _config in (
    ("cpo", "sigmoid", {}),
    ("cpo", "simpo", dict(loss_type="simpo", cpo_alpha=0.0)),
    ("cpo", "ipo/cpo_alpha=0.5", dict(loss_type="ipo", cpo_alpha=0.5)),
    ("orpo", "default", {}),
):
    register(f"{_kind}/legacy_helpers/{_name}", partial(legacy_helpers_case, kind=_kind, **_config))
