"""glibc's malloc thresholds for CPU training (`trl/trainer/fast_paths/cpu_allocator.py`): freed activation memory stays
in the heap between steps, and the user's own allocator settings are never overridden."""

import os
import subprocess
import sys

import pytest

from trl.trainer.fast_paths.cpu_allocator import ENV_SWITCH, activation_memory_fallback_reason


PROBE = """
import ctypes, sys, torch
from trl.trainer.fast_paths.cpu_allocator import keep_activation_memory


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"
    )]


libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
applied = keep_activation_memory("cpu") if sys.argv[1] == "keep" else False
first, second = torch.empty(30 << 18).fill_(1.0), torch.empty(30 << 18).fill_(2.0)  # 30 MiB each
mapped_apart = libc.mallinfo2().hblkhd >> 20  # what got pages of its own
del first, second
kept_in_heap = libc.mallinfo2().fordblks >> 20  # what stays in the heap once freed
print(applied, mapped_apart, kept_in_heap)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator (Linux)")
def test_activations_come_from_the_heap_and_stay_there(monkeypatch):
    for key in list(os.environ):
        if key.startswith("MALLOC_") or key in ("GLIBC_TUNABLES", ENV_SWITCH, "LD_PRELOAD"):
            monkeypatch.delenv(key)
    results = {}
    for mode in ("default", "keep"):
        output = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
        applied, mapped_apart, kept_in_heap = output.stdout.split()
        results[mode] = (applied == "True", int(mapped_apart), int(kept_in_heap))
    # glibc's defaults: fresh 30 MiB blocks get pages of their own, returned (and faulted in again) every step.
    assert results["default"][0] is False and results["default"][1] >= 60
    # Kept: served from the heap, and still there, free, for the next step.
    applied, mapped_apart, kept_in_heap = results["keep"]
    assert applied and mapped_apart < 60 and kept_in_heap >= 60


@pytest.mark.parametrize(
    "environment, device, expected",
    [
        ({ENV_SWITCH: "0"}, "cpu", f"{ENV_SWITCH} is off"),
        ({}, "cuda", "training on cuda (activations are not in the C heap)"),
        ({"MALLOC_ARENA_MAX": "2"}, "cpu", "allocator settings chosen in the environment (MALLOC_ARENA_MAX)"),
        (
            {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"},
            "cpu",
            "allocator settings chosen in the environment (GLIBC_TUNABLES)",
        ),
        ({"LD_PRELOAD": "/usr/lib/libjemalloc.so"}, "cpu", "an allocator preloaded through LD_PRELOAD"),
    ],
    ids=["switched_off", "gpu", "malloc_env", "glibc_tunables", "preloaded_allocator"],
)
def test_user_settings_and_other_devices_are_left_alone(monkeypatch, environment, device, expected):
    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    assert activation_memory_fallback_reason(device) == expected
