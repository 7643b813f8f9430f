"""`release_process_group`: the end of a multi-process run leaves gloo's worker threads parked before the interpreter
finalizes (a worker still releasing a collective's tensors then would abort the rank at exit)."""

import subprocess
import sys
import textwrap

import pytest

from trl.scripts._training import _gloo_workers_parked, release_process_group


_SCRIPT = textwrap.dedent(
    """
    import os, socket, torch, torch.distributed as dist
    from trl.scripts._training import _gloo_workers_parked, release_process_group

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    group = dist.group.WORLD  # held like a DDP wrapper holds it: destroy_process_group cannot join the workers
    for _ in range(20):
        objects = [{"rates": [0.6]}]
        dist.broadcast_object_list(objects, src=0)
        dist.all_reduce(torch.ones(4))
    release_process_group()
    workers = [t for t in os.listdir("/proc/self/task") if open(f"/proc/self/task/{t}/comm").read().strip() == "pt_gloo_runloop"]
    print("initialized", dist.is_initialized(), "workers", len(workers), "parked", _gloo_workers_parked())
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads thread states from /proc (Linux only)")
def test_release_leaves_gloo_workers_parked_and_exits_cleanly():
    result = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "terminate called" not in result.stderr
    assert result.stdout.split() == ["initialized", "False", "workers", "2", "parked", "True"]


def test_release_without_process_group_is_a_no_op():
    import torch.distributed as dist

    assert not dist.is_initialized()
    release_process_group()
    assert not dist.is_initialized()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads thread states from /proc (Linux only)")
def test_no_gloo_workers_counts_as_parked():
    # This process has no gloo group, hence no worker to wait for.
    assert _gloo_workers_parked() is True
