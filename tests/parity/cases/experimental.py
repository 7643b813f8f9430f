"""Parity cases: the experimental trainers. Online DPO against TRL 1.16 (`trl.experimental.online_dpo`); BCO, PRM, XPO
and Nash-MD against TRL 1.12 (`oracle="1.12"`), the last release this suite keeps that ships them.

Each case is the standard scenario of `run_trainer` (evaluate, one optimizer step, evaluate; gradients and update
fingerprinted). The online trainers sample with a fixed seed (the sampled ids are compared through the rewards'
inputs) and rank pairs with a deterministic reward: the tiny sequence-classification model or a toy function.
"""

from __future__ import annotations

from functools import partial

from . import COMMON_ARGS, QWEN, QWEN_RM, register, run_trainer, to_jsonable, tokenizer


QWEN_TOKEN_CLS = "tiny-Qwen2ForTokenClassification"

# Online pair trainers: 4 prompts a step, two completions of at most 8 new tokens each.
PAIR_ARGS = dict(COMMON_ARGS, max_new_tokens=8)

# Every call of `recording_reward` appends the completions it scored, so the cases compare the sampled text.
RECORDED_COMPLETIONS: list[list[str]] = []


def recording_reward(prompts, completions, **kwargs) -> list[float]:
    """Fraction of the characters of a completion that are digits or spaces (deterministic, varies per sample)."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    RECORDED_COMPLETIONS.append(texts)
    RECORDED_COMPLETIONS.append([p if isinstance(p, str) else p[-1]["content"] for p in prompts])
    RECORDED_COMPLETIONS.append(sorted(kwargs))
    return [sum(ch.isdigit() or ch == " " for ch in t) / max(len(t), 1) for t in texts]


def _experimental(module: str, prefix: str):
    import importlib

    mod = importlib.import_module(f"trl.experimental.{module}")
    return getattr(mod, f"{prefix}Config"), getattr(mod, f"{prefix}Trainer")


# ---------------------------------------------------------------------------------------------------------------------
# Online DPO (TRL 1.16), XPO and Nash-MD (TRL 1.12)
# ---------------------------------------------------------------------------------------------------------------------
ONLINE_PAIR_TRAINERS = {
    "online_dpo": ("online_dpo", "OnlineDPO"),
    "xpo": ("xpo", "XPO"),
    "nash_md": ("nash_md", "NashMD"),
}


def online_pair_case(
    ctx, kind: str, reward: str = "model", dataset: str = "standard_prompt_only", raw_eval: bool = False, **config
) -> dict:
    """The pair trainer of `kind` on 8 prompts, ranked by the tiny reward model (`reward="model"`) or by
    `recording_reward` (`"func"`); `raw_eval` evaluates on the raw test split and a dict of two instead of training.

    Models are passed as loaded modules: TRL 1.12's XPO and Nash-MD take no model paths.
    """
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    module, prefix = ONLINE_PAIR_TRAINERS[kind]
    config_cls, trainer_cls = _experimental(module, prefix)
    args = config_cls(output_dir=ctx.tmpdir(), **{**PAIR_ARGS, **config})
    RECORDED_COMPLETIONS.clear()
    if reward == "model":
        reward_funcs = AutoModelForSequenceClassification.from_pretrained(ctx.model(QWEN_RM))
        # TRL 1.12's Nash-MD takes no reward tokenizer (it scores the policy's token ids).
        reward_kwargs = {} if kind == "nash_md" else {"reward_processing_classes": tokenizer(ctx, QWEN_RM)}
    else:
        reward_funcs, reward_kwargs = recording_reward, {}
    test = ctx.dataset(dataset, "test", 8)
    trainer = trainer_cls(
        model=AutoModelForCausalLM.from_pretrained(ctx.model(QWEN)),
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=ctx.dataset(dataset, "train", 8),
        eval_dataset=test,
        processing_class=tokenizer(ctx, QWEN),
        **reward_kwargs,
    )
    if raw_eval:
        return to_jsonable(
            {
                "raw": trainer.evaluate(eval_dataset=test),
                "dict": trainer.evaluate(
                    eval_dataset={"first": test.select(range(4)), "second": test.select(range(4, 8))}
                ),
            }
        )
    out = run_trainer(trainer, evaluate=False)
    if reward == "func":
        out["completions"] = list(RECORDED_COMPLETIONS)
    return out


for _kind in ONLINE_PAIR_TRAINERS:
    _oracle = "1.16" if _kind == "online_dpo" else "1.12"

    def _register(suffix: str, _kind=_kind, _oracle=_oracle, **kwargs) -> None:
        register(f"{_kind}/{suffix}", partial(online_pair_case, kind=_kind, **kwargs), oracle=_oracle)

    _register("reward_model")
    _register("missing_eos_penalty=1.0", missing_eos_penalty=1.0)
    # A second step, where the policy no longer equals the reference (KL terms and metrics become non-zero).
    _register("max_steps=2", max_steps=2)
    if _kind == "online_dpo":
        # TRL 1.12's XPO and Nash-MD take a reward model only; 1.16's Online DPO also takes reward functions.
        _register("reward_func", reward="func")
        _register("reward_func/conversational_prompt_only", reward="func", dataset="conversational_prompt_only")
        _register("loss_type=ipo", loss_type="ipo")
        _register("beta=0.5", beta=[0.5])
    elif _kind == "xpo":
        _register("alpha=0.1", alpha=[0.1])
        _register("loss_type=ipo", loss_type="ipo")
    else:
        _register("mixture_coef=0.25", mixture_coef=[0.25])


# ---------------------------------------------------------------------------------------------------------------------
# BCO and PRM (TRL 1.12)
# ---------------------------------------------------------------------------------------------------------------------
def bco_case(ctx, dataset: str = "standard_unpaired_preference", raw_eval: bool = False, **config) -> dict:
    """BCO on 8 unpaired rows (the running reward mean `delta` starts from the first batch)."""
    config_cls, trainer_cls = _experimental("bco", "BCO")
    args = config_cls(output_dir=ctx.tmpdir(), **{**COMMON_ARGS, **config})
    test = ctx.dataset(dataset, "test", 8)
    trainer = trainer_cls(
        model=ctx.model(QWEN), args=args, train_dataset=ctx.dataset(dataset, "train", 8), eval_dataset=test
    )
    if raw_eval:
        return to_jsonable({"raw": trainer.evaluate(eval_dataset=test)})
    return run_trainer(trainer)


def prm_case(ctx, dataset: str = "standard_stepwise_supervision", raw_eval: bool = False, **config) -> dict:
    """PRM on 8 stepwise-supervision rows with the tiny token-classification model (TRL 1.12 takes no model path)."""
    from transformers import AutoModelForTokenClassification

    config_cls, trainer_cls = _experimental("prm", "PRM")
    args = config_cls(output_dir=ctx.tmpdir(), **{**COMMON_ARGS, **config})
    test = ctx.dataset(dataset, "test", 8)
    trainer = trainer_cls(
        model=AutoModelForTokenClassification.from_pretrained(ctx.model(QWEN_TOKEN_CLS)),
        args=args,
        train_dataset=ctx.dataset(dataset, "train", 8),
        eval_dataset=test,
        processing_class=tokenizer(ctx, QWEN_TOKEN_CLS),
    )
    if raw_eval:
        return to_jsonable({"raw": trainer.evaluate(eval_dataset=test)})
    return run_trainer(trainer)


register("bco/standard_unpaired_preference", bco_case, oracle="1.12")
register(
    "bco/conversational_unpaired_preference",
    partial(bco_case, dataset="conversational_unpaired_preference"),
    oracle="1.12",
)
register("bco/beta=0.5", partial(bco_case, beta=0.5), oracle="1.12")
register("bco/evaluate_raw_dataset", partial(bco_case, raw_eval=True), oracle="1.12")
register("prm/standard_stepwise_supervision", prm_case, oracle="1.12")
register("prm/train_on_last_step_only=True", partial(prm_case, train_on_last_step_only=True), oracle="1.12")
register("prm/step_separator", partial(prm_case, step_separator=" | "), oracle="1.12")
register("prm/evaluate_raw_dataset", partial(prm_case, raw_eval=True), oracle="1.12")
