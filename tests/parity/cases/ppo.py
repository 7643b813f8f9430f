"""Parity cases: PPO and the value-head models (`trl.experimental.ppo`) against TRL 1.12, the last release with them.

Trainer cases: the tiny Qwen2 policy, the tiny sequence-classification model as reward and value model, 8 tokenized
prompts (left-padded), responses of 8 tokens, `total_episodes=8` with 4 prompts a step (two updates). TRL's PPO has
no `evaluate()` of its own (the plain transformers one fails on prompt-only rows) and calls no optimizer-step
callbacks, so the cases record the log history and the update. `eps` (episodes per second) is a timing and is
dropped. `max_grad_norm` is left at its default in every case but `ppo/max_grad_norm_set`: TRL ignores the field (never
clips); here an unset `max_grad_norm` does not clip either, and one the user sets clips (a deliberate deviation).
"""

from __future__ import annotations

from functools import partial

from . import COMMON_ARGS, QWEN, QWEN_RM, expect_error, register, snapshot, to_jsonable, update_fingerprint


PPO_ARGS = {
    **{k: v for k, v in COMMON_ARGS.items() if k != "max_steps"},
    "total_episodes": 8,
    "response_length": 8,
    "num_ppo_epochs": 2,
    "num_mini_batches": 2,
}


def _ppo():
    import importlib

    return importlib.import_module("trl.experimental.ppo")


def _tokenized_prompts(ctx, tokenizer, split: str):
    data = ctx.dataset("standard_prompt_only", split, 8)
    return data.map(lambda row: tokenizer(row["prompt"]), remove_columns=data.column_names)


def _scorer(ctx):
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(ctx.model(QWEN_RM), num_labels=1)


def ppo_case(ctx, with_ref_model: bool = True, **config) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ppo = _ppo()
    tokenizer = AutoTokenizer.from_pretrained(ctx.model(QWEN), padding_side="left")
    args = ppo.PPOConfig(output_dir=ctx.tmpdir(), **{**PPO_ARGS, **config})
    trainer = ppo.PPOTrainer(
        args=args,
        processing_class=tokenizer,
        model=AutoModelForCausalLM.from_pretrained(ctx.model(QWEN)),
        ref_model=AutoModelForCausalLM.from_pretrained(ctx.model(QWEN)) if with_ref_model else None,
        reward_model=_scorer(ctx),
        train_dataset=_tokenized_prompts(ctx, tokenizer, "train"),
        value_model=_scorer(ctx),
        eval_dataset=_tokenized_prompts(ctx, tokenizer, "test"),
    )
    derived = {
        name: getattr(args, name)
        for name in ("batch_size", "local_batch_size", "mini_batch_size", "local_mini_batch_size", "num_total_batches")
    }
    before = snapshot(trainer.model)
    trainer.train()
    history = [{k: v for k, v in entry.items() if k != "eps"} for entry in trainer.state.log_history]
    return to_jsonable(
        {
            "derived": derived,
            "global_step": trainer.state.global_step,
            "log_history": history,
            "update": update_fingerprint(before, trainer.model),
        }
    )


register("ppo/default", ppo_case, oracle="1.12")
register("ppo/no_ref_model", partial(ppo_case, with_ref_model=False), oracle="1.12")
register("ppo/kl_estimator=k3", partial(ppo_case, kl_estimator="k3", kl_coef=0.5), oracle="1.12")
# TRL needs at least 8 prompts per mini-batch to whiten rewards: one mini-batch of 8.
register(
    "ppo/whiten_rewards",
    partial(ppo_case, whiten_rewards=True, gamma=0.9, lam=0.8, per_device_train_batch_size=8, num_mini_batches=1),
    oracle="1.12",
)
register(
    "ppo/stop_token=eos",
    partial(ppo_case, stop_token="eos", missing_eos_penalty=1.0, temperature=1.5, response_length=16),
    oracle="1.12",
)
register(
    "ppo/gradient_accumulation_steps=2",
    partial(ppo_case, per_device_train_batch_size=2, gradient_accumulation_steps=2, num_mini_batches=1),
    oracle="1.12",
)
register(
    "ppo/cliprange",
    partial(ppo_case, cliprange=0.05, cliprange_value=0.05, vf_coef=1.0, num_ppo_epochs=3),
    oracle="1.12",
)
register("ppo/max_grad_norm_set", partial(ppo_case, max_grad_norm=1.0), oracle="1.12")


def _same_model_as_ref(ctx) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ppo = _ppo()
    tokenizer = AutoTokenizer.from_pretrained(ctx.model(QWEN), padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(ctx.model(QWEN))
    return expect_error(
        lambda: ppo.PPOTrainer(
            args=ppo.PPOConfig(output_dir=ctx.tmpdir(), **PPO_ARGS),
            processing_class=tokenizer,
            model=policy,
            ref_model=policy,
            reward_model=_scorer(ctx),
            train_dataset=_tokenized_prompts(ctx, tokenizer, "train"),
            value_model=_scorer(ctx),
        )
    )


register(
    "ppo/errors/ref_model_is_model",
    _same_model_as_ref,
    phrases=("`model` and `ref_model` cannot be the same object. If you want `ref_model` to be the same as `model`",),
    oracle="1.12",
)


# ---------------------------------------------------------------------------------------------------------------------
# Value-head models
# ---------------------------------------------------------------------------------------------------------------------
def _value_head_forward(ctx, **kwargs) -> dict:
    import torch

    ppo = _ppo()
    model = ppo.AutoModelForCausalLMWithValueHead.from_pretrained(ctx.model(QWEN), **kwargs).eval()
    ids = torch.tensor([[5, 17, 301, 42, 7], [9, 8, 7, 6, 5]])
    logits, loss, values = model(ids, attention_mask=torch.ones_like(ids))
    _, lm_loss, _ = model(ids, labels=ids)
    return to_jsonable(
        {
            "logits_dtype": str(logits.dtype),
            "logits_shape": list(logits.shape),
            "logits_sum": logits.double().sum().item(),
            "loss": loss,
            "lm_loss": lm_loss.item(),
            "values": values,
            "dropout": type(model.v_head.dropout).__name__,
            "bias": model.v_head.summary.bias,
            "weight_sum": model.v_head.summary.weight.double().sum().item(),
            "state_dict_tail": list(model.state_dict())[-2:],
        }
    )


def _value_head_save_format(ctx, peft: bool = False) -> dict:
    import os

    import torch

    ppo = _ppo()
    kwargs = {}
    if peft:
        from peft import LoraConfig

        kwargs["peft_config"] = LoraConfig(r=4, target_modules=["q_proj"])
    model = ppo.AutoModelForCausalLMWithValueHead.from_pretrained(ctx.model(QWEN), **kwargs)
    directory = ctx.tmpdir()
    model.save_pretrained(directory)
    files = sorted(f for f in os.listdir(directory) if f != "README.md")
    out = {"files": files, "is_peft_model": model.is_peft_model}
    if peft:
        out["head_file_keys"] = sorted(torch.load(os.path.join(directory, "pytorch_model.bin")))
    else:
        from safetensors import safe_open

        with safe_open(os.path.join(directory, "model.safetensors"), "pt") as f:
            out["weight_file_keys"] = sorted(f.keys())
    reloaded = ppo.AutoModelForCausalLMWithValueHead.from_pretrained(directory)
    out["reloaded_head_equal"] = bool(torch.equal(reloaded.v_head.summary.weight, model.v_head.summary.weight))
    out["reloaded_is_peft_model"] = reloaded.is_peft_model
    return to_jsonable(out)


def _seq2seq_forward(ctx) -> dict:
    import torch

    ppo = _ppo()
    model = ppo.AutoModelForSeq2SeqLMWithValueHead.from_pretrained(ctx.model("tiny-T5ForConditionalGeneration"))
    model.eval()
    logits, loss, values = model(input_ids=torch.tensor([[1, 2, 3, 4]]), decoder_input_ids=torch.tensor([[0, 5, 6]]))
    return to_jsonable({"logits_shape": list(logits.shape), "loss": loss, "values_shape": list(values.shape)})


register("ppo/value_head/forward", _value_head_forward, oracle="1.12")
register(
    "ppo/value_head/forward_options",
    partial(
        _value_head_forward, summary_dropout_prob=0.0, v_head_init_strategy="normal", v_head_initializer_range=0.5
    ),
    oracle="1.12",
)
register("ppo/value_head/save_format", _value_head_save_format, oracle="1.12")
register("ppo/value_head/save_format_peft", partial(_value_head_save_format, peft=True), oracle="1.12")
register("ppo/value_head/seq2seq_forward", _seq2seq_forward, oracle="1.12")
# Fields that no other case sets: the rollout's scoring chunk, a stop token given by id, and the sample generations.
register("ppo/local_rollout_forward_batch_size=2", partial(ppo_case, local_rollout_forward_batch_size=2),
         oracle="1.12")  # fmt: skip
register("ppo/stop_token_id", partial(ppo_case, stop_token_id=5, missing_eos_penalty=1.0, temperature=1.5,
         response_length=16), oracle="1.12")  # fmt: skip
register("ppo/num_sample_generations=2", partial(ppo_case, num_sample_generations=2), oracle="1.12")
