"""Parity cases: the experimental trainers. Online DPO against TRL 1.16 (`trl.experimental.online_dpo`); BCO, PRM, XPO
and Nash-MD against TRL 1.12 (`oracle="1.12"`), the last release this suite keeps that ships them.

Each case is the scenario of `run_trainer` (evaluate, one optimizer step, evaluate; gradients and update
fingerprinted), without the evaluations where TRL's `evaluate()` raises (Online DPO, XPO, Nash-MD, BCO: see the case
functions). The online trainers sample with a fixed seed (the sampled ids are compared through the rewards'
inputs) and rank pairs with a deterministic reward: the tiny sequence-classification model or a toy function.
"""

from __future__ import annotations

from functools import partial

from . import COMMON_ARGS, QWEN, QWEN_RM, case, predict_eval_dataset, register, run_trainer, tokenizer


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


def online_pair_case(ctx, kind: str, reward: str = "model", dataset: str = "standard_prompt_only", **config) -> dict:
    """The pair trainer of `kind` on 8 prompts, ranked by the tiny reward model (`reward="model"`) or by
    `recording_reward` (`"func"`). Training only: `evaluate()` raises in TRL (1.16's Online DPO and 1.12's XPO and
    Nash-MD run the plain transformers evaluation on prompt-only rows: ValueError "You must specify exactly one of
    input_ids or inputs_embeds").

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
    trainer = trainer_cls(
        model=AutoModelForCausalLM.from_pretrained(ctx.model(QWEN)),
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=ctx.dataset(dataset, "train", 8),
        eval_dataset=ctx.dataset(dataset, "test", 8),
        processing_class=tokenizer(ctx, QWEN),
        **reward_kwargs,
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
def bco_case(ctx, dataset: str = "standard_unpaired_preference", **config) -> dict:
    """BCO on 8 unpaired rows (the running reward mean `delta` starts from the first batch). Training only: TRL
    1.12's `evaluate()` raises under the pinned libraries (RuntimeError, `mean()` of an integer tensor)."""
    config_cls, trainer_cls = _experimental("bco", "BCO")
    args = config_cls(output_dir=ctx.tmpdir(), **{**COMMON_ARGS, **config})
    trainer = trainer_cls(
        model=ctx.model(QWEN),
        args=args,
        train_dataset=ctx.dataset(dataset, "train", 8),
        eval_dataset=ctx.dataset(dataset, "test", 8),
    )
    return run_trainer(trainer, evaluate=False)


def build_prm(ctx, dataset: str = "standard_stepwise_supervision", **config):
    """PRM on 8 stepwise-supervision rows with the tiny token-classification model (TRL 1.12 takes no model path)."""
    from transformers import AutoModelForTokenClassification

    config_cls, trainer_cls = _experimental("prm", "PRM")
    args = config_cls(output_dir=ctx.tmpdir(), **{**COMMON_ARGS, **config})
    return trainer_cls(
        model=AutoModelForTokenClassification.from_pretrained(ctx.model(QWEN_TOKEN_CLS)),
        args=args,
        train_dataset=ctx.dataset(dataset, "train", 8),
        eval_dataset=ctx.dataset(dataset, "test", 8),
        processing_class=tokenizer(ctx, QWEN_TOKEN_CLS),
    )


def prm_case(ctx, **kwargs) -> dict:
    return run_trainer(build_prm(ctx, **kwargs))


register("bco/standard_unpaired_preference", bco_case, oracle="1.12")
register(
    "bco/conversational_unpaired_preference",
    partial(bco_case, dataset="conversational_unpaired_preference"),
    oracle="1.12",
)
register("bco/beta=0.5", partial(bco_case, beta=0.5), oracle="1.12")
register("prm/standard_stepwise_supervision", prm_case, oracle="1.12")
register("prm/train_on_last_step_only=True", partial(prm_case, train_on_last_step_only=True), oracle="1.12")
register("prm/step_separator", partial(prm_case, step_separator=" | "), oracle="1.12")
register("prm/predict", lambda ctx: predict_eval_dataset(build_prm(ctx)), oracle="1.12")


# ---------------------------------------------------------------------------------------------------------------------
# Model utilities: hash_module, GRPO's cast_lm_head_to_fp32 with tied and untied embeddings
# ---------------------------------------------------------------------------------------------------------------------
@case("data_utils/hash_module")
def _hash_module(ctx) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from trl.trainer.utils import hash_module

    torch.manual_seed(0)
    modules = {
        "linear": torch.nn.Linear(3, 2),
        "batchnorm": torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2)),  # an int64 buffer
        "bfloat16": torch.nn.Linear(2, 2).to(torch.bfloat16),
        "float16": torch.nn.Linear(2, 2).to(torch.float16),
        "empty": torch.nn.Module(),
        "tiny_qwen2": AutoModelForCausalLM.from_pretrained(ctx.model(QWEN)),
    }
    return {name: hash_module(module) for name, module in modules.items()}


def cast_lm_head_case(ctx, tied: bool) -> dict:
    """GRPO with `cast_lm_head_to_fp32=True` on a bfloat16 policy: dtypes of the head and the embeddings, whether
    they still share their weight, and the step's loss."""
    import torch
    from transformers import AutoModelForCausalLM

    import trl

    model = AutoModelForCausalLM.from_pretrained(ctx.model(QWEN), tie_word_embeddings=tied, dtype=torch.bfloat16)
    args = trl.GRPOConfig(
        output_dir=ctx.tmpdir(),
        **{**COMMON_ARGS, "per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 4},
        cast_lm_head_to_fp32=True,
    )

    def reward(completions, **kwargs):
        return [float(len(c)) for c in completions]

    trainer = trl.GRPOTrainer(
        model=model, reward_funcs=reward, args=args, train_dataset=ctx.dataset("standard_prompt_only", "train", 4)
    )
    model = trainer.model
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    out = {
        "lm_head_dtype": str(head.weight.dtype),
        "embed_dtype": str(embed.weight.dtype),
        "shared": head.weight is embed.weight,
        "config_tie_word_embeddings": model.config.tie_word_embeddings,
    }
    trainer.train()
    out.update(
        lm_head_dtype_after=str(head.weight.dtype),
        shared_after=model.get_output_embeddings().weight is model.get_input_embeddings().weight,
    )
    return out


register("grpo/cast_lm_head_to_fp32/tied", partial(cast_lm_head_case, tied=True))
register("grpo/cast_lm_head_to_fp32/untied", partial(cast_lm_head_case, tied=False))
