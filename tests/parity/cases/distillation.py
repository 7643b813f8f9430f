"""Parity cases: knowledge distillation (GKD's generalized Jensen-Shannon divergence)."""

from __future__ import annotations

from functools import partial

from . import COMMON_ARGS, QWEN, case, expect_error, register, run_trainer, to_jsonable
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


@case("gkd/errors/lmbda", phrases=("lmbda",))
def gkd_bad_lmbda(ctx) -> dict:
    from trl.experimental.gkd import GKDConfig

    return expect_error(lambda: GKDConfig(output_dir=ctx.tmpdir(), use_cpu=True, bf16=False, lmbda=1.5))


@case("gkd/errors/beta", phrases=("beta",))
def gkd_bad_beta(ctx) -> dict:
    from trl.experimental.gkd import GKDConfig

    return expect_error(lambda: GKDConfig(output_dir=ctx.tmpdir(), use_cpu=True, bf16=False, beta=-0.1))
