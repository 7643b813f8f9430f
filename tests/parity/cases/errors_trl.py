"""Parity cases: TRL's error texts, one case per message, as a table.

Each row builds a config (or a config and a trainer, and trains it when the check fires at `train()`) with one bad
setting. Both sides must raise the same exception type, and the row's phrase (TRL's own sentence, as real TRL printed
it) must appear in both messages: this project puts TRL's sentence first and its own guidance after it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from . import COMMON_ARGS, QWEN, QWEN_RM, expect_error, register


_CONFIG_ARGS = dict(report_to="none", use_cpu=True, bf16=False)
_ONLINE = dict(num_generations=2, max_completion_length=4)


def _resolve(path: str) -> Any:
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def _length_reward(completions, **kwargs):
    return [float(len(str(completion))) for completion in completions]


def _tokenizer(ctx):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ctx.model(QWEN))


def _lora(ctx):
    from peft import LoraConfig

    return LoraConfig(r=4, target_modules=["q_proj"])


def config(path: str, **kwargs) -> Callable:
    """A case that builds the config class at `path` with `kwargs`."""
    return lambda ctx: expect_error(lambda: _resolve(path)(output_dir=ctx.tmpdir(), **_CONFIG_ARGS, **kwargs))


def trainer(
    trainer_path: str,
    config_path: str,
    *,
    data: str | None = "standard_preference",
    model: str = QWEN,
    train: bool = False,
    args: dict | None = None,
    same_ref: bool = False,
    **extra: Any,
) -> Callable:
    """A case that builds `config_path(**args)` and the trainer at `trainer_path` on four rows of `data`, and trains
    it when `train`. Keyword values that are callables are called with the context (reward functions excepted);
    `same_ref` passes the policy instance as `ref_model` too."""

    def build(ctx):
        from transformers import AutoModelForCausalLM

        def run():
            config_args = _resolve(config_path)(output_dir=ctx.tmpdir(), **{**COMMON_ARGS, **(args or {})})
            kwargs = {k: v if k == "reward_funcs" or not callable(v) else v(ctx) for k, v in extra.items()}
            policy: Any = ctx.model(model)
            if same_ref:
                policy = AutoModelForCausalLM.from_pretrained(ctx.model(model))
                kwargs["ref_model"] = policy
            dataset = ctx.dataset(data, "train", 4) if data is not None else None
            instance = _resolve(trainer_path)(model=policy, args=config_args, train_dataset=dataset, **kwargs)
            if train:
                instance.train()

        return expect_error(run)

    return build


def online(pair: tuple[str, str], *, train: bool = False, extra: dict | None = None, **args: Any) -> Callable:
    """`trainer()` for GRPO/RLOO on prompt-only data with a length reward and two generations of four tokens; `args`
    go to the config, `extra` to the trainer."""
    return trainer(
        *pair,
        data="standard_prompt_only",
        reward_funcs=_length_reward,
        args=dict(_ONLINE, **args),
        train=train,
        **(extra or {}),
    )


def _pair(module: str, name: str) -> tuple[str, str]:
    return f"{module}.{name}Trainer", f"{module}.{name}Config"


SFT, DPO, KTO, REWARD, GRPO, RLOO = (_pair("trl", name) for name in ("SFT", "DPO", "KTO", "Reward", "GRPO", "RLOO"))
CPO, ORPO, ONLINE_DPO, BCO, PRM, XPO, NASH_MD = (
    _pair(f"trl.experimental.{module}", name)
    for module, name in (
        ("cpo", "CPO"),
        ("orpo", "ORPO"),
        ("online_dpo", "OnlineDPO"),
        ("bco", "BCO"),
        ("prm", "PRM"),
        ("xpo", "XPO"),
        ("nash_md", "NashMD"),
    )
)

_GROUP_SIZES = dict(per_device_train_batch_size=4, num_generations=2)
_REQUIRED = "`train_dataset` is required"
# transformers' length-grouped sampler reads `input_ids`, which the preference trainers' rows do not have.
_NO_LENGTHS = "Can only automatically infer lengths for datasets whose items are dictionaries with an 'input_ids' key."
_PAD_MULTIPLE = "invalid literal for int() with base 10: 'abc'"
_TRUNCATION = "Unsupported truncation mode: middle, expected 'keep_start' or 'keep_end'"
_SAME_OBJECT = (
    "`model` and `ref_model` cannot be the same object. In most cases you should omit `ref_model` and we'll "
    "initialize it to a copy of `model` for you."
)
_SYNC_AND_PRECOMPUTE = (
    "You cannot use `sync_ref_model=True` together with `precompute_ref_log_probs=True`. "
    "`precompute_ref_log_probs=True` assumes a fixed reference model, but with `sync_ref_model=True` the reference "
    "model is periodically updated during training, making any precomputed reference log-probs stale. Set "
    "`precompute_ref_log_probs=False` or disable `sync_ref_model`."
)


def _sync_with_peft(name: str) -> str:
    return (
        "You passed `sync_ref_model=True` while using a PEFT model, which is currently not supported. With PEFT, "
        f"{name} does not keep a separate reference model in memory; instead, it recovers reference behavior by "
        "temporarily disabling the adapter. As a result, there is no standalone `ref_model` instance to synchronize. "
        "Use `sync_ref_model=False`, or opt for full fine-tuning if you need a synced reference model."
    )


def _min_generations(method: str) -> str:
    return (
        f"{method} requires at least 2 generations per prompt to calculate the advantages. You provided 1, which is "
        "less than the minimum required."
    )


def _auto_find(method: str) -> str:
    return (
        f"auto_find_batch_size is not supported by {method}, because the generation batch must contain full prompt "
        "groups of num_generations completions, and reducing the batch size on out-of-memory breaks this invariant. "
        "Set auto_find_batch_size=False and lower per_device_train_batch_size instead."
    )


_VLLM = (
    "vLLM is not available and `use_vllm` is set to True. Please install vLLM with `pip install trl[vllm]` to use it."
)
_TEMPERATURE = (
    "`temperature` (=0.0) has to be a strictly positive float, otherwise your next token scores will be invalid. If "
    "you're looking for greedy decoding strategies, set `do_sample=False`."
)
_RPC = "The number of reward processing classes (2) must match the number of reward functions (1)."

# (case name under errors/, TRL's sentence, case builder[, oracle])
TABLE: list[tuple] = [
    # ---- configs ------------------------------------------------------------------------------------------------
    ("sft_config/pad_to_multiple_of", _PAD_MULTIPLE, config("trl.SFTConfig", pad_to_multiple_of="abc")),
    ("dpo_config/pad_to_multiple_of", _PAD_MULTIPLE, config("trl.DPOConfig", pad_to_multiple_of="abc")),
    ("kto_config/pad_to_multiple_of", _PAD_MULTIPLE, config("trl.KTOConfig", pad_to_multiple_of="abc")),
    (
        "grpo_config/pad_to_multiple_of",
        _PAD_MULTIPLE,
        config("trl.GRPOConfig", pad_to_multiple_of="abc", **_GROUP_SIZES),
    ),
    (
        "dpo_config/loss_weights_length",
        "`loss_weights` must have the same length as `loss_type` when combining multiple losses. Got 1 weights for 2 "
        "loss types.",
        config("trl.DPOConfig", loss_type=["sigmoid", "sft"], loss_weights=[1.0]),
    ),
    (
        "dpo_config/rpo_alpha_removed",
        "got an unexpected keyword argument 'rpo_alpha'",
        config("trl.DPOConfig", rpo_alpha=0.5),
    ),
    ("grpo_config/num_generations=1", _min_generations("GRPO"), config("trl.GRPOConfig", num_generations=1)),
    ("rloo_config/num_generations=1", _min_generations("RLOO"), config("trl.RLOOConfig", num_generations=1)),
    *[
        (
            f"{method.lower()}_config/generation_batch_not_multiple_of_group",
            "generation_batch_size (3) must be divisible by num_generations (2).",
            config(f"trl.{method}Config", per_device_train_batch_size=3, num_generations=2),
        )
        for method in ("GRPO", "RLOO")
    ],
    *[
        (
            f"{method.lower()}_config/generation_batch_and_steps_per_generation",
            "'generation_batch_size' and 'steps_per_generation' can not be both configured at the same time",
            config(f"trl.{method}Config", generation_batch_size=8, steps_per_generation=2, **_GROUP_SIZES),
        )
        for method in ("GRPO", "RLOO")
    ],
    *[
        (
            f"{method.lower()}_config/generation_batch_not_multiple_of_global_batch",
            "generation_batch_size (6) must be divisible by the global batch size (4).",
            config(f"trl.{method}Config", generation_batch_size=6, **_GROUP_SIZES),
        )
        for method in ("GRPO", "RLOO")
    ],
    *[
        (
            f"{method.lower()}_config/eval_batch_not_multiple_of_group",
            "The global eval batch size (3 * 1) must be divisible by the number of generations used for evaluation "
            "(4).",
            config(
                f"trl.{method}Config",
                per_device_train_batch_size=4,
                num_generations=4,
                eval_strategy="steps",
                per_device_eval_batch_size=3,
            ),
        )
        for method in ("GRPO", "RLOO")
    ],
    *[
        (
            f"{method.lower()}_config/auto_find_batch_size",
            _auto_find(method),
            config(f"trl.{method}Config", auto_find_batch_size=True, **_GROUP_SIZES),
        )
        for method in ("GRPO", "RLOO")
    ],
    (
        "grpo_config/log_completions_hub_repo_without_log_completions",
        "log_completions_hub_repo is set, but log_completions is False. Enable log_completions to upload completions "
        "to the Hub, or unset log_completions_hub_repo.",
        config("trl.GRPOConfig", log_completions_hub_repo="user/completions", **_GROUP_SIZES),
    ),
    (
        "grpo_config/importance_sampling_clip_order",
        "vllm_importance_sampling_clip_min (3.0) must be less than vllm_importance_sampling_clip_max (2.0).",
        config(
            "trl.GRPOConfig",
            vllm_importance_sampling_mode="token_truncate",
            vllm_importance_sampling_clip_min=3.0,
            vllm_importance_sampling_clip_max=2.0,
            **_GROUP_SIZES,
        ),
    ),
    (
        "sdft_config/generation_batch_not_multiple_of_group",
        "generation_batch_size (3) must be divisible by num_generations (2).",
        config("trl.experimental.sdft.SDFTConfig", per_device_train_batch_size=3, num_generations=2),
    ),
    (
        "gold_config/lmbda_range",
        "lmbda must be in the range [0.0, 1.0].",
        config("trl.experimental.gold.GOLDConfig", lmbda=2.0),
        "1.12",
    ),
    # ---- trainers: the training dataset ------------------------------------------------------------------------
    ("sft/train_dataset=None", _REQUIRED, trainer(*SFT, data=None)),
    ("dpo/train_dataset=None", _REQUIRED, trainer(*DPO, data=None)),
    ("kto/train_dataset=None", _REQUIRED, trainer(*KTO, data=None)),
    ("reward/train_dataset=None", _REQUIRED, trainer(*REWARD, model=QWEN_RM, data=None)),
    (
        "grpo/train_dataset=None",
        "`train_dataset` is required unless an `environment_factory` is provided.",
        trainer(*GRPO, data=None, reward_funcs=_length_reward, args=_ONLINE),
    ),
    ("rloo/train_dataset=None", _REQUIRED, trainer(*RLOO, data=None, reward_funcs=_length_reward, args=_ONLINE)),
    ("cpo/train_dataset=None", _REQUIRED, trainer(*CPO, data=None)),
    ("orpo/train_dataset=None", _REQUIRED, trainer(*ORPO, data=None)),
    ("online_dpo/train_dataset=None", _REQUIRED, trainer(*ONLINE_DPO, data=None, reward_funcs=_length_reward)),
    ("bco/train_dataset=None", _REQUIRED, trainer(*BCO, data=None), "1.12"),
    ("xpo/train_dataset=None", _REQUIRED, trainer(*XPO, data=None, reward_funcs=_length_reward), "1.12"),
    # ---- trainers: option combinations and values --------------------------------------------------------------
    (
        "sft/eval_strategy_without_eval_dataset",
        "Either set `args.eval_strategy` to `no` or pass an `eval_dataset`.",
        trainer(*SFT, data="standard_language_modeling", args=dict(eval_strategy="steps", eval_steps=1)),
    ),
    (
        "sft/loss_type_unknown",
        "Invalid `loss_type` foo passed. Supported values are 'nll' and 'dft'.",
        trainer(*SFT, data="standard_language_modeling", args=dict(loss_type="foo"), train=True),
    ),
    (
        "sft/packing_strategy_unknown",
        "Invalid packing strategy 'foo', must be one of ('bfd', 'bfd_split', 'wrapped').",
        trainer(*SFT, data="standard_language_modeling", args=dict(packing=True, packing_strategy="foo"), train=True),
    ),
    (
        "sft/truncation_mode_unknown",
        _TRUNCATION,
        trainer(*SFT, data="standard_language_modeling", args=dict(truncation_mode="middle"), train=True),
    ),
    (
        "sft/use_liger_kernel_without_liger",
        "You have set `use_liger_kernel` to `True` but liger-kernel >= 0.3.0 is not available.",
        trainer(*SFT, data="standard_language_modeling", args=dict(use_liger_kernel=True), train=True),
    ),
    (
        "dpo/loss_type_unknown",
        "Unknown loss type: foo. Should be one of ['sigmoid', 'hinge', 'ipo', 'exo_pair', 'nca_pair', 'robust', "
        "'bco_pair', 'sppo_hard', 'aot', 'aot_unpaired', 'apo_zero', 'apo_down', 'discopop', 'sft', 'sigmoid_norm']",
        trainer(*DPO, args=dict(loss_type="foo"), train=True),
    ),
    (
        "dpo/f_divergence_type_unknown",
        "Unknown f_divergence_type: foo",
        trainer(*DPO, args=dict(f_divergence_type="foo"), train=True),
    ),
    ("dpo/truncation_mode_unknown", _TRUNCATION, trainer(*DPO, args=dict(truncation_mode="middle"), train=True)),
    ("dpo/ref_model_is_model", _SAME_OBJECT, trainer(*DPO, same_ref=True)),
    ("kto/ref_model_is_model", _SAME_OBJECT, trainer(*KTO, data="standard_unpaired_preference", same_ref=True)),
    (
        "bco/ref_model_is_model",
        "`model` and `ref_model` cannot be the same object.",
        trainer(*BCO, data="standard_unpaired_preference", same_ref=True),
        "1.12",
    ),
    (
        "dpo/sync_ref_model_with_precompute_ref_log_probs",
        _SYNC_AND_PRECOMPUTE,
        trainer(*DPO, args=dict(precompute_ref_log_probs=True, sync_ref_model=True)),
    ),
    (
        "kto/sync_ref_model_with_precompute_ref_log_probs",
        _SYNC_AND_PRECOMPUTE,
        trainer(
            *KTO, data="standard_unpaired_preference", args=dict(precompute_ref_log_probs=True, sync_ref_model=True)
        ),
    ),
    (
        "dpo/sync_ref_model_with_peft",
        _sync_with_peft("DPOTrainer"),
        trainer(*DPO, args=dict(sync_ref_model=True), peft_config=_lora),
    ),
    (
        "kto/sync_ref_model_with_peft",
        _sync_with_peft("KTOTrainer"),
        trainer(*KTO, data="standard_unpaired_preference", args=dict(sync_ref_model=True), peft_config=_lora),
    ),
    (
        "kto/batch_size=1",
        "Actual (not effective) batch size must be > 1. KTO will not work properly because the KL term will be "
        "equivalent to the implied reward.",
        trainer(*KTO, data="standard_unpaired_preference", args=dict(per_device_train_batch_size=1)),
    ),
    *[
        (
            f"{name}/reward_weights_length",
            "Number of reward weights (2) must match number of reward functions (1)",
            online(pair, reward_weights=[1.0, 2.0]),
        )
        for name, pair in (("grpo", GRPO), ("rloo", RLOO))
    ],
    *[
        (
            f"{name}/reward_processing_classes_length",
            _RPC,
            online(pair, extra=dict(reward_processing_classes=lambda ctx: [_tokenizer(ctx), _tokenizer(ctx)])),
        )
        for name, pair in (("grpo", GRPO), ("rloo", RLOO))
    ],
    *[
        (
            f"{name}/use_vllm_without_vllm",
            _VLLM,
            online(pair, use_vllm=True),
        )
        for name, pair in (("grpo", GRPO), ("rloo", RLOO))
    ],
    *[
        (
            f"{name}/temperature=0",
            _TEMPERATURE,
            online(pair, temperature=0.0, train=True),
        )
        for name, pair in (("grpo", GRPO), ("rloo", RLOO))
    ],
    (
        "grpo/top_k=-1",
        "`top_k` has to be a strictly positive integer, but is -1",
        online(GRPO, top_k=-1, train=True),
    ),
    (
        "grpo/min_p=2",
        "`min_p` has to be a float in the [0, 1] interval, but is 2.0",
        online(GRPO, min_p=2.0, train=True),
    ),
    (
        "grpo/max_completion_length=0",
        "`max_new_tokens` must be greater than 0, but is 0.",
        online(GRPO, max_completion_length=0, train=True),
    ),
    (
        "grpo/loss_type_unknown",
        "Unknown loss type: foo",
        online(GRPO, loss_type="foo", train=True),
    ),
    (
        "grpo/scale_rewards_unknown",
        "Invalid value for scale_rewards: foo. Must be one of 'batch', 'group', or 'none'.",
        online(GRPO, scale_rewards="foo", train=True),
    ),
    (
        "grpo/importance_sampling_level_unknown",
        "Unknown importance sampling level: foo. Possible values are 'token' and 'sequence'.",
        online(GRPO, importance_sampling_level="foo", train=True),
    ),
    (
        "cpo/loss_type_unknown",
        "Unknown loss type: foo. Should be one of ['sigmoid', 'hinge', 'ipo', 'simpo'",
        trainer(*CPO, args=dict(loss_type="foo"), train=True),
    ),
    (
        "online_dpo/no_reward_funcs",
        "`reward_funcs` must be provided.",
        trainer(*ONLINE_DPO, data="standard_prompt_only"),
    ),
    ("xpo/no_reward_funcs", "`reward_funcs` must be provided.", trainer(*XPO, data="standard_prompt_only"), "1.12"),
    (
        "nash_md/no_reward_funcs",
        "`reward_funcs` must be provided.",
        trainer(*NASH_MD, data="standard_prompt_only"),
        "1.12",
    ),
    (
        "dpo/train_sampling_strategy=group_by_length",
        _NO_LENGTHS,
        trainer(*DPO, args=dict(train_sampling_strategy="group_by_length"), train=True),
    ),
    (
        "reward/train_sampling_strategy=group_by_length",
        _NO_LENGTHS,
        trainer(*REWARD, model=QWEN_RM, args=dict(train_sampling_strategy="group_by_length"), train=True),
    ),
    *(
        (
            f"kto/train_sampling_strategy={strategy}",
            "Loss type `'kto'` estimates the KL divergence term and requires `train_sampling_strategy='sequential'`",
            trainer(*KTO, data="standard_unpaired_preference", args=dict(train_sampling_strategy=strategy)),
        )
        for strategy in ("random", "group_by_length")
    ),
    ("prm/train_dataset=None", _REQUIRED, trainer(*PRM, model="tiny-Qwen2ForTokenClassification", data=None), "1.12"),
]

for _name, _phrase, _build, *_oracle in TABLE:
    register(f"errors/{_name}", _build, phrases=(_phrase,), **({"oracle": _oracle[0]} if _oracle else {}))
