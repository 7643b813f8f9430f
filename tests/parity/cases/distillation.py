"""Parity cases: knowledge distillation (GKD's generalized Jensen-Shannon divergence; GOLD across tokenizers)."""

from __future__ import annotations

from functools import partial

from . import (
    COMMON_ARGS,
    QWEN,
    case,
    column_names,
    expect_error,
    predict_eval_dataset,
    register,
    run_trainer,
    tensor_stats,
    to_jsonable,
)
from .offline import TINY_LORA


def _jsd_inputs():
    import torch

    generator = torch.Generator().manual_seed(0)
    student = torch.randn(3, 6, 11, generator=generator) * 3
    teacher = torch.randn(3, 6, 11, generator=generator) * 3
    labels = torch.randint(0, 11, (3, 6), generator=generator)
    labels[0, :2] = -100  # prompt
    labels[1, 4:] = -100  # padding
    labels[2, :] = -100
    labels[2, 3] = 5
    return student, teacher, labels


@case("gkd/generalized_jsd_loss")
def gkd_generalized_jsd_loss(ctx) -> dict:
    """The static `GKDTrainer.generalized_jsd_loss` on fixed tensors: every beta regime, two temperatures, every
    reduction, with and without labels and `num_items_in_batch`, plus the student's gradient."""
    from trl.experimental.gkd import GKDTrainer

    student, teacher, labels = _jsd_inputs()
    out = {}
    for beta in (0.0, 0.1, 0.5, 1.0):
        for temperature in (1.0, 2.0):
            for reduction in ("batchmean", "sum", "mean", "none"):
                for name, lab in (("all", None), ("masked", labels)):
                    for num_items in (None, 5):
                        value = GKDTrainer.generalized_jsd_loss(
                            student,
                            teacher,
                            labels=lab,
                            beta=beta,
                            temperature=temperature,
                            reduction=reduction,
                            num_items_in_batch=num_items,
                        )
                        key = f"beta={beta},T={temperature},{reduction},{name},n={num_items}"
                        out[key] = [round(float(v), 9) for v in value.flatten().tolist()]
    for beta in (0.0, 0.5, 1.0):
        s = student.clone().requires_grad_(True)
        GKDTrainer.generalized_jsd_loss(s, teacher, labels=labels, beta=beta, temperature=1.5).backward()
        out[f"grad,beta={beta}"] = [round(float(v), 9) for v in s.grad.flatten().tolist()]
    return out


# ---------------------------------------------------------------------------------------------------------------------
# GKDTrainer: the tiny student distilled from the small teacher (same tokenizer) on conversations
# ---------------------------------------------------------------------------------------------------------------------
GKD_TEACHER = "small-Qwen2ForCausalLM"


def build_gkd(ctx, *, dataset: str = "conversational_language_modeling", peft: bool = False, **config):
    from transformers import AutoTokenizer

    from trl.experimental.gkd import GKDConfig, GKDTrainer

    kwargs = {}
    if peft:
        from peft import LoraConfig

        kwargs["peft_config"] = LoraConfig(**TINY_LORA, task_type="CAUSAL_LM")
    args = GKDConfig(output_dir=ctx.tmpdir(), **{**COMMON_ARGS, "max_new_tokens": 8, **config})
    return GKDTrainer(
        model=ctx.model(QWEN),
        teacher_model=ctx.model(GKD_TEACHER),
        args=args,
        train_dataset=ctx.dataset(dataset, "train", 8),
        eval_dataset=ctx.dataset(dataset, "test", 8),
        processing_class=AutoTokenizer.from_pretrained(ctx.model(QWEN)),
        **kwargs,
    )


def gkd_case(ctx, *, evaluate: bool = True, **config) -> dict:
    """Evaluate, train (one logged step per optimizer step), evaluate; gradients and update fingerprinted."""
    return run_trainer(build_gkd(ctx, **config), evaluate=evaluate)


register("gkd/lmbda=0", partial(gkd_case, lmbda=0.0))
register("gkd/lmbda=0/beta=0", partial(gkd_case, lmbda=0.0, beta=0.0))
register("gkd/lmbda=0/beta=1", partial(gkd_case, lmbda=0.0, beta=1.0))
register("gkd/lmbda=0/grad_accum", partial(gkd_case, lmbda=0.0, max_steps=2, gradient_accumulation_steps=2))
register("gkd/lmbda=0/max_length", partial(gkd_case, lmbda=0.0, max_length=40))
register("gkd/lmbda=0/peft", partial(gkd_case, lmbda=0.0, peft=True))
register("gkd/lmbda=1", partial(gkd_case, lmbda=1.0, evaluate=False))
register("gkd/lmbda=1/grad_accum", partial(gkd_case, lmbda=1.0, gradient_accumulation_steps=2, evaluate=False))
register("gkd/seq_kd", partial(gkd_case, lmbda=0.0, seq_kd=True, evaluate=False))
register("gkd/neftune_noise_alpha=5", partial(gkd_case, lmbda=1.0, neftune_noise_alpha=5.0, evaluate=False))
register(
    "gkd/lmbda=0.5/steps", partial(gkd_case, lmbda=0.5, max_steps=3, per_device_train_batch_size=2, evaluate=False)
)


@case("gkd/evaluate_raw")
def gkd_evaluate_raw(ctx) -> dict:
    """`evaluate()` on a raw test split and on a dict of two raw splits."""
    trainer = build_gkd(ctx, lmbda=0.0)
    test = ctx.dataset("conversational_language_modeling", "test", 8)
    return to_jsonable(
        {
            "raw": trainer.evaluate(eval_dataset=test),
            "dict": trainer.evaluate(eval_dataset={"a": test.select(range(4)), "b": test.select(range(4, 8))}),
        }
    )


@case("gkd/collator")
def gkd_collator(ctx) -> dict:
    """DataCollatorForChatML on conversations of different lengths, with and without truncation."""
    from transformers import AutoTokenizer

    from trl.experimental.utils import DataCollatorForChatML

    tok = AutoTokenizer.from_pretrained(ctx.model(QWEN))
    rows = list(ctx.dataset("conversational_language_modeling", "train", 4))
    out = {}
    for name, max_length in (("full", None), ("truncated", 48)):
        batch = DataCollatorForChatML(tok, max_length=max_length)(rows)
        out[name] = {key: value.tolist() for key, value in batch.items()}
    return out


@case("gkd/errors/lmbda", phrases=("lmbda must be in the range [0.0, 1.0].",))
def gkd_bad_lmbda(ctx) -> dict:
    from trl.experimental.gkd import GKDConfig

    return expect_error(lambda: GKDConfig(output_dir=ctx.tmpdir(), use_cpu=True, bf16=False, lmbda=1.5))


@case("gkd/errors/beta", phrases=("beta must be in the range [0.0, 1.0].",))
def gkd_bad_beta(ctx) -> dict:
    from trl.experimental.gkd import GKDConfig

    return expect_error(lambda: GKDConfig(output_dir=ctx.tmpdir(), use_cpu=True, bf16=False, beta=-0.1))


# ---------------------------------------------------------------------------------------------------------------------
# GOLD: the GKD losses at `temperature`, and Universal Logit Distillation across tokenizers (student tiny Qwen2,
# teacher tiny Llama: another tokenizer, digits split differently)
# ---------------------------------------------------------------------------------------------------------------------
LLAMA = "tiny-LlamaForCausalLM"


def _gold_config(ctx, **config):
    from trl.experimental.gold import GOLDConfig

    return GOLDConfig(output_dir=ctx.tmpdir(), use_cpu=True, bf16=False, report_to="none", **config)


def _uld_inputs():
    """Two rows of a 4096-entry vocabulary: student tokens 0-5, teacher tokens spelled differently, with byte spans
    where the student's first two completion tokens cover the teacher's first one."""
    import torch

    generator = torch.Generator().manual_seed(0)
    student = torch.randn(2, 6, 4096, generator=generator) * 3
    teacher = torch.randn(2, 6, 4096, generator=generator) * 3
    student_ids = torch.tensor([[0, 1, 2, 3, 4, 5]] * 2)
    teacher_ids = torch.tensor([[0, 1, 2, 7, 6, 5]] * 2)
    student_labels = torch.tensor([[-100, -100, 2, 3, 4, 5], [-100, -100, -100, -100, 4, 5]])
    teacher_labels = torch.tensor([[-100, -100, -100, 7, 6, 5]] * 2)
    student_offsets = torch.tensor(
        [[[0, 0], [0, 0], [0, 2], [2, 4], [4, 5], [5, 5]], [[0, 0], [0, 0], [0, 0], [0, 0], [0, 5], [5, 5]]]
    )
    teacher_offsets = torch.tensor([[[0, 0], [0, 0], [0, 0], [0, 4], [4, 5], [5, 5]]] * 2)
    return (
        student,
        teacher,
        student_labels,
        teacher_labels,
        student_ids,
        teacher_ids,
        student_offsets,
        teacher_offsets,
    )


def _uld_values(ctx, variants: dict[str, dict], tokenizers: bool = False) -> dict:
    from transformers import AutoTokenizer

    from trl.experimental.gold.gold_trainer import ULDLoss

    toks = ()
    if tokenizers:
        toks = (AutoTokenizer.from_pretrained(ctx.model(QWEN)), AutoTokenizer.from_pretrained(ctx.model(LLAMA)))
    inputs = _uld_inputs()
    out = {}
    for name, config in variants.items():
        student = inputs[0].clone().requires_grad_(True)
        loss = ULDLoss(_gold_config(ctx, use_uld_loss=True, **config), *toks)(student, *inputs[1:])
        loss.backward()
        out[name] = {"loss": round(float(loss), 7), "grad": tensor_stats(name, student.grad)}
    return out


@case("gold/uld_loss")
def gold_uld_loss(ctx) -> dict:
    """`ULDLoss` on fixed tensors: positional and byte-span alignment, eos skipping, temperatures, CE weight."""
    return _uld_values(
        ctx,
        {
            "extended": {},
            "extended/keep_eos": {"uld_skip_student_eos": False, "uld_skip_teacher_eos": False},
            "extended/student_eos": {"uld_skip_student_eos": False},
            "positional": {"use_extended_uld": False},
            "positional/keep_eos": {"use_extended_uld": False, "uld_skip_teacher_eos": False},
            "temperatures": {"uld_student_temperature": 2.0, "uld_teacher_temperature": 0.5},
            "weights": {"uld_crossentropy_weight": 0.3, "uld_distillation_weight": 2.0},
        },
    )


@case("gold/uld_loss/bayesian")
def gold_uld_loss_bayesian(ctx) -> dict:
    """`ULDLoss` with the `bayesian` merge of split tokens (which reads each token's predictive distribution)."""
    bayesian = {"uld_token_merge_strategy": "bayesian"}
    return _uld_values(
        ctx,
        {
            "bayesian": bayesian,
            "bayesian/keep_eos": {**bayesian, "uld_skip_student_eos": False, "uld_skip_teacher_eos": False},
            "bayesian/positional": {**bayesian, "use_extended_uld": False},
            "bayesian/hybrid": {**bayesian, "uld_use_hybrid_loss": True},
        },
        tokenizers=True,
    )


@case("gold/uld_loss/hybrid")
def gold_uld_loss_hybrid(ctx) -> dict:
    """`ULDLoss` hybrid (JSD on the vocabulary the two tokenizers share, ULD on the rest), adaptive and fixed weights."""
    return _uld_values(
        ctx,
        {
            "adaptive": {"uld_use_hybrid_loss": True},
            "fixed": {
                "uld_use_hybrid_loss": True,
                "uld_hybrid_matched_weight": 0.3,
                "uld_hybrid_unmatched_weight": 0.7,
            },
            "beta=0.2": {"uld_use_hybrid_loss": True, "beta": 0.2},
            "beta=0": {"uld_use_hybrid_loss": True, "beta": 0.0},
            "beta=1": {"uld_use_hybrid_loss": True, "beta": 1.0},
        },
        tokenizers=True,
    )


@case("gold/build_teacher_inputs_from_texts")
def gold_build_teacher_inputs(ctx) -> dict:
    """The teacher-side tokenization of prompt + completion texts, with and without byte spans."""
    from transformers import AutoTokenizer

    from trl.experimental.gold.gold_trainer import build_teacher_inputs_from_texts

    tok = AutoTokenizer.from_pretrained(ctx.model(LLAMA))
    prompts = ["<|im_start|>user\nWhat is 12 + 345?<|im_end|>\n<|im_start|>assistant\n", "Q: "]
    completions = ["12 + 345 = 357.<|im_end|>\n", "abc"]
    return {
        str(extended): [t.tolist() for t in build_teacher_inputs_from_texts(tok, prompts, completions, extended)]
        for extended in (True, False)
    }


@case("gold/config_fields")
def gold_config_fields(ctx) -> dict:
    """GOLDConfig's fields, types and defaults."""
    from trl.experimental.gold import GOLDConfig

    from .dataclass_fields import _fields

    return _fields(GOLDConfig)


def build_gold(ctx, *, teacher: str = GKD_TEACHER, **config):
    from transformers import AutoTokenizer

    from trl.experimental.gold import GOLDConfig, GOLDTrainer

    if config.get("use_uld_loss"):
        config.setdefault("teacher_tokenizer_name_or_path", ctx.model(teacher))
    args = GOLDConfig(output_dir=ctx.tmpdir(), **{**COMMON_ARGS, "max_completion_length": 8, "lmbda": 0.0, **config})
    dataset = "conversational_language_modeling"
    return GOLDTrainer(
        model=ctx.model(QWEN),
        teacher_model=ctx.model(teacher),
        args=args,
        train_dataset=ctx.dataset(dataset, "train", 8),
        eval_dataset=ctx.dataset(dataset, "test", 8),
        processing_class=AutoTokenizer.from_pretrained(ctx.model(QWEN)),
    )


def gold_case(ctx, **config) -> dict:
    """Evaluate, train one step on the dataset's completions (lmbda=0), evaluate."""
    return run_trainer(build_gold(ctx, **config))


register("gold/same_tokenizer", gold_case)
register("gold/same_tokenizer/grad_accum", partial(gold_case, max_steps=2, gradient_accumulation_steps=2))
register("gold/lmbda=1/grad_accum", partial(gold_case, lmbda=1.0, max_steps=2, gradient_accumulation_steps=2))
register("gold/same_tokenizer/beta=1", partial(gold_case, beta=1.0, temperature=1.0))
register("gold/cross_tokenizer", partial(gold_case, teacher=LLAMA, use_uld_loss=True))
register(
    "gold/cross_tokenizer/positional", partial(gold_case, teacher=LLAMA, use_uld_loss=True, use_extended_uld=False)
)
register(
    "gold/cross_tokenizer/ce_weight",
    partial(gold_case, teacher=LLAMA, use_uld_loss=True, uld_crossentropy_weight=0.5, uld_skip_student_eos=False),
)
register(
    "gold/cross_tokenizer/bayesian",
    partial(gold_case, teacher=LLAMA, use_uld_loss=True, uld_token_merge_strategy="bayesian"),
)
register("gold/cross_tokenizer/hybrid", partial(gold_case, teacher=LLAMA, use_uld_loss=True, uld_use_hybrid_loss=True))
register(
    "gold/cross_tokenizer/grad_accum",
    partial(gold_case, teacher=LLAMA, use_uld_loss=True, max_steps=2, gradient_accumulation_steps=2),
)
register("gold/num_generations", partial(gold_case, lmbda=1.0, num_generations=2, max_steps=2))
register(
    "gold/num_generations/grad_accum",
    partial(gold_case, lmbda=1.0, num_generations=2, max_steps=2, gradient_accumulation_steps=2),
)


@case("gold/columns")
def gold_columns(ctx) -> dict:
    """The prepared datasets' columns."""
    trainer = build_gold(ctx)
    return {"train": column_names(trainer.train_dataset), "eval": column_names(trainer.eval_dataset)}


@case("gold/errors/hybrid_weights", phrases=("uld_hybrid_matched_weight", "uld_hybrid_unmatched_weight"))
def gold_bad_hybrid_weights(ctx) -> dict:
    return expect_error(
        lambda: _gold_config(ctx, use_uld_loss=True, uld_use_hybrid_loss=True, uld_hybrid_matched_weight=0.5)
    )


@case("gold/errors/hybrid_weights_without_hybrid", phrases=("uld_hybrid_matched_weight",))
def gold_hybrid_weights_without_hybrid(ctx) -> dict:
    return expect_error(lambda: _gold_config(ctx, use_uld_loss=True, uld_hybrid_matched_weight=0.5))


@case("gold/errors/merge_strategy", phrases=("uld_token_merge_strategy",))
def gold_bad_merge_strategy(ctx) -> dict:
    return expect_error(lambda: _gold_config(ctx, use_uld_loss=True, uld_token_merge_strategy="mean"))


@case(
    "gold/errors/generation_batch_size",
    phrases=(
        "generation_batch_size and num_generations must exactly partition the local optimizer-step batch. Expected "
        "generation_batch_size * num_generations == per_device_train_batch_size * gradient_accumulation_steps, got "
        "3 * 1 != 8 * 1.",
    ),
)
def gold_bad_generation_batch_size(ctx) -> dict:
    return expect_error(lambda: _gold_config(ctx, generation_batch_size=3))


# `predict()`: GKD hands over the student's logits and labels (as SFT); GOLD the loss only (TRL 1.16's behaviours)
register("gkd/predict", lambda ctx: predict_eval_dataset(build_gkd(ctx, lmbda=0.0)))
register("gold/predict", lambda ctx: predict_eval_dataset(build_gold(ctx)))
