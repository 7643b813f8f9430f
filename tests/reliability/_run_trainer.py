"""Subprocess entry point of the kill-and-resume tests: train one tiny trainer and record its logs.

    python _run_trainer.py TRAINER OUTPUT_DIR MODE LOG_FILE [REFERENCE_DIR REFERENCE_LOG_FILE]

MODE is `full` (train to the end), `kill-after-save:N` (SIGKILL this process right after checkpoint N is written),
`kill-during-save:N` (SIGKILL it halfway through writing checkpoint N, after the model weights and before the
optimizer), or `resume` (continue with `resume_from_checkpoint=True`). The training logs are written to LOG_FILE as
JSON when training ends (never, for the killed modes). With REFERENCE_DIR, an uninterrupted run into REFERENCE_DIR
(logs in REFERENCE_LOG_FILE) comes first, in the same process, to save one interpreter start per test.
"""

import json
import os
import signal
import sys


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from trl.assets import get_model_path, load_test_dataset  # noqa: E402


torch.set_num_threads(1)

MAX_STEPS = 4
COMMON = dict(
    max_steps=MAX_STEPS,
    save_steps=1,
    save_strategy="steps",
    logging_steps=1,
    report_to="none",
    disable_tqdm=True,
    learning_rate=1e-2,
    seed=3,
    data_seed=5,
)
# Dropout on, so that a resumed run must restore the RNG to draw the same masks.
DROPOUT = dict(model_init_kwargs={"attention_dropout": 0.1})
ONLINE = dict(per_device_train_batch_size=4, max_completion_length=6, temperature=1.0)


def low_id_reward(completion_ids, **kwargs):
    return [sum(t < 2048 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def _lm(name="tiny-Qwen2ForCausalLM"):
    return get_model_path(name)


# Offline trainers: name -> (module, method prefix, model asset, dataset, config options).
OFFLINE = {
    "sft": ("trl", "SFT", "tiny-Qwen2ForCausalLM", "standard_language_modeling", dict(DROPOUT, max_length=32)),
    "dpo": ("trl", "DPO", "tiny-Qwen2ForCausalLM", "standard_preference", dict(DROPOUT, max_length=32)),
    "dpo_precompute": (
        "trl", "DPO", "tiny-Qwen2ForCausalLM", "standard_preference", dict(max_length=32, precompute_ref_log_probs=True)
    ),
    "dpo_sync_ref": (
        "trl",
        "DPO",
        "tiny-Qwen2ForCausalLM",
        "standard_preference",
        dict(max_length=32, sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5),
    ),
    "reward": ("trl", "Reward", "tiny-Qwen2ForSequenceClassification", "standard_preference", dict(max_length=32)),
    "prm": (
        "trl.experimental.prm", "PRM", "tiny-Qwen2ForTokenClassification", "standard_stepwise_supervision",
        dict(max_length=48),
    ),
    "kto": (
        "trl", "KTO", "tiny-Qwen2ForCausalLM", "standard_unpaired_preference",
        dict(max_length=32, per_device_train_batch_size=4),
    ),
    "cpo": ("trl.experimental.cpo", "CPO", "tiny-Qwen2ForCausalLM", "standard_preference", dict(max_length=32)),
    "orpo": ("trl.experimental.orpo", "ORPO", "tiny-Qwen2ForCausalLM", "standard_preference", dict(max_length=32)),
    "bco": (
        "trl.experimental.bco", "BCO", "tiny-Qwen2ForCausalLM", "standard_unpaired_preference",
        dict(max_length=32, per_device_train_batch_size=4),
    ),
}  # fmt: skip


def build(name: str, output_dir: str):
    """The trainer `name`, built on the tiny offline assets with `output_dir`."""
    import importlib

    if name in OFFLINE:
        module_name, prefix, model, dataset, options = OFFLINE[name]
        module = importlib.import_module(module_name)
        config_class, trainer_class = getattr(module, f"{prefix}Config"), getattr(module, f"{prefix}Trainer")
        args = config_class(output_dir, **{"per_device_train_batch_size": 2, **options, **COMMON})
        return trainer_class(_lm(model), args=args, train_dataset=load_test_dataset(dataset, "train"))
    prompts = load_test_dataset("standard_prompt_only", "train")
    if name == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        args = GRPOConfig(output_dir, num_generations=2, steps_per_generation=2, beta=0.1, **ONLINE, **COMMON)
        return GRPOTrainer(_lm(), reward_funcs=low_id_reward, args=args, train_dataset=prompts)
    if name == "rloo":
        from trl import RLOOConfig, RLOOTrainer

        args = RLOOConfig(output_dir, num_generations=2, **ONLINE, **COMMON)
        return RLOOTrainer(_lm(), reward_funcs=low_id_reward, args=args, train_dataset=prompts)
    if name in ("online_dpo", "xpo", "nash_md"):
        package = importlib.import_module(f"trl.experimental.{name}")
        prefix = {"online_dpo": "OnlineDPO", "xpo": "XPO", "nash_md": "NashMD"}[name]
        config_class, trainer_class = getattr(package, f"{prefix}Config"), getattr(package, f"{prefix}Trainer")
        args = config_class(output_dir, per_device_train_batch_size=2, max_new_tokens=6, **COMMON)
        return trainer_class(_lm(), reward_funcs=low_id_reward, args=args, train_dataset=prompts)
    return _build_added(name, output_dir, prompts)


def half_constant_reward(prompts, completion_ids, **kwargs):
    # Every other prompt scores the same for all its completions: zero-variance groups that the replay buffer replaces.
    return [
        0.5 if len(p) % 2 else sum(t < 2048 for t in ids) / max(len(ids), 1) for p, ids in zip(prompts, completion_ids)
    ]


def shortest_first(group_completions, group_rewards, **kwargs):
    return [[-float(len(c)) for c in completions] for completions in group_completions]


def _build_added(name: str, output_dir: str, prompts):
    """The trainers added after the first reliability pass: distillation, PPO, GRPO variants, BEMA."""
    teacher = get_model_path("small-Qwen2ForCausalLM")
    conversations = load_test_dataset("conversational_language_modeling", "train").select(range(16))
    if name in ("gkd", "gold"):
        from trl.experimental import gkd, gold

        prefix, module = ("GKD", gkd) if name == "gkd" else ("GOLD", gold)
        length = {"max_new_tokens": 6} if name == "gkd" else {"max_completion_length": 6}
        args = getattr(module, f"{prefix}Config")(
            output_dir, per_device_train_batch_size=2, max_length=32, lmbda=0.5, **length, **COMMON
        )
        trainer_class = getattr(module, f"{prefix}Trainer")
        return trainer_class(model=_lm(), teacher_model=teacher, args=args, train_dataset=conversations)
    if name == "distillation":
        from trl import DistillationConfig, DistillationTrainer

        args = DistillationConfig(output_dir, per_device_train_batch_size=4, max_completion_length=6, **COMMON)
        return DistillationTrainer(_lm(), teacher_model=teacher, args=args, train_dataset=prompts)
    if name in ("gfpo", "grpo_replay"):
        from trl.experimental import gfpo, grpo_with_replay_buffer

        if name == "gfpo":
            config_class, trainer_class = gfpo.GFPOConfig, gfpo.GFPOTrainer
            options = dict(num_generations=4, num_remains_in_group=2, per_device_train_batch_size=8)
        else:
            config_class = grpo_with_replay_buffer.GRPOWithReplayBufferConfig
            trainer_class = grpo_with_replay_buffer.GRPOWithReplayBufferTrainer
            options = dict(num_generations=2, replay_buffer_size=3, per_device_train_batch_size=4)
        args = config_class(output_dir, max_completion_length=6, temperature=1.0, **options, **COMMON)
        extra = {"group_filter_func": shortest_first} if name == "gfpo" else {}
        return trainer_class(model=_lm(), reward_funcs=half_constant_reward, args=args, train_dataset=prompts, **extra)
    if name == "ppo":
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

        from trl.experimental.ppo import PPOConfig, PPOTrainer

        tokenizer = AutoTokenizer.from_pretrained(_lm(), padding_side="left")
        tokenized = prompts.map(lambda row: tokenizer(row["prompt"]), remove_columns=["prompt"])
        scorer = get_model_path("tiny-Qwen2ForSequenceClassification")
        options = {k: v for k, v in COMMON.items() if k not in ("max_steps", "data_seed")}
        args = PPOConfig(output_dir, per_device_train_batch_size=4, total_episodes=4 * MAX_STEPS, response_length=6,
                         num_ppo_epochs=1, num_mini_batches=2, num_sample_generations=0, **options)  # fmt: skip
        return PPOTrainer(
            args=args, processing_class=tokenizer, model=AutoModelForCausalLM.from_pretrained(_lm()), ref_model=None,
            reward_model=AutoModelForSequenceClassification.from_pretrained(scorer, num_labels=1),
            value_model=AutoModelForSequenceClassification.from_pretrained(scorer, num_labels=1),
            train_dataset=tokenized,
        )  # fmt: skip
    if name == "bema":
        from trl import DPOConfig
        from trl.experimental.bema_for_ref_model import BEMACallback, DPOTrainer

        args = DPOConfig(output_dir, per_device_train_batch_size=2, max_length=32, **COMMON)
        bema = BEMACallback(update_freq=1, lag=1, update_ref_model=True, ref_model_update_freq=2)
        data = load_test_dataset("standard_preference", "train")
        return DPOTrainer(_lm(), args=args, train_dataset=data, callbacks=[bema])
    raise ValueError(f"unknown trainer {name!r}")


class _KillAfterSave(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def _kill_during_save(trainer, step: int) -> None:
    """SIGKILL the process once checkpoint `step`'s weights are written, before its optimizer and trainer state."""
    save_optimizer = trainer._save_optimizer_and_scheduler

    def save_then_die(output_dir):
        if trainer.state.global_step == step:
            os.kill(os.getpid(), signal.SIGKILL)
        return save_optimizer(output_dir)

    trainer._save_optimizer_and_scheduler = save_then_die


def main(name: str, output_dir: str, mode: str, log_file: str, reference_dir=None, reference_log=None) -> None:
    if reference_dir is not None:
        main(name, reference_dir, "full", reference_log)
    trainer = build(name, output_dir)
    resume = mode == "resume"
    if mode.startswith("kill-after-save:"):
        trainer.add_callback(_KillAfterSave(int(mode.split(":")[1])))
    elif mode.startswith("kill-during-save:"):
        _kill_during_save(trainer, int(mode.split(":")[1]))
    elif mode not in ("full", "resume"):
        raise ValueError(f"unknown mode {mode!r}")
    trainer.train(resume_from_checkpoint=True if resume else None)
    with open(log_file, "w") as f:
        json.dump(trainer.state.log_history, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
