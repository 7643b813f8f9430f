"""A clean exit for processes of a gloo group: `release_process_group` (the scripts' last call) and the exit guard
every trainer registers leave gloo's worker threads parked before the interpreter finalizes. A worker still releasing
a collective's tensors then would abort the rank ("terminate called without an active exception") after a successful
run."""

import subprocess
import sys
import textwrap

import pytest

import trl.trainer.utils.distributed as distributed
from trl.scripts._training import release_process_group
from trl.trainer.utils.distributed import gloo_workers_parked, guard_gloo_exit


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads thread states from /proc")

_SCRIPT = textwrap.dedent(
    """
    import os, socket, sys, torch, torch.distributed as dist
    from trl.scripts._training import release_process_group
    from trl.trainer.utils.distributed import _wait_for_gloo_workers_at_exit, gloo_workers_parked, guard_gloo_exit

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    group = dist.group.WORLD  # held like a DDP wrapper holds it: destroy_process_group cannot join the workers
    guard_gloo_exit()
    for _ in range(20):
        objects = [{"rates": [0.6]}]
        dist.broadcast_object_list(objects, src=0)
        dist.all_reduce(torch.ones(4))
    if sys.argv[1] == "release":
        release_process_group()
    else:  # what the exit guard runs
        _wait_for_gloo_workers_at_exit()
    workers = [
        tid for tid in os.listdir("/proc/self/task")
        if open(f"/proc/self/task/{tid}/comm").read().strip() == "pt_gloo_runloop"
    ]
    print("initialized", dist.is_initialized(), "workers", len(workers), "parked", gloo_workers_parked())
    """
)


@linux_only
@pytest.mark.parametrize("ending, initialized", [("release", "False"), ("exit_guard", "True")])
def test_gloo_workers_parked_at_the_end_and_the_process_exits_cleanly(ending, initialized):
    result = subprocess.run([sys.executable, "-c", _SCRIPT, ending], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "terminate called" not in result.stderr
    assert result.stdout.split() == ["initialized", initialized, "workers", "2", "parked", "True"]


def test_release_without_process_group_is_a_no_op():
    import torch.distributed as dist

    assert not dist.is_initialized()
    release_process_group()
    assert not dist.is_initialized()


@linux_only
def test_no_gloo_workers_counts_as_parked():
    # This process has no gloo group, hence no worker to wait for.
    assert gloo_workers_parked() is True


def test_exit_guard_registers_once(monkeypatch):
    registered = []
    monkeypatch.setattr(distributed, "_exit_guard_registered", False)
    monkeypatch.setattr(distributed.atexit, "register", registered.append)
    guard_gloo_exit()
    guard_gloo_exit()
    assert registered == [distributed._wait_for_gloo_workers_at_exit]


def test_training_registers_the_exit_guard(monkeypatch, tmp_path):
    from datasets import Dataset

    from trl import SFTConfig, SFTTrainer
    from trl.assets import get_model_path

    registered = []
    monkeypatch.setattr(distributed, "_exit_guard_registered", False)
    monkeypatch.setattr(distributed.atexit, "register", registered.append)
    args = SFTConfig(output_dir=str(tmp_path), max_steps=1, report_to="none", save_strategy="no", use_cpu=True)
    trainer = SFTTrainer(
        get_model_path("tiny-Qwen2ForCausalLM"), args=args, train_dataset=Dataset.from_dict({"text": ["a b c"] * 8})
    )
    trainer.train()
    assert registered.count(distributed._wait_for_gloo_workers_at_exit) == 1  # (tqdm registers its own)


def test_unknown_architecture_falls_back_to_a_grace_period(monkeypatch):
    # Without the futex syscall's number, thread states cannot be read: no endless wait, only the grace period.
    import time

    monkeypatch.setattr(distributed.platform, "machine", lambda: "riscv64")
    assert gloo_workers_parked() is None
    start = time.monotonic()
    distributed.wait_for_idle_gloo_workers(timeout=10.0, grace_without_proc=0.01)
    assert time.monotonic() - start < 1.0
