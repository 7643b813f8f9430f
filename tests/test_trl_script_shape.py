"""TRL's canonical example-script shape runs unchanged, offline, for two steps.

Each test is what a TRL user's script does: `HfArgumentParser((ScriptArguments, <X>Config, ModelConfig))` →
`ModelConfig` → model kwargs (dtype, quantization and device map helpers) → model/tokenizer loading (or the model id
for the trainer to load) → `load_dataset(dataset_name, name=dataset_config)` → trainer with
`peft_config=get_peft_config(model_args)` → `train()`. The models and datasets are the tiny local `trl.assets`.
"""

import pytest
import torch
from datasets import load_dataset
from trainer_utils import COMMON_ARGS, GROUP_ARGS, PREFERENCE_ARGS, changed_params, snapshot, train_logs
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, HfArgumentParser

from trl import (
    DPOConfig,
    DPOTrainer,
    GRPOConfig,
    GRPOTrainer,
    KTOConfig,
    KTOTrainer,
    ModelConfig,
    RewardConfig,
    RewardTrainer,
    RLOOConfig,
    RLOOTrainer,
    ScriptArguments,
    SFTConfig,
    SFTTrainer,
    get_peft_config,
    get_quantization_config,
)
from trl.assets import get_dataset_path, get_model_path
from trl.rewards import think_format_reward
from trl.scripts.grpo import GRPOScriptArguments
from trl.scripts.rloo import RLOOScriptArguments
from trl.trainer import get_kbit_device_map


pytestmark = pytest.mark.usefixtures("single_thread")

PEFT_ARGS = ["--use_peft", "--lora_r", "8", "--lora_alpha", "16", "--lora_target_modules", "all-linear"]


def command_line(tmp_path, model: str, dataset: str, *extra: str, **options) -> list[str]:
    """`--output_dir`, model, dataset, `--trust_remote_code true`, the test-suite's COMMON_ARGS and `options`."""
    args = ["--output_dir", str(tmp_path), "--model_name_or_path", get_model_path(model)]
    args += ["--dataset_name", get_dataset_path(dataset), "--trust_remote_code", "true"]
    for key, value in {**COMMON_ARGS, **options}.items():
        args += [f"--{key}", str(value)]
    return args + list(extra)


def model_kwargs(model_args: ModelConfig) -> dict:
    """The `from_pretrained` kwargs of TRL's example scripts."""
    dtype = model_args.dtype if model_args.dtype in ["auto", None] else getattr(torch, model_args.dtype)
    quantization_config = get_quantization_config(model_args)
    return dict(
        revision=model_args.model_revision,
        attn_implementation=model_args.attn_implementation,
        dtype=dtype,
        device_map=get_kbit_device_map() if quantization_config is not None else None,
        quantization_config=quantization_config,
    )


def splits(script_args: ScriptArguments, training_args):
    dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config)
    train_dataset = dataset[script_args.dataset_train_split]
    eval_dataset = dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None
    return train_dataset, eval_dataset


def record_loading(monkeypatch) -> dict[str, list[dict]]:
    """Record the kwargs of the trainer's model and processor loading calls."""
    import transformers

    import trl.trainer.base_trainer

    calls = {"model": [], "processor": []}
    create_model_from_path = trl.trainer.base_trainer.create_model_from_path
    processor_from_pretrained = transformers.AutoProcessor.from_pretrained.__func__

    def create_model(model_id, **kwargs):
        calls["model"].append(kwargs)
        return create_model_from_path(model_id, **kwargs)

    def load_processor(cls, model_id, **kwargs):
        calls["processor"].append(kwargs)
        return processor_from_pretrained(cls, model_id, **kwargs)

    # (Recorded where the trainers' shared base looks it up.)
    monkeypatch.setattr(trl.trainer.base_trainer, "create_model_from_path", create_model)
    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", classmethod(load_processor))
    return calls


def train_two_steps(trainer_class, *args, **kwargs):
    """`trainer_class(*args, **kwargs).train()`, checking that two logged steps changed the trainable parameters."""
    trainer = trainer_class(*args, **kwargs)
    before = snapshot(trainer.model)
    trainer.train()
    assert trainer.state.global_step == 2
    assert train_logs(trainer)
    assert changed_params(before, trainer.model)
    return trainer


@pytest.mark.parametrize("peft", [False, True], ids=["full", "peft"])
def test_sft_script(tmp_path, peft, monkeypatch):
    loading = record_loading(monkeypatch)
    parser = HfArgumentParser((ScriptArguments, SFTConfig, ModelConfig))
    args = command_line(
        tmp_path,
        "tiny-Qwen2ForCausalLM",
        "conversational_prompt_completion",
        *(PEFT_ARGS if peft else []),
        max_steps=2,
        per_device_train_batch_size=2,
        max_length=64,
        eval_strategy="steps",
        eval_steps=2,
    )
    script_args, training_args, model_args = parser.parse_args_into_dataclasses(args=args)
    assert training_args.trust_remote_code is True
    training_args.model_init_kwargs = model_kwargs(model_args)
    train_dataset, eval_dataset = splits(script_args, training_args)
    trainer = train_two_steps(
        SFTTrainer,
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=get_peft_config(model_args),
    )
    assert any("eval_loss" in log for log in trainer.state.log_history)
    assert hasattr(trainer.model, "peft_config") == peft
    # `--trust_remote_code` (a training-config option) reached the model and processor loading of the trainer.
    assert [kwargs.get("trust_remote_code") for kwargs in loading["model"]] == [True]
    assert [kwargs.get("trust_remote_code") for kwargs in loading["processor"]] == [True]


@pytest.mark.parametrize("peft", [False, True], ids=["full", "peft"])
@pytest.mark.parametrize(
    "config_class, trainer_class, dataset",
    [(DPOConfig, DPOTrainer, "standard_preference"), (KTOConfig, KTOTrainer, "standard_unpaired_preference")],
    ids=["dpo", "kto"],
)
def test_offline_preference_script(tmp_path, config_class, trainer_class, dataset, peft):
    parser = HfArgumentParser((ScriptArguments, config_class, ModelConfig))
    extra = PEFT_ARGS if peft else []
    args = command_line(tmp_path, "tiny-Qwen2ForCausalLM", dataset, *extra, max_length=64, **PREFERENCE_ARGS)
    script_args, training_args, model_args = parser.parse_args_into_dataclasses(args=args)
    kwargs = model_kwargs(model_args)
    remote = training_args.trust_remote_code
    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, trust_remote_code=remote, **kwargs)
    peft_config = get_peft_config(model_args)
    ref_model = None
    if peft_config is None:
        ref_model = AutoModelForCausalLM.from_pretrained(
            model_args.model_name_or_path, trust_remote_code=remote, **kwargs
        )
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, trust_remote_code=remote)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    train_dataset, eval_dataset = splits(script_args, training_args)
    trainer = train_two_steps(
        trainer_class,
        model,
        ref_model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    assert hasattr(trainer.model, "peft_config") == peft


@pytest.mark.parametrize("peft", [False, True], ids=["full", "peft"])
def test_reward_script(tmp_path, peft):
    parser = HfArgumentParser((ScriptArguments, RewardConfig, ModelConfig))
    extra = [*PEFT_ARGS, "--lora_task_type", "SEQ_CLS"] if peft else []
    args = command_line(
        tmp_path,
        "tiny-Qwen2ForSequenceClassification",
        "standard_preference",
        *extra,
        max_steps=2,
        per_device_train_batch_size=2,
        max_length=64,
    )
    script_args, training_args, model_args = parser.parse_args_into_dataclasses(args=args)
    remote = training_args.trust_remote_code
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, trust_remote_code=remote, use_fast=True)
    model = AutoModelForSequenceClassification.from_pretrained(
        model_args.model_name_or_path, num_labels=1, trust_remote_code=remote, **model_kwargs(model_args)
    )
    model.config.pad_token_id = tokenizer.pad_token_id
    train_dataset, eval_dataset = splits(script_args, training_args)
    trainer = train_two_steps(
        RewardTrainer,
        model=model,
        processing_class=tokenizer,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=get_peft_config(model_args),
    )
    if peft:
        assert trainer.model.peft_config["default"].task_type == "SEQ_CLS"


@pytest.mark.parametrize(
    "script_class, config_class, trainer_class",
    [(GRPOScriptArguments, GRPOConfig, GRPOTrainer), (RLOOScriptArguments, RLOOConfig, RLOOTrainer)],
    ids=["grpo", "rloo"],
)
def test_online_script(tmp_path, script_class, config_class, trainer_class):
    parser = HfArgumentParser((script_class, config_class, ModelConfig))
    reward_model = get_model_path("tiny-Qwen2ForSequenceClassification")
    args = command_line(
        tmp_path,
        "tiny-Qwen2ForCausalLM",
        "standard_prompt_only",
        "--reward_model_name_or_path",
        reward_model,
        **GROUP_ARGS,
    )
    script_args, training_args, model_args = parser.parse_args_into_dataclasses(args=args)
    assert script_args.reward_model_name_or_path == reward_model
    training_args.model_init_kwargs = model_kwargs(model_args)
    train_dataset, eval_dataset = splits(script_args, training_args)
    train_two_steps(
        trainer_class,
        model=model_args.model_name_or_path,
        reward_funcs=[script_args.reward_model_name_or_path, think_format_reward],
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=get_peft_config(model_args),
    )
