"""Subprocess entry point of the cross-library resume tests; runs under real TRL 1.16 or under this project.

    python _cross_resume_run.py ASSETS_JSON TRAINER OUTPUT_DIR MODE LOG_FILE

It only uses TRL's public API, so the same file runs with either library's python. ASSETS_JSON maps
`models/<name>` and `datasets/<name>` to local directories (the parity suite's asset file). MODE is `full` (train to
the end), `kill-after-save:N` (SIGKILL this process right after checkpoint N is written) or `resume:PATH` (continue
from the checkpoint directory PATH, which the other library may have written). The logs are written to LOG_FILE as
JSON when training ends, with the name and version of the `trl` that ran.
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


torch.set_num_threads(1)

MAX_STEPS = 4
COMMON = dict(
    max_steps=MAX_STEPS,
    save_steps=2,
    save_strategy="steps",
    logging_steps=1,
    report_to="none",
    disable_tqdm=True,
    learning_rate=1e-2,
    seed=3,
    data_seed=5,
    use_cpu=True,
    bf16=False,
    per_device_train_batch_size=2,
)
# name -> (config / trainer prefix, model asset, dataset asset, options)
TRAINERS = {
    "sft": ("SFT", "tiny-Qwen2ForCausalLM", "standard_language_modeling", dict(max_length=32)),
    "dpo": ("DPO", "tiny-Qwen2ForCausalLM", "standard_preference", dict(max_length=32)),
    "kto": ("KTO", "tiny-Qwen2ForCausalLM", "standard_unpaired_preference", dict(max_length=32, per_device_train_batch_size=4)),
    "reward": ("Reward", "tiny-Qwen2ForSequenceClassification", "standard_preference", dict(max_length=32)),
    "grpo": ("GRPO", "tiny-Qwen2ForCausalLM", "standard_prompt_only", dict(num_generations=2, max_completion_length=6)),
    # The reference model refreshed during training: TR-DPO's soft sync, and BEMA weights loaded into it.
    "dpo_syncref": ("DPO", "tiny-Qwen2ForCausalLM", "standard_preference",
                    dict(max_length=32, sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5)),
    "dpo_bema": ("DPO", "tiny-Qwen2ForCausalLM", "standard_preference", dict(max_length=32)),
}  # fmt: skip
MAX_STEPS_OF = {"dpo_syncref": 6, "dpo_bema": 6}


def low_id_reward(completion_ids, **kwargs):
    """GRPO's reward in these runs: the share of completion tokens with an id below 1024."""
    return [sum(1.0 for token in ids if token < 1024) / max(len(ids), 1) for ids in completion_ids]


def build(assets: dict, name: str, output_dir: str):
    from datasets import load_dataset

    import trl

    prefix, model, dataset, options = TRAINERS[name]
    data = load_dataset(
        "json",
        data_files={"train": os.path.join(assets[f"datasets/{dataset}"], "train.jsonl")},
        split="train",
        cache_dir=os.path.join(output_dir, ".hf-cache"),
    )
    args = getattr(trl, f"{prefix}Config")(output_dir, **{**COMMON, "max_steps": MAX_STEPS_OF.get(name, MAX_STEPS),
                                                           **options})  # fmt: skip
    extra = {"reward_funcs": low_id_reward} if prefix == "GRPO" else {}
    trainer_class = getattr(trl, f"{prefix}Trainer")
    if name == "dpo_bema":
        from trl.experimental.bema_for_ref_model import BEMACallback, DPOTrainer

        trainer_class = DPOTrainer
        extra["callbacks"] = [BEMACallback(update_freq=1, update_ref_model=True, ref_model_update_freq=1, lag=1,
                                           min_ema_multiplier=0.0)]  # fmt: skip
    return trainer_class(assets[f"models/{model}"], args=args, train_dataset=data, **extra)


class _KillAfterSave(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main(assets_file: str, name: str, output_dir: str, mode: str, log_file: str) -> None:
    import trl

    with open(assets_file) as f:
        assets = json.load(f)
    trainer = build(assets, name, output_dir)
    resume = None
    if mode.startswith("kill-after-save:"):
        trainer.add_callback(_KillAfterSave(int(mode.split(":", 1)[1])))
    elif mode.startswith("resume:"):
        resume = mode.split(":", 1)[1]
    elif mode != "full":
        raise ValueError(f"unknown mode {mode!r}")
    trainer.train(resume_from_checkpoint=resume)
    from importlib.metadata import version

    with open(log_file, "w") as f:
        json.dump({"trl": trl.__file__, "version": version("trl"), "logs": trainer.state.log_history}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
