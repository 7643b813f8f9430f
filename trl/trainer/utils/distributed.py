"""Process-group environment: `MASTER_ADDR`/`MASTER_PORT` for `torch.distributed`, whether DeepSpeed or FSDP will
shard the model, and a clean exit for processes of a gloo group."""

import atexit
import contextlib
import os
import platform
import socket
import time
from typing import Any


def _find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def ensure_master_addr_port(addr: str | None = None, port: int | None = None) -> None:
    """Make sure `MASTER_ADDR` and `MASTER_PORT` are set for `torch.distributed` initialisation.

    `MASTER_ADDR` keeps an existing value, else `addr`, else `"localhost"`. `MASTER_PORT` takes `port` when given,
    else keeps a valid existing value, else a free port is picked (empty, `"0"` and `"auto"` count as unset).

    Args:
        addr: Address used when `MASTER_ADDR` is not already set.
        port: Port to use; overrides any existing `MASTER_PORT`.
    """
    os.environ["MASTER_ADDR"] = os.environ.get("MASTER_ADDR") or addr or "localhost"
    if port is not None:
        os.environ["MASTER_PORT"] = str(port)
        return
    existing = os.environ.get("MASTER_PORT", "").strip()
    if existing.lower() not in ("", "0", "auto"):
        try:
            if 0 < int(existing) < 65536:
                return
        except ValueError:
            pass
    os.environ["MASTER_PORT"] = str(_find_free_port())


@contextlib.contextmanager
def global_then_local_main_first():
    """Run the block on the global main process first, then on the main process of each other node, then on all
    remaining processes (for work such as dataset preparation whose cache the later ones reuse).

    Every process passes the same two barriers, so the block runs in three waves; on a single process it just runs.
    """
    from accelerate import PartialState

    state = PartialState()
    if state.is_main_process:
        yield
        state.wait_for_everyone()
        state.wait_for_everyone()
    elif state.is_local_main_process:
        state.wait_for_everyone()
        yield
        state.wait_for_everyone()
    else:
        state.wait_for_everyone()
        state.wait_for_everyone()
        yield


def uses_sharding_engine(args: Any) -> bool:
    """Whether DeepSpeed or FSDP will wrap the model (the policy cannot then double as an unsharded reference).

    Both ways of asking count: the training arguments (`deepspeed=`, `fsdp=`) and an `accelerate launch` config,
    which reaches the process as `ACCELERATE_USE_DEEPSPEED` / `ACCELERATE_USE_FSDP` (and gives the arguments a
    `deepspeed_plugin`).
    """
    if getattr(args, "deepspeed", None) or getattr(args, "fsdp", None):
        return True
    if getattr(args, "deepspeed_plugin", None) is not None:
        return True
    flags = ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP")
    return any(os.environ.get(flag, "false").lower() == "true" for flag in flags)


def parameters_sharded(model: Any, across_ranks: bool = False) -> bool:
    """Whether `model`'s parameters are sharded by DeepSpeed ZeRO-3 or FSDP, whose hooks gather them collectively
    around the whole model's forward (so a part of the model cannot be run alone, and every rank must run as many
    forwards as the others).

    Args:
        model: The (possibly FSDP-managed) model.
        across_ranks: Only count sharding when more than one process takes part.
    """
    import torch.distributed as dist

    if across_ranks and not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    from transformers.integrations import is_deepspeed_zero3_enabled
    from transformers.integrations.fsdp import is_fsdp_managed_module

    return bool(
        is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model) or type(model).__name__.startswith("FSDP")
    )


# A gloo worker parked between collectives blocks in `std::condition_variable::wait`: a futex wait with the
# FUTEX_WAIT_BITSET | FUTEX_PRIVATE_FLAG | FUTEX_CLOCK_REALTIME operation (0x189) and no timeout. `take_gil` waits
# with a timeout, so a worker still waiting for the GIL never looks parked. The futex syscall's number depends on the
# architecture; elsewhere thread states count as unreadable.
_GLOO_WORKER_THREAD = "pt_gloo_runloop"
_FUTEX_SYSCALLS = {"x86_64": "202", "amd64": "202", "aarch64": "98", "arm64": "98"}
_PARKED_FUTEX_OP = "0x189"
_exit_guard_registered = False


def gloo_workers_parked() -> bool | None:
    """Whether every gloo worker thread of this process is parked (True when there is none).

    Returns:
        None where `/proc` cannot tell (not Linux, an architecture without a known futex syscall number, or thread
        details hidden).
    """
    futex_syscall = _FUTEX_SYSCALLS.get(platform.machine().lower())
    if futex_syscall is None:
        return None
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != _GLOO_WORKER_THREAD:
                    continue
            with open(f"/proc/self/task/{tid}/syscall") as f:
                fields = f.read().split()
            parked = len(fields) > 4 and fields[0] == futex_syscall and fields[2] == _PARKED_FUTEX_OP
            if not parked or int(fields[4], 16) != 0:
                return False
    except (OSError, ValueError):
        return None
    return True


def wait_for_idle_gloo_workers(timeout: float = 5.0, grace_without_proc: float = 0.05) -> None:
    """Give gloo's worker threads the GIL until they have finished with the last collective.

    A worker wakes the caller of a collective before it drops its own references to the finished work, and dropping
    the last reference to a tensor created in Python takes the GIL. `destroy_process_group` does not join the workers
    while anything (a DDP wrapper) still holds the group, so when a script ends right after a collective the
    interpreter can start finalizing first: the worker is then unwound inside a destructor and the process aborts
    ("terminate called without an active exception") after a successful run. Sleeping releases the GIL; the wait
    ends once every worker is parked, or after `timeout` seconds.

    Args:
        timeout: The longest wait, in seconds (a collective that never completes keeps its worker busy).
        grace_without_proc: Seconds to sleep instead where thread states cannot be read (not Linux).
    """
    deadline = time.monotonic() + timeout
    while True:
        parked = gloo_workers_parked()
        if parked is None:
            time.sleep(grace_without_proc)
            return
        if parked or time.monotonic() > deadline:
            return
        time.sleep(0.002)


def _wait_for_gloo_workers_at_exit() -> None:
    # Whether or not the group was destroyed: its workers outlive `destroy_process_group` while DDP holds the group.
    wait_for_idle_gloo_workers(timeout=2.0, grace_without_proc=0.0)


def guard_gloo_exit() -> None:
    """Make the interpreter wait for idle gloo workers before it finalizes (see [`wait_for_idle_gloo_workers`]).

    Exit handlers run while the interpreter is still whole, so a script that ends right after a collective (a plain
    `trainer.train()` under `accelerate launch` on CPUs, with or without `destroy_process_group()`) exits cleanly.
    Registered once; at exit, a process without gloo workers (or where `/proc` cannot tell) does not wait.
    """
    global _exit_guard_registered
    if not _exit_guard_registered:
        atexit.register(_wait_for_gloo_workers_at_exit)
        _exit_guard_registered = True
