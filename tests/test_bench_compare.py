"""The side-by-side benchmark program (`benchmarks/compare.py`): its table logic, and a smoke run of every job."""

import argparse
import importlib.util
import os
import subprocess
import sys

import pytest


COMPARE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "compare.py")
PARITY_PYTHON = os.path.join(os.environ.get("PARITY_VENV", "/work/main/.venv-parity"), "bin", "python")
PARITY_112_PYTHON = os.path.join(os.environ.get("PARITY_VENV_112", "/work/main/.venv-parity-112"), "bin", "python")


def _load_compare():
    spec = importlib.util.spec_from_file_location("bench_compare", COMPARE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(side, cpu, rss, loss):
    return {
        "cpu_s": cpu,
        "wall_s": cpu / 2,
        "peak_rss_mb": rss,
        "tensor_peak_mb": rss / 2,
        "final_loss": loss,
        "tokens_per_step": 1000,
        "seq_len": 100,
        "items_per_step": 1000,
        "unit": "tokens/s",
        "side": side,
    }


def test_summary_ratios_and_loss_check(capsys):
    compare = _load_compare()
    compare.flops_per_token = lambda path, seq_len: 6.0  # no model config needed
    ours = [_run("ours", 1.0, 600.0, 0.5), _run("ours", 3.0, 700.0, 0.5)]
    trl = [_run("trl", 4.0, 1000.0, 0.5), _run("trl", 4.0, 1000.0, 0.5)]
    row = compare.summarise("sft_padded", ours, trl, peak=1e4, paths={"model": None})
    assert row["cpu_ratio"] == pytest.approx(0.5)  # medians: 2.0 / 4.0
    assert row["rss_ratio"] == pytest.approx(0.65)
    assert row["tensor_ratio"] == pytest.approx(0.65)
    assert row["rate_ratio"] == pytest.approx(2.0)
    assert row["ours_mfu"] == pytest.approx(6.0 * 1000 / 2.0 / 1e4)
    assert row["loss_agrees"]

    trl[-1]["final_loss"] = 0.6
    assert not compare.summarise("sft_padded", ours, trl, peak=1e4, paths={"model": None})["loss_agrees"]
    compare.print_table([row])
    assert "| sft_padded | 2.000 / 4.000 | 0.50 | 650 / 1000 | 0.65 | 325 / 500 | 0.65 |" in capsys.readouterr().out

    gpu = [dict(run, device="cuda") for run in trl]
    assert compare.summarise("sft_padded", ours, gpu, peak=1e4, paths={"model": None})["ours_mfu"] is None


def test_realistic_job_sizes():
    """The realistic shape's jobs run at the sizes the table states, whatever `--max_length` says."""
    compare = _load_compare()
    args = argparse.Namespace(shape="qwen2.5-0.5b", max_length=64)
    assert compare.job_size("sft_padded", args) == (2, 512)
    assert compare.job_size("sft_packed", args) == (1, 1024)
    assert compare.job_size("dpo", args) == (1, 512)
    assert compare.job_size("grpo", args)[0] == 8  # 2 prompts x 4 completions
    assert compare.job_size("tpo", args) == (1, 512)
    assert set(compare.REALISTIC_JOBS) == set(compare.JOBS + compare.EXTRA_JOBS)
    assert compare.job_size("dpo", argparse.Namespace(shape="small", max_length=64)) == (4, 64)
    assert compare.QWEN25_05B["vocab_size"] == 151936 and compare.QWEN25_05B["tie_word_embeddings"]


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(PARITY_PYTHON), reason="needs the TRL 1.16 parity venv (`make parity-env`)")
def test_quick_run_every_job():
    """`--quick`: every job runs on both sides (tiny model, 2 steps) and the final losses agree (exit code 0)."""
    proc = _run_compare("--quick")
    for job in ("sft_padded", "sft_packed", "dpo", "reward", "kto", "grpo"):
        assert f"| {job} |" in proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(
    not (os.path.exists(PARITY_PYTHON) and os.path.exists(PARITY_112_PYTHON)),
    reason="needs the TRL 1.16 and 1.12 parity venvs (`make parity-env parity-env-112`)",
)
def test_quick_run_extra_jobs():
    """`--quick --jobs ...`: the jobs beyond the six run on both sides and their final losses agree (BCO against
    TRL 1.12, which still had it)."""
    proc = _run_compare("--quick", "--jobs", ",".join(_load_compare().EXTRA_JOBS))
    for job in _load_compare().EXTRA_JOBS:
        assert f"| {job} |" in proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(PARITY_PYTHON), reason="needs the TRL 1.16 parity venv (`make parity-env`)")
def test_realistic_shape_reduced_runs_every_job(tmp_path):
    """The Qwen2.5-0.5B shape at 2 layers (full width and vocabulary), one measured step: every job, losses agree."""
    proc = _run_compare(
        "--shape", "qwen2.5-0.5b", "--layers", "2", "--steps", "1", "--warmup", "0", cache=str(tmp_path)
    )
    for job in ("sft_padded", "sft_packed", "dpo", "reward", "kto", "grpo"):
        assert f"| {job} |" in proc.stdout
    config = os.path.join(tmp_path, "qwen2.5-0.5b-2layers", "config.json")
    assert '"vocab_size": 151936' in open(config).read()


def test_lora_refuses_a_trainer_without_peft_config():
    """`--lora` with A2PO (whose trainer takes no `peft_config`, as in TRL) stops before anything runs."""
    proc = subprocess.run(
        [sys.executable, COMPARE, "--quick", "--lora", "4", "--jobs", "dpo,a2po"], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "A2POTrainer takes no peft_config" in proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(PARITY_PYTHON), reason="needs the TRL 1.16 parity venv (`make parity-env`)")
def test_quick_run_with_lora():
    """`--lora R`: both sides train the same LoRA adapters and their final losses agree."""
    proc = _run_compare("--quick", "--lora", "4", "--jobs", "sft_packed,dpo,distillation")
    for job in ("sft_packed", "dpo", "distillation"):
        assert f"| {job} |" in proc.stdout


def _run_compare(*flags: str, cache: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(COMPARE))
    if cache:
        env["TRL_BENCH_CACHE"] = cache
    proc = subprocess.run([sys.executable, COMPARE, *flags], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc
