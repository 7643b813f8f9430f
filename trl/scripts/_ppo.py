"""Runner shared by the PPO example scripts (`examples/scripts/ppo/ppo.py`, `ppo_tldr.py`).

Loads the policy and reference from `sft_model_path` (or `--model_name_or_path`), the reward and value models from
`reward_model_path` (sequence classification, one label), tokenizes the prompts and trains. Without any model or
dataset given, the tiny offline assets are used, so the scripts run anywhere.
"""

import logging
import os
from collections.abc import Callable
from typing import Any

from .utils import ScriptArguments


logger = logging.getLogger(__name__)

# PPOConfig's defaults for both model paths: left at this value, the offline tiny models are used instead.
_DEFAULT_MODEL_PATH = "EleutherAI/pythia-160m"


def _resolve_offline_defaults(script_args: ScriptArguments, training_args: Any, model_args: Any) -> None:
    from ..assets import get_dataset_path, get_model_path

    if model_args.model_name_or_path is None and training_args.sft_model_path == _DEFAULT_MODEL_PATH:
        training_args.sft_model_path = get_model_path("tiny-Qwen2ForCausalLM")
        replaced = "sft_model_path"
        if training_args.reward_model_path == _DEFAULT_MODEL_PATH:
            training_args.reward_model_path = get_model_path("tiny-Qwen2ForSequenceClassification")
            replaced += " and reward_model_path"
        logger.warning(
            f"No --sft_model_path or --model_name_or_path given: PPOConfig's default {replaced} "
            f"({_DEFAULT_MODEL_PATH!r}) is replaced by trl's tiny offline test models so that the script runs "
            f"anywhere. Pass --sft_model_path {_DEFAULT_MODEL_PATH} (and --reward_model_path) to train TRL's default."
        )
    if script_args.dataset_name is None:
        script_args.dataset_name = get_dataset_path("standard_prompt_only")


def run_ppo(
    script_args: ScriptArguments,
    training_args: Any,
    model_args: Any,
    keep_row: Callable[[dict, int], bool] | None = None,
) -> Any:
    """Train PPO as the example scripts do and save the policy; returns the trainer.

    Args:
        script_args: Dataset options (`dataset_name`, splits).
        training_args: A `PPOConfig`.
        model_args: A `ModelConfig` (`model_name_or_path` overrides `sft_model_path`; PEFT options).
        keep_row: Optional filter `(row, num_prompt_tokens) -> bool` applied after tokenization (e.g. a length cap).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from ..data_utils import apply_chat_template, is_conversational
    from ..experimental.ppo import PPOTrainer
    from ..models.peft import get_peft_config
    from ._training import finish_training, load_script_dataset

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    _resolve_offline_defaults(script_args, training_args, model_args)
    policy_path = model_args.model_name_or_path or training_args.sft_model_path
    dtype = model_args.dtype if model_args.dtype in (None, "auto") else getattr(torch, model_args.dtype)
    model_kwargs = {"revision": model_args.model_revision}
    if dtype is not None:
        model_kwargs["dtype"] = dtype
    tokenizer = AutoTokenizer.from_pretrained(policy_path, padding_side="left", revision=model_args.model_revision)
    if tokenizer.pad_token is None:
        tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    reward_model = AutoModelForSequenceClassification.from_pretrained(
        training_args.reward_model_path, num_labels=1, **model_kwargs
    )
    value_model = AutoModelForSequenceClassification.from_pretrained(
        training_args.reward_model_path, num_labels=1, **model_kwargs
    )
    policy = AutoModelForCausalLM.from_pretrained(policy_path, **model_kwargs)
    peft_config = get_peft_config(model_args)
    ref_policy = None if peft_config is not None else AutoModelForCausalLM.from_pretrained(policy_path, **model_kwargs)

    dataset = load_script_dataset(script_args, None)

    def tokenize(row: dict) -> dict:
        if is_conversational(row):
            text = apply_chat_template({"prompt": row["prompt"]}, tokenizer)["prompt"]
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(row["prompt"])["input_ids"]
        return {"input_ids": ids, "lengths": len(ids)}

    def prepare(split: str) -> Any:
        data = dataset[split]
        data = data.map(tokenize, remove_columns=data.column_names, num_proc=training_args.dataset_num_proc)
        if keep_row is not None:
            data = data.filter(lambda row: keep_row(row, row["lengths"]), num_proc=training_args.dataset_num_proc)
        return data.remove_columns("lengths")

    train_dataset = prepare(script_args.dataset_train_split)
    eval_split = script_args.dataset_test_split
    eval_dataset = prepare(eval_split) if eval_split in dataset else None
    trainer = PPOTrainer(
        args=training_args,
        processing_class=tokenizer,
        model=policy,
        ref_model=ref_policy,
        reward_model=reward_model,
        train_dataset=train_dataset,
        value_model=value_model,
        eval_dataset=eval_dataset,
        peft_config=peft_config,
    )
    finish_training(trainer, training_args, script_args)
    return trainer
