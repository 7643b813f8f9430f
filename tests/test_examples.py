"""Every script in examples/scripts runs offline for one step on the embedded tiny assets and saves its model."""

import os
import runpy
import sys

import pytest


EXAMPLES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "scripts")
COMMON_ARGS = ["--max_steps", "1", "--per_device_train_batch_size", "2", "--report_to", "none"]
COMMON_ARGS += ["--gradient_checkpointing", "false", "--disable_tqdm", "true"]
ONLINE_ARGS = ["--num_generations", "2", "--max_completion_length", "8"]
PAIRWISE_ARGS = ["--max_new_tokens", "4"]
# Extra flags per script (kept small so that each run takes seconds); every example must be listed here.
SCRIPT_ARGS = {
    "bco.py": [],
    "cpo.py": ["--max_length", "64", "--loss_type", "simpo"],
    "distillation.py": ["--max_completion_length", "8"],
    "dpo.py": ["--max_length", "64"],
    "dpo_vlm.py": [],
    "gkd.py": ["--max_new_tokens", "4", "--lmbda", "1.0"],
    "gold.py": ["--max_completion_length", "4", "--lmbda", "1.0"],
    "grpo.py": ONLINE_ARGS,
    "grpo_tools.py": ONLINE_ARGS + ["--num_questions", "4"],
    "grpo_vlm.py": ONLINE_ARGS,
    "kto.py": ["--max_length", "64"],
    "nash_md.py": PAIRWISE_ARGS,
    "online_dpo.py": PAIRWISE_ARGS,
    "orpo.py": ["--max_length", "64"],
    "prm.py": [],
    "reward_modeling.py": ["--max_length", "64"],
    "rloo.py": ONLINE_ARGS,
    "sft.py": ["--max_length", "64"],
    "sft_vlm.py": ["--freeze_vision_tower", "true"],
    "xpo.py": PAIRWISE_ARGS,
}


def test_every_example_script_is_covered():
    assert sorted(name for name in os.listdir(EXAMPLES_DIR) if name.endswith(".py")) == sorted(SCRIPT_ARGS)


@pytest.mark.parametrize("script", sorted(SCRIPT_ARGS))
def test_example_script_trains_offline(script, tmp_path, monkeypatch):
    """No model or dataset given: the script falls back to the tiny assets, trains one step and saves."""
    path = os.path.join(EXAMPLES_DIR, script)
    monkeypatch.setattr(sys, "argv", [path, "--output_dir", str(tmp_path), *COMMON_ARGS, *SCRIPT_ARGS[script]])
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    runpy.run_path(path, run_name="__main__")
    saved = set(os.listdir(tmp_path))
    assert "config.json" in saved and "model.safetensors" in saved, saved
    assert os.path.isfile(os.path.join(tmp_path, "checkpoint-1", "trainer_state.json"))
