"""A run moves between real TRL 1.16 and this project mid-training and keeps its loss curve.

For each trainer, in real subprocesses (`_cross_resume_run.py`, TRL's public API only):

- TRL trains and is SIGKILLed right after checkpoint 2; this project resumes from that checkpoint, and its logs from
  step 3 on equal those of this project's uninterrupted run;
- this project trains and is SIGKILLed after checkpoint 2; TRL resumes from it, and its logs equal TRL's
  uninterrupted run.

`num_tokens` is compared too where this project resumes (a TRL checkpoint has no `trl_state_<rank>.pt`; the count is
taken from the logged history at the checkpoint's step). TRL itself restarts `num_tokens` from zero on every resume,
its own checkpoints included, so that key is left out where TRL resumes.

Needs TRL's environment: `make parity-env` (or `PARITY_VENV=<venv>`); the tests skip without it.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from log_compare import assert_same_step_logs, step_logs


pytestmark = pytest.mark.parity

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
RUNNER = HERE / "_cross_resume_run.py"
TRL_PYTHON = Path(os.environ.get("PARITY_VENV", REPO / ".venv-parity")) / "bin" / "python"
TRAINERS = ["sft", "dpo", "kto", "reward", "grpo"]  # and the refreshed references below
KILL_STEP = 2
# The two libraries' weights after the same steps differ by float rounding (AdamW moves every element whose gradient is
# rounding noise by a whole learning rate), and the continuation inherits that: up to ~1e-3 relative in KTO's logit
# means. A resume that loses the optimizer state, the data position or the RNG moves the values by percents.
RTOL = 2e-3
# Differences of two such values (a reward margin near zero) are compared to the rounding of the values themselves.
ATOL = 1e-4


@pytest.fixture(scope="module")
def assets_file(tmp_path_factory):
    if not TRL_PYTHON.exists():
        pytest.skip(f"no TRL environment at {TRL_PYTHON}: run `make parity-env` or set PARITY_VENV")
    from trl.assets import get_dataset_path, get_model_path

    paths = {
        f"models/{m}": get_model_path(m) for m in ("tiny-Qwen2ForCausalLM", "tiny-Qwen2ForSequenceClassification")
    }
    datasets = (
        "standard_language_modeling",
        "standard_preference",
        "standard_unpaired_preference",
        "standard_prompt_only",
    )
    paths.update({f"datasets/{d}": get_dataset_path(d) for d in datasets})
    path = tmp_path_factory.mktemp("cross-resume") / "assets.json"
    path.write_text(json.dumps(paths))
    return path


def _run(side, assets, trainer, output_dir, mode, log_file, scratch, stderr=None):
    """Run the runner under `side` ("trl": the parity venv, no PYTHONPATH; "ours": this checkout); the process's
    stderr is appended to the list `stderr` when one is given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON") and k != "VIRTUAL_ENV"}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    if side == "trl":
        command = [str(TRL_PYTHON), "-s", str(RUNNER)]
    else:
        env["PYTHONPATH"] = str(REPO)
        command = [sys.executable, str(RUNNER)]
    command += [str(assets), trainer, str(output_dir), mode, str(log_file)]
    result = subprocess.run(command, cwd=scratch, env=env, capture_output=True, text=True, timeout=600)
    if stderr is not None:
        stderr.append(result.stderr)
    if mode.startswith("kill-after-save:"):
        assert result.returncode == -9, (
            f"{side}: expected a SIGKILL, got rc={result.returncode}\n{result.stderr[-3000:]}"
        )
        return None
    assert result.returncode == 0, f"{side} {mode}:\n{result.stderr[-3000:]}"
    with open(log_file) as f:
        logs = json.load(f)
    expected_root = TRL_PYTHON.parent.parent if side == "trl" else REPO
    assert str(Path(logs["trl"]).resolve()).startswith(str(expected_root.resolve())), logs["trl"]
    return step_logs(logs["logs"])


# SFT and GRPO run in CI; DPO, KTO and Reward (the same checkpoint files, about a minute each) are `slow`.
@pytest.mark.parametrize(
    "trainer", [name if name in ("sft", "grpo") else pytest.param(name, marks=pytest.mark.slow) for name in TRAINERS]
)
@pytest.mark.parametrize("writer,resumer", [("trl", "ours"), ("ours", "trl")], ids=["trl-to-ours", "ours-to-trl"])
def test_checkpoint_of_one_library_resumes_under_the_other(trainer, writer, resumer, assets_file, tmp_path):
    killed = tmp_path / "killed"
    _run(writer, assets_file, trainer, killed, f"kill-after-save:{KILL_STEP}", tmp_path / "k.json", tmp_path)
    checkpoint = killed / f"checkpoint-{KILL_STEP}"
    assert (checkpoint / "trainer_state.json").is_file(), sorted(os.listdir(killed))
    resumed = _run(resumer, assets_file, trainer, tmp_path / "resumed", f"resume:{checkpoint}", tmp_path / "r.json",
                   tmp_path)  # fmt: skip
    reference = _run(resumer, assets_file, trainer, tmp_path / "full", "full", tmp_path / "f.json", tmp_path)
    skip = ("num_tokens",) if resumer == "trl" else ()
    # The continuation (steps after the checkpoint) matches; the steps before it are the writer's history.
    assert_same_step_logs(reference, resumed, rtol=RTOL, atol=ATOL, skip=skip, after_step=KILL_STEP)


# The reference model refreshed during training (TR-DPO's `sync_ref_model`, BEMA weights loaded into the reference).
# TRL's checkpoints keep neither the refreshed reference nor the BEMA averages, and TRL resuming its own checkpoint
# restarts them from the initial / resumed weights. This project writes them into its checkpoints (`ref_model.safetensors`,
# `bema_state.safetensors`) and resumes its own runs exactly (tests/reliability/test_kill_resume.py). Across libraries:
# - TRL resuming this project's checkpoint continues exactly as TRL resuming its own (the extra files are ignored);
# - this project resuming TRL's checkpoint has nothing to restore: it continues as TRL does and warns that the state
#   restarted, instead of departing silently from an uninterrupted run.
REFRESHED_REFERENCE = {"dpo_syncref": "holds no reference-model weights", "dpo_bema": "holds no BEMA state"}


@pytest.mark.slow
@pytest.mark.parametrize("trainer", sorted(REFRESHED_REFERENCE))
def test_refreshed_reference_state_moves_between_libraries(trainer, assets_file, tmp_path):
    for writer in ("trl", "ours"):
        _run(writer, assets_file, trainer, tmp_path / f"killed-{writer}", f"kill-after-save:{KILL_STEP}",
             tmp_path / "k.json", tmp_path)  # fmt: skip

    def resume(writer, resumer, stderr=None):
        checkpoint = tmp_path / f"killed-{writer}" / f"checkpoint-{KILL_STEP}"
        return _run(resumer, assets_file, trainer, tmp_path / f"resumed-{writer}-{resumer}", f"resume:{checkpoint}",
                    tmp_path / "r.json", tmp_path, stderr)  # fmt: skip

    trl_own = resume("trl", "trl")
    assert_same_step_logs(trl_own, resume("ours", "trl"), rtol=RTOL, atol=ATOL, skip=("num_tokens",),
                          after_step=KILL_STEP)  # fmt: skip
    stderr = []
    ours_from_trl = resume("trl", "ours", stderr)
    assert REFRESHED_REFERENCE[trainer] in stderr[0], stderr[0][-2000:]
    assert_same_step_logs(trl_own, ours_from_trl, rtol=RTOL, atol=ATOL, skip=("num_tokens",), after_step=KILL_STEP)
