"""Parity cases: Offline trainers (SFT, DPO, Reward, KTO): one builder, several scenarios; evaluate() on raw datasets and best-model tracking."""

from __future__ import annotations

from functools import partial

from . import (
    COMMON_ARGS,
    QWEN,
    QWEN_RM,
    grad_recorder,
    predict_eval_dataset,
    register,
    run_trainer,
    snapshot,
    to_jsonable,
    tokenizer,
    update_fingerprint,
)


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
    ctx,
    kind: str,
    dataset=None,
    model=None,
    n_train=8,
    peft=False,
    margin=False,
    rename=None,
    train_label=None,
    **config,
):
    """The trainer of `kind` on 8 training rows (n_train) and 8 test rows; returns (trainer, raw test split).
    `train_label` keeps only the training rows with that (unpaired) label."""
    import trl

    prefix, default_dataset, default_model = OFFLINE_TRAINERS[kind]
    dataset = dataset or default_dataset
    args = getattr(trl, f"{prefix}Config")(output_dir=ctx.tmpdir(), **{**COMMON_ARGS, **config})
    train, test = ctx.dataset(dataset, "train", n_train), ctx.dataset(dataset, "test", 8)
    if train_label is not None:
        train = train.filter(lambda row: row["label"] == train_label)
    if rename:
        train, test = train.rename_columns(rename), test.rename_columns(rename)
    if margin:
        train = train.map(lambda _, i: {"margin": 0.25 * (i % 3)}, with_indices=True)
        test = test.map(lambda _, i: {"margin": 0.25 * (i % 3)}, with_indices=True)
    kwargs = {}
    if peft:
        from peft import LoraConfig

        lora = {**TINY_LORA, **peft} if isinstance(peft, dict) else TINY_LORA  # `peft`: True, or LoRA overrides
        kwargs["peft_config"] = LoraConfig(**lora, task_type="CAUSAL_LM")
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


def predict_case(ctx, kind: str, **kwargs) -> dict:
    """`predict()` on the prepared test split: predictions, label ids and metrics (what `compute_metrics` gets)."""
    trainer, _ = build_offline(ctx, kind, **kwargs)
    return predict_eval_dataset(trainer)


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
# Without clipping, the optimizer steps each parameter in the backward pass (`fast_paths.optimizer_in_backward`).
register_offline("sft/max_grad_norm=0", "sft", max_grad_norm=0.0)
register_offline(
    "sft/max_grad_norm=0/gradient_accumulation_steps=2",
    "sft",
    max_grad_norm=0.0,
    per_device_train_batch_size=2,
    gradient_accumulation_steps=2,
)
register_offline("dpo/max_grad_norm=0", "dpo", max_grad_norm=0.0)
# NEFTune's noise is drawn per embedded position and scaled by the padded length: the batch must reach the embeddings
# in TRL's layout (no padding dropped, no rows packed, no prefixes shared).
for _kind in ("sft", "dpo", "kto", "reward"):
    register_offline(f"{_kind}/neftune_noise_alpha=5", _kind, neftune_noise_alpha=5.0)
# transformers' label smoothing (a `TrainingArguments` field) on the SFT loss.
register_offline("sft/label_smoothing_factor=0.1", "sft", label_smoothing_factor=0.1)
register_offline(
    "sft/label_smoothing_factor=0.1/packing",
    "sft",
    n_train=32,
    packing=True,
    max_length=64,
    label_smoothing_factor=0.1,
)
register_offline(
    "sft/label_smoothing_factor=0.1/gradient_accumulation_steps=2",
    "sft",
    per_device_train_batch_size=2,
    gradient_accumulation_steps=2,
    label_smoothing_factor=0.1,
)
# Packed batches (asked for) reach the embeddings packed on both sides.
register_offline(
    "sft/neftune_noise_alpha=5/packing", "sft", n_train=32, packing=True, max_length=64, neftune_noise_alpha=5.0
)
register_offline("dpo/neftune_noise_alpha=5/padding_free", "dpo", padding_free=True, neftune_noise_alpha=5.0)
# Dropout in the forward (kept by SFT: no disable_dropout): its masks are drawn per position, as NEFTune's noise.
register_offline("sft/attention_dropout=0.1", "sft", model_init_kwargs={"attention_dropout": 0.1})
register_offline("sft/attention_dropout=0.1/packing", "sft", n_train=32, packing=True, max_length=64,
                 model_init_kwargs={"attention_dropout": 0.1})  # fmt: skip
for _kind in ("dpo", "kto", "reward"):
    register_offline(
        f"{_kind}/attention_dropout=0.1/disable_dropout=False",
        _kind,
        disable_dropout=False,
        model_init_kwargs={"attention_dropout": 0.1},
    )
# LoRA's dropout draws its masks per position too.
for _kind in ("sft", "dpo", "kto"):
    register_offline(f"{_kind}/peft_lora/lora_dropout=0.1", _kind, peft={"lora_dropout": 0.1})
register_offline("sft/neftune_noise_alpha=5/padding_free", "sft", padding_free=True, max_length=None,
                 neftune_noise_alpha=5.0)  # fmt: skip
# Gradient checkpointing off, and torch's reentrant checkpoint (the layer checkpoints step aside for it).
for _kind in ("sft", "dpo", "kto"):
    register_offline(f"{_kind}/gradient_checkpointing=False", _kind, gradient_checkpointing=False)
    register_offline(f"{_kind}/use_reentrant=True", _kind, gradient_checkpointing_kwargs={"use_reentrant": True})
# With adapters, the reference is the policy with its adapters off: its pass draws noise too, so it keeps TRL's order.
register_offline("dpo/peft_lora/neftune_noise_alpha=5", "dpo", peft=True, neftune_noise_alpha=5.0)
register_offline("sft/dataset_text_field", "sft", rename={"text": "content"}, dataset_text_field="content")
register_offline("sft/tools", "sft", dataset="conversational_language_modeling_tools")
register_offline("sft/llama", "sft", dataset="conversational_language_modeling", model="tiny-LlamaForCausalLM")
register_offline("sft/peft_lora", "sft", peft=True)
# A seed other than the case's global one: the adapters' initialisation must follow `args.seed`.
register_offline("sft/peft_lora_seed=7", "sft", peft=True, seed=7)

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
# `label_smoothing` with the loss types that do not require it.
for _loss in ("sigmoid", "sigmoid_norm", "aot", "aot_unpaired", "ipo", "hinge", "bco_pair", "apo_zero"):
    register_offline(f"dpo/loss_type={_loss}/label_smoothing=0.1", "dpo", loss_type=_loss, label_smoothing=0.1)
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
# Two epochs of 8 rows: the second epoch's reference values come from the first one (reference_cache.py).
register_offline("dpo/two_epochs", "dpo", max_steps=4)
register_offline("dpo/peft_lora_two_epochs", "dpo", peft=True, max_steps=4)

# Reward
register_offline("reward/standard_preference", "reward")
register_offline("reward/center_rewards_coefficient=0.01", "reward", center_rewards_coefficient=0.01)
register_offline("reward/conversational_preference", "reward", dataset="conversational_preference")
register_offline("reward/standard_implicit_prompt_preference", "reward", dataset="standard_implicit_prompt_preference")
register_offline("reward/margin", "reward", margin=True)
# The new score head's initialisation follows `args.seed`, not the generators' state before the trainer.
register_offline("reward/seed=7", "reward", seed=7)
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
register_offline("kto/two_epochs", "kto", max_steps=4)

# Settings TRL trains with although they are unusual: accepted with a warning here, and trained to TRL's numbers
register_offline("kto/only_desirable_examples", "kto", n_train=16, train_label=True)
register_offline("kto/only_undesirable_examples", "kto", n_train=16, train_label=False)
register_offline("kto/desirable_weight=-1.0", "kto", desirable_weight=-1.0)
register_offline("dpo/beta=-0.1", "dpo", beta=-0.1)
register_offline("dpo/ld_alpha=2.0", "dpo", ld_alpha=2.0)
register_offline(
    "dpo/sync_ref_model/ref_model_mixup_alpha=2.0",
    "dpo",
    max_steps=2,
    sync_ref_model=True,
    ref_model_sync_steps=1,
    ref_model_mixup_alpha=2.0,
)
register_offline("reward/center_rewards_coefficient=-0.1", "reward", center_rewards_coefficient=-0.1)

# evaluate() on what the user passes, and keeping the best checkpoint (issue 18, sections 1 and 2)
for _kind in OFFLINE_TRAINERS:
    register(f"{_kind}/evaluate_raw_dataset", partial(evaluate_raw_case, kind=_kind))
    register(f"{_kind}/predict", partial(predict_case, kind=_kind))
# A last, partial evaluation batch (8 test pairs in batches of 3)
register(
    "reward/predict/per_device_eval_batch_size=3", partial(predict_case, kind="reward", per_device_eval_batch_size=3)
)
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
# transformers' token counter (`state.num_input_tokens_seen`, logged) and its training samplers: the batches a trainer
# hands to the loop must count as TRL's do, and the sampler must choose the same rows.
for _kind in ("sft", "dpo", "kto", "reward"):
    for _count in ("all", "non_padding"):
        register_offline(f"{_kind}/include_num_input_tokens_seen={_count}", _kind, max_steps=2,
                         include_num_input_tokens_seen=_count)  # fmt: skip
# (DPO, KTO and Reward refuse `group_by_length`: tests/parity/cases/errors_trl.py.)
register_offline("sft/train_sampling_strategy=group_by_length", "sft", max_steps=2, per_device_train_batch_size=2,
                 train_sampling_strategy="group_by_length")  # fmt: skip
register_offline("sft/include_num_input_tokens_seen=non_padding/packing", "sft", n_train=32, packing=True,
                 max_length=64, max_steps=2, include_num_input_tokens_seen="non_padding")  # fmt: skip
register_offline("sft/include_num_input_tokens_seen=all/padding_free", "sft", padding_free=True, max_length=None,
                 max_steps=2, include_num_input_tokens_seen="all")  # fmt: skip
# Fields that no other case sets.
register_offline("sft/packing/eval_packing=False", "sft", n_train=32, packing=True, max_length=64, eval_packing=False)
register_offline("sft/pad_token=eos", "sft", pad_token="<|im_end|>")
register_offline("sft/pad_token=eos/conversational", "sft", dataset="conversational_language_modeling",
                 pad_token="<|im_end|>")  # fmt: skip
register_offline("dpo/loss_type=discopop/discopop_tau=0.2", "dpo", loss_type="discopop", discopop_tau=0.2)
# (DPO's: tests/parity/cases/dpo_losses.py, with a reference that differs from the policy.)
register_offline("kto/precompute_ref_batch_size=2", "kto", precompute_ref_log_probs=True, precompute_ref_batch_size=2)
# Evaluation options of transformers' TrainingArguments that the trainers' own evaluation loops must honour.
for _kind in ("sft", "dpo", "kto", "reward"):
    register_offline(f"{_kind}/prediction_loss_only=True", _kind, prediction_loss_only=True)
    register_offline(f"{_kind}/eval_accumulation_steps=1", _kind, eval_accumulation_steps=1,
                     per_device_eval_batch_size=2)  # fmt: skip
