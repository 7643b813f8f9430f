"""Parity cases: each one exercises TRL's public API on the tiny offline assets and returns a JSON-able dict.

This module is imported by `worker.py` twice, once in `.venv-parity` (real `trl==1.16.0`) and once with this
project's `trl`, so it must only use API that both share (the contract in `shared/api/`): no `trl.assets`, no private
helpers, nothing imported from this project at module level. Asset paths arrive through the worker's `Ctx`.

A case is registered with `@case(name)` or `register(name, fn)`; `name` starts with its group (`sft/`, `dpo/`, ...),
which the docs' pass-count table uses. Case outputs are compared key by key by `compare.py`.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any


# ---------------------------------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class Case:
    name: str
    fn: Callable[[Any], dict]
    # For cases that expect an exception: phrases that must appear (case-insensitively) in both messages.
    phrases: tuple[str, ...] = field(default_factory=tuple)

    @property
    def group(self) -> str:
        return self.name.split("/", 1)[0]


CASES: dict[str, Case] = {}


def register(name: str, fn: Callable[[Any], dict], phrases: tuple[str, ...] = ()) -> None:
    if name in CASES or "," in name or "[" in name:
        raise ValueError(f"parity case name {name!r} is taken or holds ',' or '['")
    CASES[name] = Case(name, fn, tuple(phrases))


def case(name: str, phrases: tuple[str, ...] = ()):
    def decorator(fn):
        register(name, fn, phrases)
        return fn

    return decorator


# ---------------------------------------------------------------------------------------------------------------------
# Shared settings and helpers
# ---------------------------------------------------------------------------------------------------------------------
QWEN = "tiny-Qwen2ForCausalLM"
QWEN_RM = "tiny-Qwen2ForSequenceClassification"

# Settings every trainer case shares: one logged optimizer step on CPU in fp32, nothing saved, no reporting.
COMMON_ARGS = dict(
    seed=0,
    bf16=False,
    fp16=False,
    use_cpu=True,
    report_to="none",
    dataloader_num_workers=0,
    save_strategy="no",
    disable_tqdm=True,
    logging_steps=1,
    max_steps=1,
    per_device_train_batch_size=4,
    per_device_eval_batch_size=4,
    # Large enough that one AdamW step moves every parameter visibly (the fingerprint compares the update).
    learning_rate=1e-3,
)


def to_jsonable(value: Any) -> Any:
    """Tensors, numpy values, tuples and dataclass-like objects turned into plain JSON types."""
    import numpy as np
    import torch

    if isinstance(value, torch.Tensor):
        return to_jsonable(value.detach().cpu().tolist())
    if isinstance(value, np.ndarray):
        return to_jsonable(value.tolist())
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def exception_record(exc: BaseException) -> dict:
    return {"type": type(exc).__name__, "message": str(exc)}


def expect_error(fn: Callable[[], Any]) -> dict:
    """Run `fn`; the output is the exception it raised (type and message), or `{"raised": None}`."""
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - the exception is the case's output
        return {"exception": exception_record(exc)}
    if result is None or isinstance(result, (bool, int, float, str, dict, list)):
        return {"raised": None, "result": to_jsonable(result)}
    return {"raised": None, "result_type": type(result).__name__}


def snapshot(model) -> dict:
    import torch

    return {n: p.detach().to(torch.float64).clone() for n, p in model.named_parameters() if p.requires_grad}


def tensor_stats(name: str, tensor) -> dict:
    """`sum`, `l2`, `maxabs` and `proj` (projection on a fixed random direction seeded by the name) in float64."""
    import torch

    t = tensor.detach().to(torch.float64)
    direction = torch.randn(t.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())), dtype=t.dtype)
    return {
        "sum": t.sum().item(),
        "l2": t.norm().item(),
        "maxabs": t.abs().max().item(),
        "proj": (t * direction).sum().item(),
    }


def update_fingerprint(before: dict, model) -> dict:
    """Per trainable parameter, the size of its update (after - before): `l2` and `maxabs`, float64.

    Only sizes: an AdamW step moves each element by about lr * sign(grad), so an element whose gradient is float noise
    can flip sign between two faithful implementations. Where the gradients point is compared by `grads`.
    """
    import torch

    out = {}
    for name, p in model.named_parameters():
        if name in before:
            delta = p.detach().to(torch.float64) - before[name]
            out[name] = {"l2": delta.norm().item(), "maxabs": delta.abs().max().item()}
    return out


def grad_recorder(trainer) -> list:
    """Attach a callback recording `tensor_stats` of every gradient at each optimizer step (after clipping)."""
    from transformers import TrainerCallback

    steps: list[dict] = []

    class GradRecorder(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            steps.append({n: tensor_stats(n, p.grad) for n, p in model.named_parameters() if p.grad is not None})

    trainer.add_callback(GradRecorder())
    return steps


def column_names(dataset) -> str | None:
    """Sorted column names as one string (one comparison line per dataset rather than one per position)."""
    names = getattr(dataset, "column_names", None)
    return ",".join(sorted(names)) if names is not None else None


def run_trainer(trainer, *, evaluate: bool = True) -> dict:
    """The standard trainer scenario: evaluate, train (logging every step), evaluate again; the gradients at each
    optimizer step (`grads`) and the size of the whole update (`update`) fingerprint the training."""
    out = {"train_columns": column_names(trainer.train_dataset)}
    if evaluate:
        out["eval_columns"] = column_names(trainer.eval_dataset)
        out["eval_before"] = trainer.evaluate()
    before = snapshot(trainer.model)
    grads = grad_recorder(trainer)
    result = trainer.train()
    out["train_output"] = {"global_step": result.global_step, "training_loss": result.training_loss}
    out["train_metrics"] = result.metrics
    if evaluate:
        out["eval_after"] = trainer.evaluate()
    out["log_history"] = trainer.state.log_history
    out["grads"] = grads
    out["update"] = update_fingerprint(before, trainer.model)
    return to_jsonable(out)


def tokenizer(ctx, name: str = QWEN):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ctx.model(name))


# ---------------------------------------------------------------------------------------------------------------------
# Offline trainers (SFT, DPO, Reward, KTO): one builder, several scenarios
# ---------------------------------------------------------------------------------------------------------------------
# group -> (trainer/config name prefix, default dataset, default model)
OFFLINE_TRAINERS = {
    "sft": ("SFT", "standard_language_modeling", QWEN),
    "dpo": ("DPO", "standard_preference", QWEN),
    "reward": ("Reward", "standard_preference", QWEN_RM),
    "kto": ("KTO", "standard_unpaired_preference", QWEN),
}
TINY_LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])


def build_offline(
    ctx, kind: str, dataset=None, model=None, n_train=8, peft=False, margin=False, rename=None, **config
):
    """The trainer of `kind` on 8 training rows (n_train) and 8 test rows; returns (trainer, raw test split)."""
    import trl

    prefix, default_dataset, default_model = OFFLINE_TRAINERS[kind]
    dataset = dataset or default_dataset
    args = getattr(trl, f"{prefix}Config")(output_dir=ctx.tmpdir(), **{**COMMON_ARGS, **config})
    train, test = ctx.dataset(dataset, "train", n_train), ctx.dataset(dataset, "test", 8)
    if rename:
        train, test = train.rename_columns(rename), test.rename_columns(rename)
    if margin:
        train = train.map(lambda _, i: {"margin": 0.25 * (i % 3)}, with_indices=True)
        test = test.map(lambda _, i: {"margin": 0.25 * (i % 3)}, with_indices=True)
    kwargs = {}
    if peft:
        from peft import LoraConfig

        kwargs["peft_config"] = LoraConfig(**TINY_LORA, task_type="CAUSAL_LM")
    trainer = getattr(trl, f"{prefix}Trainer")(
        model=ctx.model(model or default_model), args=args, train_dataset=train, eval_dataset=test, **kwargs
    )
    return trainer, test


def offline_case(ctx, kind: str, **kwargs) -> dict:
    """Evaluate, train one step, evaluate, fingerprint the update (see `run_trainer`)."""
    trainer, _ = build_offline(ctx, kind, **kwargs)
    return run_trainer(trainer)


def evaluate_raw_case(ctx, kind: str, **kwargs) -> dict:
    """`evaluate(eval_dataset=...)` with the raw (unprepared) test split and with a dict of two raw datasets."""
    trainer, test = build_offline(ctx, kind, **kwargs)
    return to_jsonable(
        {
            "raw": trainer.evaluate(eval_dataset=test),
            "dict": trainer.evaluate(
                eval_dataset={"first": test.select(range(4)), "second": test.select(range(4, 8))}
            ),
        }
    )


def best_model_case(ctx, kind: str, metric: str, greater_is_better: bool = True, **kwargs) -> dict:
    """Two steps, evaluated and saved after each, keeping the best checkpoint by `metric`."""
    import os

    config = dict(
        max_steps=2,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=1,
        load_best_model_at_end=True,
        metric_for_best_model=metric,
        greater_is_better=greater_is_better,
    )
    trainer, _ = build_offline(ctx, kind, **config, **kwargs)
    before = snapshot(trainer.model)
    grads = grad_recorder(trainer)
    result = trainer.train()
    state = trainer.state
    return to_jsonable(
        {
            "train_metrics": result.metrics,
            "best_metric": state.best_metric,
            "best_global_step": getattr(state, "best_global_step", None),
            "best_checkpoint": os.path.basename(state.best_model_checkpoint or ""),
            "log_history": state.log_history,
            "grads": grads,
            "update": update_fingerprint(before, trainer.model),
        }
    )


def register_offline(name: str, kind: str, **kwargs) -> None:
    register(name, partial(offline_case, kind=kind, **kwargs))


# SFT
register_offline("sft/standard_language_modeling", "sft")
register_offline("sft/conversational_language_modeling", "sft", dataset="conversational_language_modeling")
register_offline("sft/standard_prompt_completion", "sft", dataset="standard_prompt_completion")
register_offline(
    "sft/completion_only_loss=True", "sft", dataset="standard_prompt_completion", completion_only_loss=True
)
register_offline(
    "sft/completion_only_loss=False", "sft", dataset="standard_prompt_completion", completion_only_loss=False
)
register_offline("sft/conversational_prompt_completion", "sft", dataset="conversational_prompt_completion")
register_offline("sft/packing_strategy=bfd", "sft", n_train=32, packing=True, packing_strategy="bfd", max_length=64)
register_offline(
    "sft/packing_strategy=bfd_split", "sft", n_train=32, packing=True, packing_strategy="bfd_split", max_length=16
)
register_offline(
    "sft/packing_strategy=wrapped", "sft", n_train=32, packing=True, packing_strategy="wrapped", max_length=32
)
register_offline("sft/padding_free=True", "sft", padding_free=True, max_length=None)
register_offline("sft/loss_type=dft", "sft", loss_type="dft")
register_offline("sft/max_length=8", "sft", dataset="conversational_language_modeling", max_length=8)
register_offline(
    "sft/gradient_accumulation_steps=2", "sft", per_device_train_batch_size=2, gradient_accumulation_steps=2
)
register_offline("sft/dataset_text_field", "sft", rename={"text": "content"}, dataset_text_field="content")
register_offline("sft/tools", "sft", dataset="conversational_language_modeling_tools")
register_offline("sft/llama", "sft", dataset="conversational_language_modeling", model="tiny-LlamaForCausalLM")
register_offline("sft/peft_lora", "sft", peft=True)

# A ChatML template with `{% generation %}` markers, so that `assistant_only_loss` has assistant masks to use.
CHATML_TRAINING_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def sft_training_template_case(ctx, **config) -> dict:
    import os

    path = os.path.join(ctx.tmpdir(), "chatml_training.jinja")
    with open(path, "w") as f:
        f.write(CHATML_TRAINING_TEMPLATE)
    return offline_case(ctx, "sft", dataset="conversational_language_modeling", chat_template_path=path, **config)


register("sft/assistant_only_loss=True", partial(sft_training_template_case, assistant_only_loss=True))
register("sft/chat_template_path", sft_training_template_case)


def sft_pretokenized_case(ctx, mask_column: str, **config) -> dict:
    """Hand-tokenized prompt-completion rows with a `completion_mask` or `assistant_masks` column (no raw text)."""
    import trl

    tok = tokenizer(ctx, QWEN)

    def tokenize(example):
        prompt = tok(example["prompt"])["input_ids"]
        full = tok(example["prompt"] + example["completion"])["input_ids"]
        return {"input_ids": full, mask_column: [0] * len(prompt) + [1] * (len(full) - len(prompt))}

    def prepare(split):
        return ctx.dataset("standard_prompt_completion", split, 8).map(
            tokenize, remove_columns=["prompt", "completion"]
        )

    args = trl.SFTConfig(output_dir=ctx.tmpdir(), **{**COMMON_ARGS, **config})
    trainer = trl.SFTTrainer(
        model=ctx.model(QWEN), args=args, train_dataset=prepare("train"), eval_dataset=prepare("test")
    )
    return run_trainer(trainer)


register("sft/pretokenized_completion_mask", partial(sft_pretokenized_case, mask_column="completion_mask"))
register(
    "sft/pretokenized_completion_mask/completion_only_loss=True",
    partial(sft_pretokenized_case, mask_column="completion_mask", completion_only_loss=True),
)
register("sft/pretokenized_assistant_masks", partial(sft_pretokenized_case, mask_column="assistant_masks"))


def sft_prompt_tuning_case(ctx, dataset: str = "standard_language_modeling", **config) -> dict:
    """PEFT prompt tuning (4 virtual tokens): the virtual tokens shift the logits by 4 positions."""
    from peft import PromptTuningConfig, TaskType

    import trl

    args = trl.SFTConfig(output_dir=ctx.tmpdir(), **{**COMMON_ARGS, **config})
    trainer = trl.SFTTrainer(
        model=ctx.model(QWEN),
        args=args,
        train_dataset=ctx.dataset(dataset, "train", 8),
        eval_dataset=ctx.dataset(dataset, "test", 8),
        peft_config=PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4),
    )
    return run_trainer(trainer)


register("sft/peft_prompt_tuning", sft_prompt_tuning_case)
register(
    "sft/peft_prompt_tuning/prompt_completion", partial(sft_prompt_tuning_case, dataset="standard_prompt_completion")
)

# DPO: every loss type of the contract, combinations, f-divergences, data layouts and options
DPO_LOSS_TYPES = [
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
]
# Loss types that need a non-zero label_smoothing.
_DPO_LABEL_SMOOTHING = {"exo_pair": 0.1, "robust": 0.1}

for _loss in DPO_LOSS_TYPES:
    _extra = {"label_smoothing": _DPO_LABEL_SMOOTHING[_loss]} if _loss in _DPO_LABEL_SMOOTHING else {}
    register_offline(f"dpo/loss_type={_loss}", "dpo", loss_type=_loss, **_extra)
register_offline("dpo/loss_type=sigmoid+sft", "dpo", loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5])
register_offline(
    "dpo/loss_type=sigmoid+bco_pair+sft", "dpo", loss_type=["sigmoid", "bco_pair", "sft"], loss_weights=[0.8, 0.2, 1.0]
)
for _f in ["forward_kl", "js_divergence", "alpha_divergence"]:
    register_offline(f"dpo/f_divergence_type={_f}", "dpo", f_divergence_type=_f)
register_offline("dpo/conversational_preference", "dpo", dataset="conversational_preference")
register_offline("dpo/standard_implicit_prompt_preference", "dpo", dataset="standard_implicit_prompt_preference")
register_offline(
    "dpo/conversational_implicit_prompt_preference", "dpo", dataset="conversational_implicit_prompt_preference"
)
register_offline("dpo/use_weighting=True", "dpo", use_weighting=True)
register_offline("dpo/ld_alpha=0.5", "dpo", ld_alpha=0.5)
register_offline("dpo/beta=0.5", "dpo", beta=0.5)
register_offline("dpo/precompute_ref_log_probs=True", "dpo", precompute_ref_log_probs=True)
register_offline("dpo/max_length=8", "dpo", max_length=8)
register_offline(
    "dpo/gradient_accumulation_steps=2", "dpo", per_device_train_batch_size=2, gradient_accumulation_steps=2
)
register_offline("dpo/llama", "dpo", dataset="conversational_preference", model="tiny-LlamaForCausalLM")
register_offline("dpo/peft_lora", "dpo", peft=True)

# Reward
register_offline("reward/standard_preference", "reward")
register_offline("reward/center_rewards_coefficient=0.01", "reward", center_rewards_coefficient=0.01)
register_offline("reward/conversational_preference", "reward", dataset="conversational_preference")
register_offline("reward/standard_implicit_prompt_preference", "reward", dataset="standard_implicit_prompt_preference")
register_offline("reward/margin", "reward", margin=True)
register_offline(
    "reward/llama", "reward", dataset="conversational_preference", model="tiny-LlamaForSequenceClassification"
)

# KTO
register_offline("kto/loss_type=kto", "kto")
register_offline("kto/loss_type=apo_zero_unpaired", "kto", loss_type="apo_zero_unpaired")
register_offline("kto/conversational_unpaired_preference", "kto", dataset="conversational_unpaired_preference")
register_offline("kto/paired_standard_preference", "kto", dataset="standard_preference")
register_offline("kto/desirable_weight=1.2", "kto", desirable_weight=1.2, undesirable_weight=1.0)
register_offline("kto/precompute_ref_log_probs=True", "kto", precompute_ref_log_probs=True)
register_offline("kto/llama", "kto", dataset="conversational_unpaired_preference", model="tiny-LlamaForCausalLM")
register_offline("kto/max_length=12", "kto", max_length=12)
register_offline(
    "kto/gradient_accumulation_steps=2", "kto", per_device_train_batch_size=2, gradient_accumulation_steps=2
)
register_offline("kto/per_device_batch_size=3", "kto", per_device_train_batch_size=3, per_device_eval_batch_size=3)
register_offline("kto/beta=0.5", "kto", beta=0.5, n_train=16)
register_offline("kto/paired_conversational_preference", "kto", dataset="conversational_preference")
register_offline("kto/peft_lora", "kto", peft=True)

# evaluate() on what the user passes, and keeping the best checkpoint (issue 18, sections 1 and 2)
for _kind in OFFLINE_TRAINERS:
    register(f"{_kind}/evaluate_raw_dataset", partial(evaluate_raw_case, kind=_kind))
register(
    "sft/load_best_model_at_end/eval_loss",
    partial(best_model_case, kind="sft", metric="eval_loss", greater_is_better=False),
)
register(
    "sft/load_best_model_at_end/eval_mean_token_accuracy",
    partial(best_model_case, kind="sft", metric="eval_mean_token_accuracy"),
)
register(
    "dpo/load_best_model_at_end/eval_rewards/accuracies",
    partial(best_model_case, kind="dpo", metric="eval_rewards/accuracies"),
)
register(
    "reward/load_best_model_at_end/eval_accuracy", partial(best_model_case, kind="reward", metric="eval_accuracy")
)
register(
    "kto/load_best_model_at_end/eval_rewards/chosen",
    partial(best_model_case, kind="kto", metric="eval_rewards/chosen"),
)

# ---------------------------------------------------------------------------------------------------------------------
# GRPO and RLOO: a toy reward over several steps
# ---------------------------------------------------------------------------------------------------------------------
# Every call of the toy reward records the completion ids it received, so a case can compare the sampled tokens.
RECORDED_COMPLETION_IDS: list[list[list[int]]] = []


def toy_reward(completions, completion_ids, **kwargs) -> list[float]:
    """Fraction of completion tokens whose id is a multiple of 4 (base rate about 0.25 for a random policy)."""
    ids = [[int(t) for t in row] for row in completion_ids]
    RECORDED_COMPLETION_IDS.append(ids)
    return [sum(1 for t in row if t % 4 == 0) / max(len(row), 1) for row in ids]


ONLINE_ARGS = dict(
    COMMON_ARGS,
    per_device_train_batch_size=8,
    per_device_eval_batch_size=8,
    num_generations=8,
    max_completion_length=8,
    learning_rate=3e-3,
)


def length_reward(completions, completion_ids, **kwargs) -> list[float]:
    """A second toy reward: completion length in tokens over 8."""
    return [len(ids) / 8 for ids in completion_ids]


def online_case(
    ctx,
    trainer_name: str,
    *,
    max_steps: int = 3,
    evaluate: str | None = None,
    dataset: str = "standard_prompt_only",
    reward_funcs=None,
    **config,
) -> dict:
    """A GRPO/RLOO run on the toy reward: `max_steps` logged steps, or an evaluation when `evaluate` is set
    (`"init"`: the eval split given to the constructor, `"raw"`: passed to `evaluate()`)."""
    import trl

    config_cls = getattr(trl, f"{trainer_name}Config")
    trainer_cls = getattr(trl, f"{trainer_name}Trainer")
    args = config_cls(output_dir=ctx.tmpdir(), **{**ONLINE_ARGS, "max_steps": max_steps, **config})
    RECORDED_COMPLETION_IDS.clear()
    test = ctx.dataset(dataset, "test", 2)
    trainer = trainer_cls(
        model=ctx.model(QWEN),
        reward_funcs=reward_funcs or toy_reward,
        args=args,
        train_dataset=ctx.dataset(dataset, "train", 16),
        eval_dataset=test if evaluate == "init" else None,
    )
    if evaluate:
        metrics = trainer.evaluate() if evaluate == "init" else trainer.evaluate(eval_dataset=test)
        return {"eval": to_jsonable(metrics), "completion_ids": list(RECORDED_COMPLETION_IDS)}
    out = run_trainer(trainer, evaluate=False)
    out["completion_ids"] = list(RECORDED_COMPLETION_IDS)
    return out


register("grpo/toy_reward", partial(online_case, trainer_name="GRPO"))
register("grpo/evaluate", partial(online_case, trainer_name="GRPO", evaluate="init"))
register("grpo/evaluate_raw_dataset", partial(online_case, trainer_name="GRPO", evaluate="raw"))
register(
    "grpo/conversational_prompt_only",
    partial(online_case, trainer_name="GRPO", max_steps=1, dataset="conversational_prompt_only"),
)
register(
    "grpo/reward_weights",
    partial(
        online_case,
        trainer_name="GRPO",
        max_steps=1,
        reward_funcs=[toy_reward, length_reward],
        reward_weights=[1.0, 0.5],
    ),
)
register("grpo/num_iterations=2", partial(online_case, trainer_name="GRPO", max_steps=2, num_iterations=2))
register(
    "grpo/importance_sampling_level=sequence",
    partial(online_case, trainer_name="GRPO", max_steps=1, importance_sampling_level="sequence"),
)
register(
    "grpo/mask_truncated_completions=True",
    partial(online_case, trainer_name="GRPO", max_steps=1, mask_truncated_completions=True),
)
for _loss in ["grpo", "dr_grpo", "bnpo", "cispo", "sapo", "vespo"]:
    register(f"grpo/loss_type={_loss}", partial(online_case, trainer_name="GRPO", max_steps=1, loss_type=_loss))
register(
    "grpo/loss_type=luspo",
    partial(online_case, trainer_name="GRPO", max_steps=1, loss_type="luspo", importance_sampling_level="sequence"),
)
register("grpo/beta=0.04", partial(online_case, trainer_name="GRPO", max_steps=2, beta=0.04))
register("grpo/scale_rewards=batch", partial(online_case, trainer_name="GRPO", max_steps=1, scale_rewards="batch"))
# Issue 30: with top_k=0 passed through generation_kwargs, sampling is untruncated here too; these isolate the rest of
# the rollout and loss path from the sampling-parameter difference.
register(
    "grpo/toy_reward/generation_kwargs=top_k0",
    partial(online_case, trainer_name="GRPO", generation_kwargs={"top_k": 0}),
)
register("rloo/toy_reward", partial(online_case, trainer_name="RLOO"))
register(
    "rloo/toy_reward/generation_kwargs=top_k0",
    partial(online_case, trainer_name="RLOO", generation_kwargs={"top_k": 0}),
)
register("rloo/evaluate", partial(online_case, trainer_name="RLOO", evaluate="init"))
register(
    "rloo/conversational_prompt_only",
    partial(online_case, trainer_name="RLOO", max_steps=1, dataset="conversational_prompt_only"),
)
register(
    "rloo/normalize_advantages=True",
    partial(online_case, trainer_name="RLOO", max_steps=1, normalize_advantages=True),
)
register("rloo/beta=0", partial(online_case, trainer_name="RLOO", max_steps=1, beta=0.0))
# Off-policy steps (the second pass over a rollout): clip metrics and the ratio-dependent losses.
register("rloo/num_iterations=2", partial(online_case, trainer_name="RLOO", max_steps=2, num_iterations=2))
for _loss in ["cispo", "sapo", "vespo"]:
    register(
        f"grpo/loss_type={_loss}/num_iterations=2",
        partial(online_case, trainer_name="GRPO", max_steps=2, num_iterations=2, loss_type=_loss),
    )
# Completions of different lengths: the end-of-sequence token (id 4091 in the tiny Qwen2 tokenizer) made likely.
EOS_BIAS = {"sequence_bias": [[[4091], 6.0]]}
register("grpo/eos_bias", partial(online_case, trainer_name="GRPO", max_steps=2, generation_kwargs=EOS_BIAS))
register("rloo/eos_bias", partial(online_case, trainer_name="RLOO", generation_kwargs=EOS_BIAS))
for _name in ["GRPO", "RLOO"]:
    register(
        f"{_name.lower()}/eos_bias/num_iterations=2",
        partial(online_case, trainer_name=_name, max_steps=2, num_iterations=2, generation_kwargs=EOS_BIAS),
    )


RECORDED_PROMPTS: list[list[str]] = []


def prompt_recording_reward(prompts, completions, completion_ids, **kwargs) -> list[float]:
    """The toy reward, also recording the prompts it is given (their order shows how the stream was read)."""
    RECORDED_PROMPTS.append(list(prompts))
    return toy_reward(completions, completion_ids)


def online_stream_case(ctx, trainer_name: str, **config) -> dict:
    """Training and evaluation on streaming datasets: 6 prompts in 2 shards, shuffled, read through 2 dataloader
    workers for 6 steps (two epochs, so the per-epoch reshuffle shows), then `evaluate()` on a stream and on a dict
    holding a stream and a map-style dataset."""
    import trl

    config_cls = getattr(trl, f"{trainer_name}Config")
    trainer_cls = getattr(trl, f"{trainer_name}Trainer")
    settings = dict(
        ONLINE_ARGS,
        max_steps=6,
        per_device_train_batch_size=4,
        num_generations=2,
        per_device_eval_batch_size=2,
        num_generations_eval=2,
        max_completion_length=4,
        dataloader_num_workers=2,
    )
    args = config_cls(output_dir=ctx.tmpdir(), **{**settings, **config})
    RECORDED_COMPLETION_IDS.clear()
    RECORDED_PROMPTS.clear()
    train = ctx.dataset("standard_prompt_only", "train", 6).to_iterable_dataset(num_shards=2)
    test = ctx.dataset("standard_prompt_only", "test", 3)
    trainer = trainer_cls(
        model=ctx.model(QWEN),
        reward_funcs=prompt_recording_reward,
        args=args,
        train_dataset=train.shuffle(seed=1, buffer_size=4),
        eval_dataset=test.to_iterable_dataset(),
    )
    trainer.train()
    out = {"log_history": to_jsonable(trainer.state.log_history), "train_prompts": list(RECORDED_PROMPTS)}
    RECORDED_PROMPTS.clear()
    out["eval"] = to_jsonable(trainer.evaluate())
    out["eval_dict"] = to_jsonable(trainer.evaluate(eval_dataset={"stream": test.to_iterable_dataset(), "map": test}))
    out["eval_prompts"] = list(RECORDED_PROMPTS)
    out["completion_ids"] = list(RECORDED_COMPLETION_IDS)
    return out


for _name in ["GRPO", "RLOO"]:
    register(f"{_name.lower()}/iterable_dataset", partial(online_stream_case, trainer_name=_name))
register(
    "grpo/iterable_dataset/shuffle_dataset=False",
    partial(online_stream_case, trainer_name="GRPO", shuffle_dataset=False),
)


BEAM_SEARCH = {"num_beams": 2, "do_sample": False}
for _name in ["GRPO", "RLOO"]:
    register(
        f"{_name.lower()}/generation_kwargs=beam_search",
        partial(online_case, trainer_name=_name, max_steps=1, generation_kwargs=BEAM_SEARCH),
    )
    register(
        f"{_name.lower()}/num_generations_eval=1",
        partial(online_case, trainer_name=_name, evaluate="init", num_generations_eval=1),
    )


@case("grpo/error/one_reward_processing_class_for_two_reward_models", phrases=("must match",))
def _err_reward_processing_classes(ctx):
    from transformers import AutoTokenizer

    import trl

    args = trl.GRPOConfig(output_dir=ctx.tmpdir(), **{**ONLINE_ARGS, "num_generations": 2})
    return expect_error(
        lambda: trl.GRPOTrainer(
            model=ctx.model(QWEN),
            reward_funcs=[ctx.model(QWEN_RM), ctx.model(QWEN_RM)],
            reward_processing_classes=AutoTokenizer.from_pretrained(ctx.model(QWEN_RM)),
            args=args,
            train_dataset=ctx.dataset("standard_prompt_only", "train", 4),
        )
    )


def none_reward(completions, **kwargs) -> list:
    """A reward that never applies."""
    return [None] * len(completions)


register(
    "grpo/undefined_metrics",
    partial(
        online_case,
        trainer_name="GRPO",
        max_steps=1,
        reward_funcs=[toy_reward, none_reward],
        mask_truncated_completions=True,
    ),
)


# ---------------------------------------------------------------------------------------------------------------------
# Data utilities (trl.data_utils, trl.chat_template_utils)
# ---------------------------------------------------------------------------------------------------------------------
def _rows(dataset) -> list[dict]:
    return to_jsonable(dataset.to_list())


def chat_template_case(ctx, dataset: str, tokenizer_name: str = "qwen2_5") -> dict:
    from transformers import AutoTokenizer

    from trl import apply_chat_template, maybe_apply_chat_template

    tok = AutoTokenizer.from_pretrained(ctx.tokenizer(tokenizer_name))
    rows = ctx.dataset(dataset, "train", 4).to_list()
    return to_jsonable(
        {
            "apply": [apply_chat_template(row, tok) for row in rows],
            "maybe_apply": [maybe_apply_chat_template(row, tok) for row in rows],
        }
    )


for _ds in [
    "conversational_language_modeling",
    "conversational_prompt_only",
    "conversational_prompt_completion",
    "conversational_preference",
    "conversational_implicit_prompt_preference",
    "conversational_unpaired_preference",
]:
    register(f"data_utils/apply_chat_template/{_ds}", partial(chat_template_case, dataset=_ds))
register(
    "data_utils/apply_chat_template/llama3/conversational_preference",
    partial(chat_template_case, dataset="conversational_preference", tokenizer_name="llama3"),
)


@case("data_utils/apply_chat_template/tools")
def _apply_chat_template_tools(ctx):
    from transformers import AutoTokenizer

    from trl import apply_chat_template

    tok = AutoTokenizer.from_pretrained(ctx.tokenizer("qwen2_5"))
    rows = ctx.dataset("conversational_language_modeling_tools", "train", 3).to_list()
    return to_jsonable([apply_chat_template({"messages": r["messages"]}, tok, tools=r["tools"]) for r in rows])


@case("data_utils/maybe_apply_chat_template/standard")
def _maybe_apply_standard(ctx):
    from trl import maybe_apply_chat_template

    tok = tokenizer(ctx)
    rows = ctx.dataset("standard_preference", "train", 3).to_list()
    return to_jsonable([maybe_apply_chat_template(row, tok) for row in rows])


@case("data_utils/is_conversational")
def _is_conversational(ctx):
    from trl import is_conversational

    out = {}
    for name in [
        "standard_language_modeling",
        "standard_preference",
        "conversational_language_modeling",
        "conversational_prompt_only",
        "conversational_unpaired_preference",
    ]:
        out[name] = is_conversational(ctx.dataset(name, "train", 1)[0])
    return out


@case("data_utils/extract_prompt")
def _extract_prompt(ctx):
    from trl import extract_prompt, maybe_extract_prompt

    out = {}
    for name in ["standard_implicit_prompt_preference", "conversational_implicit_prompt_preference"]:
        ds = ctx.dataset(name, "train", 4)
        out[name] = [extract_prompt(row) for row in ds.to_list()]
        out[f"{name}/map"] = _rows(ds.map(maybe_extract_prompt))
    explicit = ctx.dataset("standard_preference", "train", 2)
    out["explicit_unchanged"] = _rows(explicit.map(maybe_extract_prompt))
    return to_jsonable(out)


@case("data_utils/unpair_preference_dataset")
def _unpair(ctx):
    from trl import maybe_unpair_preference_dataset, unpair_preference_dataset

    out = {}
    for name in ["standard_preference", "conversational_preference"]:
        ds = ctx.dataset(name, "train", 4)
        out[name] = _rows(unpair_preference_dataset(ds))
        out[f"{name}/maybe"] = _rows(maybe_unpair_preference_dataset(ds))
    unpaired = ctx.dataset("standard_unpaired_preference", "train", 2)
    out["unpaired_unchanged"] = _rows(maybe_unpair_preference_dataset(unpaired))
    return out


def _tokenized_lm(ctx, n: int = 16):
    tok = tokenizer(ctx)
    ds = ctx.dataset("standard_language_modeling", "train", n)
    return ds.map(lambda row: {"input_ids": tok(row["text"])["input_ids"]}, remove_columns=["text"])


for _strategy in ["bfd", "bfd_split", "wrapped"]:

    def _pack(ctx, strategy=_strategy):
        from trl import pack_dataset

        ds = _tokenized_lm(ctx)
        packed = pack_dataset(ds, seq_length=12, strategy=strategy)
        return {"columns": sorted(packed.column_names), "rows": _rows(packed)}

    register(f"data_utils/pack_dataset/strategy={_strategy}", _pack)


@case("data_utils/pack_dataset/torch_format")
def _pack_torch_format(ctx):
    from trl import pack_dataset

    ds = _tokenized_lm(ctx, 8).with_format("torch")
    packed = pack_dataset(ds, seq_length=10, strategy="bfd")
    return {"format": packed.format["type"], "columns": sorted(packed.column_names), "first": to_jsonable(packed[0])}


@case("data_utils/maybe_convert_to_chatml")
def _convert_to_chatml(ctx):
    from trl import is_conversational_from_value, maybe_convert_to_chatml

    example = {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "user", "value": "What is 2 + 2?"},
            {"from": "assistant", "value": "4"},
        ]
    }
    return {"is_from_value": is_conversational_from_value(example), "converted": maybe_convert_to_chatml(example)}


@case("data_utils/prepare_multimodal_messages")
def _prepare_multimodal(ctx):
    from trl import prepare_multimodal_messages

    messages = ctx.dataset("conversational_language_modeling", "train", 1)[0]["messages"]
    return to_jsonable(prepare_multimodal_messages(messages, images=["IMG0", "IMG1"]))


@case("data_utils/common_prefix_length")
def _common_prefix(ctx):
    from trl.data_utils import common_prefix_length

    return {
        "partial": common_prefix_length([1, 2, 3, 4], [1, 2, 5]),
        "equal": common_prefix_length([1, 2], [1, 2]),
        "none": common_prefix_length([3], [1, 2]),
        "empty": common_prefix_length([], [1]),
    }


@case("chat_template_utils/inspection")
def _template_inspection(ctx):
    from transformers import AutoTokenizer

    from trl import supports_tool_calling
    from trl.chat_template_utils import (
        has_generation_markers,
        is_chat_template_prefix_preserving,
        is_chat_template_stop_token_trained,
    )

    out = {}
    for name in ["qwen2_5", "llama3"]:
        tok = AutoTokenizer.from_pretrained(ctx.tokenizer(name))
        out[name] = {
            "has_generation_markers": has_generation_markers(tok.chat_template),
            "supports_tool_calling": supports_tool_calling(tok),
            "prefix_preserving": is_chat_template_prefix_preserving(tok),
            "stop_token_trained": is_chat_template_stop_token_trained(tok),
        }
    return out


def _training_template(ctx, tokenizer_name: str) -> dict:
    from transformers import AutoTokenizer

    from trl import get_training_chat_template
    from trl.chat_template_utils import has_generation_markers

    messages = ctx.dataset("conversational_language_modeling", "train", 1)[0]["messages"]
    tok = AutoTokenizer.from_pretrained(ctx.tokenizer(tokenizer_name))

    def run():
        template = get_training_chat_template(tok)
        if template is None:
            return {"returned": None}
        rendered = tok.apply_chat_template(
            messages, chat_template=template, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        plain = tok.apply_chat_template(messages, tokenize=True, return_dict=True)
        return {
            "has_generation_markers": has_generation_markers(template),
            "same_ids_as_template": list(rendered["input_ids"]) == list(plain["input_ids"]),
            "assistant_masks": list(rendered["assistant_masks"]),
        }

    return expect_error(run)


for _tok in ["qwen2_5", "llama3"]:
    register(
        f"chat_template_utils/get_training_chat_template/{_tok}", partial(_training_template, tokenizer_name=_tok)
    )


@case("chat_template_utils/clone_chat_template")
def _clone_template(ctx):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl import clone_chat_template

    model = AutoModelForCausalLM.from_pretrained(ctx.model(QWEN))
    tok = AutoTokenizer.from_pretrained(ctx.model(QWEN))
    model, tok, added = clone_chat_template(model, tok, ctx.tokenizer("llama3"))
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    return to_jsonable(
        {
            "added_count": len(added),
            "vocab": len(tok),
            "embeddings": model.get_input_embeddings().weight.shape[0],
            "eos_token": tok.eos_token,
            "eos_token_id": model.config.eos_token_id,
            "rendered": tok.apply_chat_template(messages, tokenize=False),
        }
    )


@case("chat_template_utils/add_response_schema")
def _response_schema(ctx):
    from transformers import AutoTokenizer

    from trl import add_response_schema

    return {
        name: expect_error(lambda name=name: add_response_schema(AutoTokenizer.from_pretrained(ctx.tokenizer(name))))
        for name in ["qwen2_5", "llama3"]
    }


@case("chat_template_utils/parse_response")
def _parse_response(ctx):
    from transformers import AutoTokenizer

    from trl.chat_template_utils import parse_response

    tok = AutoTokenizer.from_pretrained(ctx.tokenizer("qwen2_5"))
    texts = [
        "The answer is 4.<|im_end|>",
        '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>',
    ]
    return {str(i): expect_error(lambda t=t: parse_response(tok, tok(t)["input_ids"])) for i, t in enumerate(texts)}


# ---------------------------------------------------------------------------------------------------------------------
# Public collators: batch keys, shapes and values
# ---------------------------------------------------------------------------------------------------------------------
def _batch(batch) -> dict:
    import torch

    return {
        k: {"shape": list(v.shape), "dtype": str(v.dtype), "values": to_jsonable(v)}
        if isinstance(v, torch.Tensor)
        else {"type": type(v).__name__, "value": to_jsonable(v)}
        for k, v in batch.items()
    }


_LM_EXAMPLES = [
    {"input_ids": [1, 2, 3]},
    {"input_ids": [4, 5]},
    {"input_ids": [6, 7, 8, 9]},
]
_LM_EXAMPLES_MASKED = [
    {"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1]},
    {"input_ids": [4, 5], "completion_mask": [0, 1]},
]


def lm_collator_case(ctx, examples=None, **kwargs) -> dict:
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    collator = DataCollatorForLanguageModeling(pad_token_id=0, **kwargs)
    return _batch(collator(examples or _LM_EXAMPLES))


register("collators/lm/default", lm_collator_case)
register("collators/lm/padding_free", partial(lm_collator_case, padding_free=True))
register("collators/lm/return_position_ids", partial(lm_collator_case, return_position_ids=True))
register("collators/lm/pad_to_multiple_of=8", partial(lm_collator_case, pad_to_multiple_of=8))
register("collators/lm/completion_mask", partial(lm_collator_case, examples=_LM_EXAMPLES_MASKED))
register(
    "collators/lm/seq_lengths",
    partial(lm_collator_case, examples=[{"input_ids": [1, 2, 3, 4, 5], "seq_lengths": [2, 3]}], padding_free=True),
)


_PREF_EXAMPLES = [
    {"prompt_ids": [1, 2, 3], "chosen_ids": [4, 5], "rejected_ids": [6]},
    {"prompt_ids": [7], "chosen_ids": [8], "rejected_ids": [9, 10, 11]},
]


def dpo_collator_case(ctx, **kwargs) -> dict:
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    return _batch(DataCollatorForPreference(pad_token_id=0, **kwargs)(_PREF_EXAMPLES))


register("collators/dpo/default", dpo_collator_case)
register("collators/dpo/max_length=3", partial(dpo_collator_case, max_length=3))
register("collators/dpo/max_length=3/keep_end", partial(dpo_collator_case, max_length=3, truncation_mode="keep_end"))
register("collators/dpo/pad_to_multiple_of=4", partial(dpo_collator_case, pad_to_multiple_of=4))


def reward_collator_case(ctx, margin: bool = False) -> dict:
    from trl.trainer.reward_trainer import DataCollatorForPreference

    examples = [
        {"chosen_ids": [1, 2, 3], "rejected_ids": [4, 5]},
        {"chosen_ids": [6], "rejected_ids": [7, 8, 9, 10]},
    ]
    if margin:
        examples = [{**e, "margin": m} for e, m in zip(examples, [0.5, 1.5])]
    return _batch(DataCollatorForPreference(pad_token_id=0)(examples))


register("collators/reward/default", reward_collator_case)
register("collators/reward/margin", partial(reward_collator_case, margin=True))


def kto_collator_case(ctx, examples) -> dict:
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

    return _batch(DataCollatorForUnpairedPreference(pad_token_id=0)(examples))


register(
    "collators/kto/kl_and_reference",
    partial(
        kto_collator_case,
        examples=[
            {
                "prompt_ids": [1, 2],
                "completion_ids": [3],
                "label": True,
                "KL_completion_ids": [5, 6, 7],
                "ref_logps": -1.5,
                "ref_KL_logps": -4.0,
            },
            {
                "prompt_ids": [4],
                "completion_ids": [5, 6, 7],
                "label": False,
                "KL_completion_ids": [3],
                "ref_logps": -2.5,
                "ref_KL_logps": -3.0,
            },
        ],
    ),
)
register(
    "collators/kto/default",
    partial(
        kto_collator_case,
        examples=[
            {"prompt_ids": [1, 2], "completion_ids": [3], "label": True},
            {"prompt_ids": [4], "completion_ids": [5, 6, 7], "label": False},
        ],
    ),
)


# ---------------------------------------------------------------------------------------------------------------------
# Bad inputs: exception type and key phrase
# ---------------------------------------------------------------------------------------------------------------------
@case("errors/dpo_loss_weights_length", phrases=("loss_weights",))
def _err_loss_weights(ctx):
    from trl import DPOConfig

    return expect_error(
        lambda: DPOConfig(output_dir=ctx.tmpdir(), loss_type=["sigmoid", "sft"], loss_weights=[1.0], report_to="none")
    )


@case("errors/grpo_num_generations=1", phrases=("at least 2",))
def _err_num_generations(ctx):
    from trl import GRPOConfig

    return expect_error(
        lambda: GRPOConfig(output_dir=ctx.tmpdir(), num_generations=1, report_to="none", use_cpu=True, bf16=False)
    )


@case("errors/grpo_generation_batch_size", phrases=("generation_batch_size",))
def _err_generation_batch_size(ctx):
    from trl import GRPOConfig

    return expect_error(
        lambda: GRPOConfig(
            output_dir=ctx.tmpdir(),
            per_device_train_batch_size=3,
            num_generations=2,
            report_to="none",
            use_cpu=True,
            bf16=False,
        )
    )


@case("errors/pack_dataset_strategy", phrases=("strategy",))
def _err_pack_strategy(ctx):
    from trl import pack_dataset

    return expect_error(lambda: pack_dataset(_tokenized_lm(ctx, 2), seq_length=8, strategy="first_fit"))


@case("errors/apply_chat_template_keys")
def _err_chat_template_keys(ctx):
    from trl import apply_chat_template

    tok = tokenizer(ctx)
    return expect_error(lambda: apply_chat_template({"question": [{"role": "user", "content": "Hi"}]}, tok))


@case("errors/dpo_ref_model_is_model")
def _err_ref_is_model(ctx):
    from transformers import AutoModelForCausalLM

    from trl import DPOConfig, DPOTrainer

    model = AutoModelForCausalLM.from_pretrained(ctx.model(QWEN))
    args = DPOConfig(output_dir=ctx.tmpdir(), **COMMON_ARGS)
    return expect_error(
        lambda: DPOTrainer(
            model=model, ref_model=model, args=args, train_dataset=ctx.dataset("standard_preference", "train", 4)
        )
    )


@case("errors/dpo_exo_pair_without_label_smoothing")
def _err_exo_pair(ctx):
    from trl import DPOConfig, DPOTrainer

    def build():
        args = DPOConfig(output_dir=ctx.tmpdir(), loss_type="exo_pair", **COMMON_ARGS)
        return DPOTrainer(
            model=ctx.model(QWEN), args=args, train_dataset=ctx.dataset("standard_preference", "train", 4)
        )

    return expect_error(build)


@case("errors/dpo_f_divergence_with_apo_zero")
def _err_f_divergence(ctx):
    from trl import DPOConfig, DPOTrainer

    def build():
        args = DPOConfig(output_dir=ctx.tmpdir(), loss_type="apo_zero", f_divergence_type="forward_kl", **COMMON_ARGS)
        return DPOTrainer(
            model=ctx.model(QWEN), args=args, train_dataset=ctx.dataset("standard_preference", "train", 4)
        )

    return expect_error(build)


@case("errors/reward_num_labels=2")
def _err_reward_num_labels(ctx):
    from transformers import AutoModelForSequenceClassification

    from trl import RewardConfig, RewardTrainer

    model = AutoModelForSequenceClassification.from_pretrained(
        ctx.model(QWEN_RM), num_labels=2, ignore_mismatched_sizes=True
    )
    args = RewardConfig(output_dir=ctx.tmpdir(), **COMMON_ARGS)
    return expect_error(
        lambda: RewardTrainer(model=model, args=args, train_dataset=ctx.dataset("standard_preference", "train", 4))
    )


@case("errors/sft_train_dataset=None")
def _err_sft_no_dataset(ctx):
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=ctx.tmpdir(), **COMMON_ARGS)
    return expect_error(lambda: SFTTrainer(model=ctx.model(QWEN), args=args, train_dataset=None))


@case("errors/sft_completion_only_loss_on_lm_data")
def _err_sft_completion_only(ctx):
    from trl import SFTConfig, SFTTrainer

    def build():
        args = SFTConfig(output_dir=ctx.tmpdir(), completion_only_loss=True, **COMMON_ARGS)
        trainer = SFTTrainer(
            model=ctx.model(QWEN), args=args, train_dataset=ctx.dataset("standard_language_modeling", "train", 4)
        )
        trainer.train()

    return expect_error(build)


@case("errors/sft_padding_free_without_packing_with_max_length", phrases=("max_length",))
def _err_sft_padding_free_max_length(ctx):
    from trl import SFTConfig, SFTTrainer

    def build():
        args = SFTConfig(output_dir=ctx.tmpdir(), padding_free=True, **COMMON_ARGS)
        return SFTTrainer(
            model=ctx.model(QWEN), args=args, train_dataset=ctx.dataset("standard_language_modeling", "train", 4)
        )

    return expect_error(build)


@case("errors/sft_skip_prepare_dataset_raw_text", phrases=("forward method signature",))
def _err_sft_skip_prepare_raw(ctx):
    from trl import SFTConfig, SFTTrainer

    def build():
        args = SFTConfig(output_dir=ctx.tmpdir(), dataset_kwargs={"skip_prepare_dataset": True}, **COMMON_ARGS)
        trainer = SFTTrainer(
            model=ctx.model(QWEN), args=args, train_dataset=ctx.dataset("standard_language_modeling", "train", 4)
        )
        trainer.train()

    return expect_error(build)


@case("errors/sft_assistant_only_loss_on_standard_data")
def _err_sft_assistant_only(ctx):
    from trl import SFTConfig, SFTTrainer

    def build():
        args = SFTConfig(output_dir=ctx.tmpdir(), assistant_only_loss=True, **COMMON_ARGS)
        return SFTTrainer(
            model=ctx.model(QWEN), args=args, train_dataset=ctx.dataset("standard_language_modeling", "train", 4)
        )

    return expect_error(build)


@case("errors/sft_assistant_only_loss_template_without_markers")
def _err_sft_assistant_only_template(ctx):
    from trl import SFTConfig, SFTTrainer

    def build():
        args = SFTConfig(output_dir=ctx.tmpdir(), assistant_only_loss=True, **COMMON_ARGS)
        return SFTTrainer(
            model=ctx.model(QWEN),
            args=args,
            train_dataset=ctx.dataset("conversational_language_modeling", "train", 4),
        )

    return expect_error(build)


@case("errors/kto_loss_type_unknown")
def _err_kto_loss_type(ctx):
    from trl import KTOConfig

    return expect_error(lambda: KTOConfig(output_dir=ctx.tmpdir(), loss_type="sigmoid", report_to="none"))


# ---------------------------------------------------------------------------------------------------------------------
# Deliberate deviations (listed in known_divergences.DELIBERATE_DEVIATIONS and docs/parity.md)
# ---------------------------------------------------------------------------------------------------------------------
@case("deviations/bf16_default_on_cpu")
def _bf16_default_on_cpu(ctx):
    from trl import SFTConfig

    return {
        "default": expect_error(lambda: SFTConfig(output_dir=ctx.tmpdir(), report_to="none").bf16),
        "use_cpu": expect_error(lambda: SFTConfig(output_dir=ctx.tmpdir(), report_to="none", use_cpu=True).bf16),
    }
