"""Every script in examples/scripts runs offline for one step on the embedded tiny assets and saves its model."""

import os
import runpy
import sys

import pytest

from trl.assets import get_model_path


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
    "gfpo.py": ["--num_generations", "4", "--num_remains_in_group", "2", "--steps_per_generation", "2"]
    + ["--max_completion_length", "8"],
    "dpo_vlm.py": [],
    "gkd.py": ["--max_new_tokens", "4", "--lmbda", "1.0"],
    "gold.py": ["--max_completion_length", "4", "--lmbda", "1.0"],
    "grpo.py": ONLINE_ARGS,
    "grpo_tools.py": ONLINE_ARGS + ["--num_questions", "4"],
    "grpo_with_replay_buffer.py": ONLINE_ARGS + ["--replay_buffer_size", "4"],
    "gspo_token.py": ONLINE_ARGS,
    "grpo_vlm.py": ONLINE_ARGS,
    "kto.py": ["--max_length", "64"],
    "merge_model.py": ["--max_length", "64"],
    "nash_md.py": PAIRWISE_ARGS,
    "online_dpo.py": PAIRWISE_ARGS,
    "orpo.py": ["--max_length", "64"],
    "ppo/ppo.py": ["--response_length", "4", "--num_ppo_epochs", "1"],
    "ppo/ppo_tldr.py": ["--response_length", "4", "--num_ppo_epochs", "1"],
    "prm.py": [],
    "reward_modeling.py": ["--max_length", "64"],
    "rloo.py": ONLINE_ARGS,
    "sft.py": ["--max_length", "64"],
    "sdft.py": ONLINE_ARGS,
    "sdpo.py": ONLINE_ARGS,
    "sft_vlm.py": ["--freeze_vision_tower", "true"],
    "ssd.py": ["--max_completion_length", "8", "--filter_empty", "false"],
    "tpo.py": ["--max_length", "64"],
    "xpo.py": PAIRWISE_ARGS,
}


# The diffusion scripts (DDPO, AlignProp) run their own epoch loop on the tiny Stable Diffusion pipeline.
DIFFUSION_ARGS = ["--num_epochs", "1", "--sample_num_steps", "2", "--train_batch_size", "2", "--mixed_precision", "no"]
DIFFUSION_SCRIPT_ARGS = {
    "alignprop.py": DIFFUSION_ARGS + ["--truncated_backprop_rand", "false", "--truncated_backprop_timestep", "1"],
    "ddpo.py": DIFFUSION_ARGS + ["--sample_batch_size", "2", "--reward", "red"],
}

# Scripts that need a server or an external service: tested with in-process stand-ins in
# tests/experimental/test_frontier_example_scripts.py (the harness files are modules of data_agent.py).
SCRIPTS_TESTED_ELSEWHERE = {
    "async_grpo.py",
    "harbor/data_agent.py",
    "harbor/harnesses/bash.py",
    "harbor/harnesses/jupyter.py",
    "harbor/harnesses/terminal_notes.py",
    "openreward/seta.py",
}


def test_every_example_script_is_covered():
    found = [
        os.path.relpath(os.path.join(root, name), EXAMPLES_DIR)
        for root, _, names in os.walk(EXAMPLES_DIR)
        for name in names
        if name.endswith(".py")
    ]
    assert sorted(found) == sorted({*SCRIPT_ARGS, *DIFFUSION_SCRIPT_ARGS, *SCRIPTS_TESTED_ELSEWHERE})


@pytest.mark.parametrize("script", sorted(DIFFUSION_SCRIPT_ARGS))
def test_diffusion_example_script_trains_offline(script, tmp_path, monkeypatch):
    """The tiny Stable Diffusion pipeline by default: one epoch, a checkpoint, the LoRA weights saved."""
    pytest.importorskip("diffusers")
    path = os.path.join(EXAMPLES_DIR, script)
    args = ["--output_dir", str(tmp_path / "out"), "--logdir", str(tmp_path / "logs"), *DIFFUSION_SCRIPT_ARGS[script]]
    monkeypatch.setattr(sys, "argv", [path, *args])
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    runpy.run_path(path, run_name="__main__")
    assert sorted(os.listdir(tmp_path / "out")) == ["README.md", "pytorch_lora_weights.safetensors"]
    assert os.listdir(tmp_path / "logs" / "checkpoints") == ["checkpoint_0"]


def _skip_without_what_the_script_needs(script: str) -> list[str]:
    """Skip when the script needs what is not installed; extra arguments that work around a missing piece."""
    from trainer_utils import requires_qwen2_vl_processor, requires_response_parser

    if script == "merge_model.py":
        pytest.importorskip("mergekit")
    if requires_response_parser.args[0] and "tools" in script:
        pytest.skip(requires_response_parser.kwargs["reason"])
    if requires_qwen2_vl_processor.args[0] and "vlm" in script:
        # The VLM examples default to tiny Qwen2-VL; the LLaVA layout needs nothing more.
        return ["--model_name_or_path", get_model_path("tiny-LlavaForConditionalGeneration")]
    return []


@pytest.mark.parametrize("script", sorted(SCRIPT_ARGS))
def test_example_script_trains_offline(script, tmp_path, monkeypatch):
    """No model or dataset given: the script falls back to the tiny assets, trains one step and saves."""
    extra = _skip_without_what_the_script_needs(script)
    path = os.path.join(EXAMPLES_DIR, script)
    argv = [path, "--output_dir", str(tmp_path), *COMMON_ARGS, *SCRIPT_ARGS[script], *extra]
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    runpy.run_path(path, run_name="__main__")
    saved = set(os.listdir(tmp_path))
    assert "config.json" in saved and "model.safetensors" in saved, saved
    assert os.path.isfile(os.path.join(tmp_path, "checkpoint-1", "trainer_state.json"))


def test_bco_example_with_bf16_mixed_precision(tmp_path, monkeypatch):
    """The BCO example's prompt-embedding model shares the trainer's accelerator state: with bf16 mixed precision (the
    default on a GPU; asked for explicitly on the CPU here) no earlier `Accelerator` fixes it to "no"."""
    path = os.path.join(EXAMPLES_DIR, "bco.py")
    argv = [path, "--output_dir", str(tmp_path), *COMMON_ARGS, "--bf16", "true", "--use_cpu", "true"]
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    runpy.run_path(path, run_name="__main__")
    assert "model.safetensors" in os.listdir(tmp_path)
