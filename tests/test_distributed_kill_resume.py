"""Two-rank kill -9 and resume: SFT and DPO in 2 CPU processes (gloo) under DDP, DeepSpeed ZeRO-2 and FSDP2; GRPO
(sampling on both ranks, rewards gathered across them) under DDP.

Three launches per trainer and engine: an uninterrupted run; a run whose two ranks each SIGKILL themselves right after
checkpoint 2 is written (the launcher then fails, and the checkpoint must be complete); a run resumed from it with
`resume_from_checkpoint=True`. The resumed run's logged numbers (loss, grad norm, learning rate, token counts, the
trainer's metrics) equal the uninterrupted run's at every step. Dropout is on in SFT, so the ranks' RNG states must
come back too. Launch helpers: tests/distributed_utils.py.
"""

import json
import os
import signal

import pytest
from distributed_utils import engine_params, launch, write_report
from log_compare import assert_same_step_logs, step_logs


pytestmark = pytest.mark.distributed

MAX_STEPS = 4
KILL_STEP = 2


def train(out_dir: str, trainer: str = "sft", mode: str = "full", run_dir: str = "") -> None:
    """Worker: `mode` is `full`, `kill` (SIGKILL this rank once checkpoint KILL_STEP is saved) or `resume`."""
    from transformers import TrainerCallback

    from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
    from trl.assets import get_model_path, load_test_dataset

    class KillAfterSave(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == KILL_STEP:
                os.kill(os.getpid(), signal.SIGKILL)

    config_class, trainer_class, dataset, options = {
        "sft": (
            SFTConfig,
            SFTTrainer,
            "standard_language_modeling",
            {"model_init_kwargs": {"attention_dropout": 0.1}},
        ),
        "dpo": (DPOConfig, DPOTrainer, "standard_preference", {}),
        "grpo": (
            GRPOConfig,
            GRPOTrainer,
            "standard_prompt_only",
            {"num_generations": 2, "max_completion_length": 6, "max_length": None},
        ),
    }[trainer]
    if trainer == "grpo":
        options = {**options, "reward_funcs": _low_id_reward}
    args = config_class(
        run_dir,
        use_cpu=True,
        bf16=False,
        max_steps=MAX_STEPS,
        per_device_train_batch_size=2,
        **({"max_length": 32} if "max_length" not in options else {}),
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="steps",
        save_steps=KILL_STEP,
        gradient_checkpointing=False,
        report_to="none",
        disable_tqdm=True,
        seed=3,
        data_seed=5,
        **{key: value for key, value in options.items() if key not in ("reward_funcs", "max_length")},
    )
    callbacks = [KillAfterSave()] if mode == "kill" else []
    model = get_model_path("tiny-Qwen2ForCausalLM")
    data = load_test_dataset(dataset, split="train")
    extra = {"reward_funcs": options["reward_funcs"]} if "reward_funcs" in options else {}
    instance = trainer_class(model, args=args, train_dataset=data, callbacks=callbacks, **extra)
    instance.train(resume_from_checkpoint=True if mode == "resume" else None)
    write_report(out_dir, {"process_index": instance.args.process_index, "logs": instance.state.log_history})


def _low_id_reward(completion_ids, **kwargs):
    return [sum(1.0 for token in ids if token < 1024) / max(len(ids), 1) for ids in completion_ids]


def _cases() -> list:
    engines = {"sft": ["ddp", "zero2", "fsdp2"], "dpo": ["ddp", "zero2", "fsdp2"], "grpo": ["ddp"]}
    # DDP runs in CI for each trainer; the sharded engines' runs (about 1.5 min each) are `slow` (make test-slow).
    return [
        pytest.param(
            trainer,
            *param.values,
            marks=[*param.marks, *([pytest.mark.slow] if param.id != "ddp" else [])],
            id=f"{param.id}-{trainer}",
        )
        for trainer, names in engines.items()
        for param in engine_params(names)
    ]


@pytest.mark.parametrize("trainer, engine", _cases())
def test_two_ranks_killed_after_checkpoint_resume_with_the_same_curve(trainer, engine, tmp_path):
    worker = f"{__file__}:train"
    full = launch(worker, tmp_path / "full", engine, trainer=trainer, mode="full", run_dir=str(tmp_path / "full-run"))
    run_dir = tmp_path / "run"
    with pytest.raises(AssertionError, match="failed with exit code"):
        launch(worker, tmp_path / "killed", engine, trainer=trainer, mode="kill", run_dir=str(run_dir))
    assert not any((tmp_path / "killed" / f"rank{rank}.json").exists() for rank in (0, 1)), "a rank outlived the kill"
    checkpoint = run_dir / f"checkpoint-{KILL_STEP}"
    assert (checkpoint / "trainer_state.json").is_file(), sorted(os.listdir(run_dir))
    assert not (run_dir / f"checkpoint-{KILL_STEP + 2}").exists()
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["global_step"] == KILL_STEP
    resumed = launch(worker, tmp_path / "resumed", engine, trainer=trainer, mode="resume", run_dir=str(run_dir))
    for rank in (0, 1):
        assert sorted(step_logs(full[rank]["logs"])) == list(range(1, MAX_STEPS + 1))
        assert_same_step_logs(step_logs(full[rank]["logs"]), step_logs(resumed[rank]["logs"]))
