"""Parity cases: the stable on-policy `DistillationTrainer` (tiny-Qwen2 student, small-Qwen2 teacher)."""

from __future__ import annotations

from functools import partial

from . import COMMON_ARGS, QWEN, expect_error, predict_eval_dataset, register, run_trainer, to_jsonable
from .dataclass_fields import _register_dataclass_case


TEACHER = "small-Qwen2ForCausalLM"
GREEDY = {"do_sample": False}
# Sampled, with the EOS logit raised: completions of different lengths (the loss is a token mean over the step).
EOS_BIAS = {"sequence_bias": [[[4091], 6.0]]}

DISTILLATION_ARGS = dict(COMMON_ARGS, max_steps=2, max_completion_length=8, generation_kwargs=GREEDY)


def build_distillation(ctx, *, dataset: str = "standard_prompt_only", evaluate: bool = True, **config):
    """The tiny student and the small teacher on 8 train / 8 test prompts (no test split unless `evaluate`)."""
    import trl

    args = trl.DistillationConfig(output_dir=ctx.tmpdir(), **{**DISTILLATION_ARGS, **config})
    return trl.DistillationTrainer(
        model=ctx.model(QWEN),
        teacher_model=ctx.model(TEACHER),
        args=args,
        train_dataset=ctx.dataset(dataset, "train", 8),
        eval_dataset=ctx.dataset(dataset, "test", 8) if evaluate else None,
    )


def distillation_case(ctx, *, log_completions: bool = False, evaluate: bool = True, **config) -> dict:
    """Evaluate, train, evaluate: the standard trainer scenario on 8 train / 8 test prompts."""
    trainer = build_distillation(ctx, log_completions=log_completions, evaluate=evaluate, **config)
    out = run_trainer(trainer, evaluate=evaluate)
    if log_completions:
        out["completions"] = _completion_tables(trainer.args.output_dir)
    return out


def _completion_tables(output_dir: str) -> dict:
    import os

    import pandas as pd

    folder = os.path.join(output_dir, "completions")
    tables = {}
    for name in sorted(os.listdir(folder)):
        frame = pd.read_parquet(os.path.join(folder, name))
        tables[name] = {"columns": list(frame.columns), "rows": to_jsonable(frame.to_dict("records"))}
    return tables


register("distillation/greedy", distillation_case)
register("distillation/predict", lambda ctx: predict_eval_dataset(build_distillation(ctx)))
register("distillation/beta=0", partial(distillation_case, beta=0.0))
# NEFTune's noise on the student's embeddings (the teacher, a separate model, has none).
register("distillation/neftune_noise_alpha=5", partial(distillation_case, neftune_noise_alpha=5.0, beta=0.5))
register("distillation/temperature=0.7", partial(distillation_case, temperature=0.7))
register("distillation/beta=0.5", partial(distillation_case, beta=0.5, temperature=2.0))
register("distillation/sampled_eos_bias", partial(distillation_case, generation_kwargs=EOS_BIAS, beta=0.5))
register(
    "distillation/gradient_accumulation_steps=2",
    partial(distillation_case, per_device_train_batch_size=2, gradient_accumulation_steps=2, evaluate=False),
)
register(
    "distillation/conversational_prompt_only",
    partial(distillation_case, dataset="conversational_prompt_only", max_steps=1),
)
register("distillation/log_completions", partial(distillation_case, log_completions=True, evaluate=False))


def _teacher_dtype(ctx) -> dict:
    import trl

    args = trl.DistillationConfig(
        output_dir=ctx.tmpdir(), teacher_model_init_kwargs={"dtype": "bfloat16"}, **DISTILLATION_ARGS
    )
    trainer = trl.DistillationTrainer(
        model=ctx.model(QWEN),
        teacher_model=ctx.model(TEACHER),
        args=args,
        train_dataset=ctx.dataset("standard_prompt_only", "train", 8),
    )
    return {"teacher_dtype": str(trainer.teacher_model.dtype), "student_dtype": str(trainer.model.dtype)}


register("distillation/teacher_model_init_kwargs", _teacher_dtype)


def _beta_out_of_range(ctx) -> dict:
    import trl

    return expect_error(lambda: trl.DistillationConfig(output_dir=ctx.tmpdir(), beta=1.5, **DISTILLATION_ARGS))


def _vocabulary_mismatch(ctx) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import trl

    config = AutoConfig.from_pretrained(ctx.model(QWEN))
    config.vocab_size = 5000
    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_config(config)
    args = trl.DistillationConfig(output_dir=ctx.tmpdir(), **DISTILLATION_ARGS)
    return expect_error(
        lambda: trl.DistillationTrainer(
            model=ctx.model(QWEN),
            teacher_model=teacher,
            args=args,
            train_dataset=ctx.dataset("standard_prompt_only", "train", 8),
        )
    )


register("errors/distillation_beta_out_of_range", _beta_out_of_range, phrases=("beta must be in [0.0, 1.0]",))
register(
    "errors/distillation_vocab_mismatch",
    _vocabulary_mismatch,
    phrases=(
        "The student model has vocab_size 4096 but the teacher model has vocab_size 5000. Distillation compares the "
        "teacher's full next-token distribution, which requires a shared vocabulary. Use a teacher with the same "
        "vocab_size, or GOLD for cross-tokenizer distillation.",
    ),
)
_register_dataclass_case("DistillationConfig", "trl", "DistillationConfig")
