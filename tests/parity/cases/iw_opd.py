"""Parity cases: `trl.experimental.iw_opd.IWOPDTrainer` (the `messages` collator, training with a local teacher for
each loss path, and with the teacher server replaced by the in-process scorer of the server-distillation cases)."""

from __future__ import annotations

from functools import partial

from . import COMMON_ARGS, QWEN, register, run_trainer, to_jsonable, tokenizer
from .server_distillation import TEACHER, URL, LocalTeacherScorer, _patch_client


IW_OPD_ARGS = dict(COMMON_ARGS, max_steps=2, max_length=96, max_completion_length=6, gradient_accumulation_steps=2)
IW_OPD_ARGS["per_device_train_batch_size"] = 2


def iw_opd_case(ctx, server: bool = False, **config) -> dict:
    from trl.experimental.iw_opd import IWOPDConfig, IWOPDTrainer

    kwargs = {}
    if server:
        LocalTeacherScorer.calls = []
        _patch_client(ctx)
        config = dict(config, use_teacher_server=True, teacher_model_server_url=URL)
    else:
        kwargs["teacher_model"] = ctx.model(TEACHER)
    args = IWOPDConfig(output_dir=ctx.tmpdir(), **{**IW_OPD_ARGS, **config})
    trainer = IWOPDTrainer(
        model=ctx.model(QWEN),
        args=args,
        train_dataset=ctx.dataset("conversational_language_modeling", "train", 8),
        eval_dataset=ctx.dataset("conversational_language_modeling", "test", 4),
        processing_class=tokenizer(ctx),
        **kwargs,
    )
    out = run_trainer(trainer)
    out["tags"], out["name"] = list(trainer._tag_names), trainer._name
    if server:
        out["teacher_calls"] = LocalTeacherScorer.calls[:3]
    return out


register("iw_opd/train/iw_opd", iw_opd_case)
register("iw_opd/train/iw_opd/gamma=0", partial(iw_opd_case, iw_opd_gamma=0.0, temperature=2.0))
register("iw_opd/train/jsd/off_policy", partial(iw_opd_case, distillation_objective="jsd", lmbda=0.0))
register("iw_opd/train/jsd/mixed", partial(iw_opd_case, distillation_objective="jsd", lmbda=0.5, seed=3))
register(
    "iw_opd/train/jsd/argmax",
    partial(iw_opd_case, distillation_objective="jsd", lmbda=0.0, beta=0.5, reverse_kl_top_1_mode="argmax"),
)
register(
    "iw_opd/train/jsd/full_vocab",
    partial(iw_opd_case, distillation_objective="jsd", lmbda=0.0, beta=0.5, loss_top_k=0),
)
register(
    "iw_opd/train/jsd/top_k/union",
    partial(iw_opd_case, distillation_objective="jsd", lmbda=0.0, beta=0.5, loss_top_k=3, loss_add_tail=False),
)
register("iw_opd/train/jsd/top_k/forward", partial(iw_opd_case, distillation_objective="jsd", beta=0.0, loss_top_k=4))
register("iw_opd/train/server/iw_opd", partial(iw_opd_case, server=True))
register(
    "iw_opd/train/server/jsd_forward",
    partial(iw_opd_case, server=True, distillation_objective="jsd", lmbda=0.0, beta=0.0, loss_top_k=3),
)
register("iw_opd/train/server/jsd_reverse", partial(iw_opd_case, server=True, distillation_objective="jsd", lmbda=0.0))


def _collator(ctx) -> dict:
    from trl.experimental.iw_opd import iw_opd_trainer

    messages = [
        [{"role": "user", "content": "Count to 3"}, {"role": "assistant", "content": "1 2"}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "A"}, {"role": "user", "content": "x"}],
        [{"role": "assistant", "content": "Only"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello there"},
        ],
    ]
    out = {}
    for max_length, max_prompt_length in ((200, 150), (40, 36), (40, 38)):
        collator = iw_opd_trainer._DistillationCollator(tokenizer(ctx), max_length, max_prompt_length)
        out[f"{max_length}/{max_prompt_length}"] = collator([{"messages": m} for m in messages])
    return to_jsonable(out)


register("iw_opd/collator", _collator)
