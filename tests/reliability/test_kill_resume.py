"""Kill -9 and resume: a run killed with SIGKILL right after (or in the middle of) a checkpoint save and resumed with
`resume_from_checkpoint=True` logs the same numbers as the uninterrupted run.

Each test starts two real interpreters (`_run_trainer.py`): the first trains the uninterrupted reference run, then
starts the run that kills itself; the second resumes it. Everything a resumed run needs must therefore come from the
checkpoint on disk: data order, dropout and sampling RNG, the optimizer, the reference model (SyncRef), precomputed
reference log-probs, KL pairs, running statistics (BCO) and the token count (`num_tokens`).
"""

import json
import os
import subprocess
import sys

import pytest
from log_compare import assert_same_step_logs, step_logs


pytestmark = pytest.mark.reliability


RUNNER = os.path.join(os.path.dirname(__file__), "_run_trainer.py")
# (trainer, step after whose checkpoint the run is killed). GRPO generates for two steps at a time
# (steps_per_generation=2), so killing after step 3 resumes in the middle of a generation batch.
TRAINERS = [
    ("sft", 2),
    ("dpo", 2),
    ("dpo_precompute", 2),
    ("dpo_sync_ref", 2),
    ("reward", 2),
    ("prm", 2),
    ("kto", 2),
    ("bco", 2),
    ("cpo", 2),
    ("orpo", 2),
    ("grpo", 3),
    ("rloo", 2),
    ("online_dpo", 2),
    ("xpo", 2),
    ("nash_md", 2),
    ("bema", 3),  # BEMA averages every step and loads them into the reference model every second step
    ("gkd", 2),
    ("gold", 2),
    ("distillation", 2),
    ("ppo", 2),
    ("gfpo", 2),
    ("grpo_replay", 2),
]


def _run(*args, expect_kill=False):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, RUNNER, *map(str, args)], env=env, capture_output=True, text=True)
    if expect_kill:
        assert result.returncode == -9, f"expected a SIGKILL, got rc={result.returncode}\n{result.stderr[-3000:]}"
    else:
        assert result.returncode == 0, result.stderr[-3000:]


def assert_same_logs(reference_file, resumed_file, rtol=1e-5):
    logs = []
    for path in (reference_file, resumed_file):
        with open(path) as f:
            logs.append(step_logs(json.load(f)))
    assert_same_step_logs(*logs, rtol=rtol)


@pytest.mark.parametrize("trainer,kill_step", TRAINERS, ids=[name for name, _ in TRAINERS])
def test_sigkill_after_checkpoint_then_resume_matches_uninterrupted_run(tmp_path, trainer, kill_step):
    run_dir, reference_dir = tmp_path / "run", tmp_path / "reference"
    _run(trainer, run_dir, f"kill-after-save:{kill_step}", tmp_path / "killed.json", reference_dir,
         tmp_path / "reference.json", expect_kill=True)  # fmt: skip
    assert not (tmp_path / "killed.json").exists()
    _run(trainer, run_dir, "resume", tmp_path / "resumed.json")
    assert_same_logs(tmp_path / "reference.json", tmp_path / "resumed.json")
    if trainer == "bema":  # the averaged model saved at the end is the same as well
        from safetensors.torch import load_file

        reference, resumed = (load_file(d / "bema" / "model.safetensors") for d in (reference_dir, run_dir))
        assert reference.keys() == resumed.keys()
        for key, tensor in reference.items():
            assert (resumed[key] - tensor).abs().max() <= 1e-5 * tensor.abs().max() + 1e-7, key


def test_sigkill_during_save_keeps_previous_checkpoint_and_resumes_from_it(tmp_path):
    run_dir = tmp_path / "run"
    _run("sft", run_dir, "kill-during-save:3", tmp_path / "killed.json", tmp_path / "reference",
         tmp_path / "reference.json", expect_kill=True)  # fmt: skip
    # The interrupted save is left in its hidden staging directory: no `checkpoint-3`, checkpoint-2 untouched.
    names = sorted(os.listdir(run_dir))
    assert "checkpoint-3" not in names and "checkpoint-2" in names
    assert os.path.isfile(run_dir / "checkpoint-2" / "trainer_state.json")
    _run("sft", run_dir, "resume", tmp_path / "resumed.json")
    assert_same_logs(tmp_path / "reference.json", tmp_path / "resumed.json")
    assert not any(name.startswith(".partial-") for name in os.listdir(run_dir))


def test_diffusion_trainers_resume_only_from_complete_checkpoints(tmp_path):
    # DDPO / AlignProp write `trainer_state.json` after accelerate's `save_state`: a directory without it was cut
    # short by a kill and is never picked when resuming from the `checkpoints` folder.
    from trl.experimental._diffusion_trainer import _find_checkpoint

    checkpoints = tmp_path / "checkpoints"
    for index, complete in ((0, True), (1, True), (2, False)):
        (checkpoints / f"checkpoint_{index}").mkdir(parents=True)
        if complete:
            (checkpoints / f"checkpoint_{index}" / "trainer_state.json").write_text("{}")
    assert _find_checkpoint(str(checkpoints)) == str(checkpoints / "checkpoint_1")
    (checkpoints / "checkpoint_0" / "trainer_state.json").unlink()
    (checkpoints / "checkpoint_1" / "trainer_state.json").unlink()
    with pytest.raises(ValueError, match="No complete checkpoint_<n>"):
        _find_checkpoint(str(checkpoints))
