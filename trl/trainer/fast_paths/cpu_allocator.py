"""glibc `malloc` settings that stop CPU training from returning and re-faulting its activation memory every step.

A training step on the CPU allocates and frees hundreds of megabytes of activations. With glibc's default (dynamic)
settings, an allocation above the current mmap threshold gets pages of its own from the kernel and gives them back
when freed, and the heap is trimmed whenever its free top exceeds twice that threshold; each following step then
faults the same memory in again, page by page (a KTO step of the benchmark took ~130 000 page faults, ~7 % of its
time). [`keep_activation_memory`] fixes the mmap threshold at the top of glibc's dynamic range (32 MiB) and the trim
threshold above a step's working set (128 MiB): allocations up to 32 MiB are served from the heap, and freed memory
stays there for the next step. Peak memory does not grow (the heap reaches the same high-water mark; it just stays
there between steps).

The settings are process-wide and stay for the life of the process (glibc offers no way back to its dynamic
thresholds). They apply only when training on the CPU with glibc's allocator, and never when the user chose
allocator settings of their own (`MALLOC_*` or `GLIBC_TUNABLES` in the environment, or an allocator preloaded through
`LD_PRELOAD`); `TRL_KEEP_ACTIVATION_MEMORY=0` turns them off.
"""

import ctypes
import logging
import os
import sys


logger = logging.getLogger(__name__)

# `mallopt` parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# The largest mmap threshold glibc's dynamic adjustment reaches on 64-bit systems, and a trim threshold above the
# activations a training step frees at once.
MMAP_THRESHOLD = 32 * 1024 * 1024
TRIM_THRESHOLD = 128 * 1024 * 1024
ENV_SWITCH = "TRL_KEEP_ACTIVATION_MEMORY"

_applied = False


def activation_memory_fallback_reason(device_type: str) -> str | None:
    """Why [`keep_activation_memory`] leaves the allocator alone for training on `device_type`, or None.

    Args:
        device_type: Device type of the trained parameters (`"cpu"`, `"cuda"`, ...).

    Returns:
        A short reason, or None.
    """
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return f"{ENV_SWITCH} is off"
    if device_type != "cpu":
        return f"training on {device_type} (activations are not in the C heap)"
    if not sys.platform.startswith("linux"):
        return f"platform {sys.platform} (glibc only)"
    chosen = sorted(key for key in os.environ if key.startswith("MALLOC_") or key == "GLIBC_TUNABLES")
    if chosen:
        return f"allocator settings chosen in the environment ({', '.join(chosen)})"
    if "malloc" in os.environ.get("LD_PRELOAD", ""):
        return "an allocator preloaded through LD_PRELOAD"
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return "no C library to load"
    if not (hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt")):
        return "not glibc"
    return None


def keep_activation_memory(device_type: str) -> bool:
    """Set glibc's mmap and trim thresholds for CPU training (see the module docstring), once per process.

    Args:
        device_type: Device type of the trained parameters.

    Returns:
        Whether the settings are in place (set now or by an earlier call).
    """
    global _applied
    if _applied:
        return True
    reason = activation_memory_fallback_reason(device_type)
    if reason is not None:
        logger.debug("glibc malloc thresholds left as they are: %s", reason)
        return False
    libc = ctypes.CDLL(None)
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    applied = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    applied = libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and applied
    if applied:
        logger.info(
            "CPU training: glibc malloc keeps freed activation memory for the next step (mmap threshold %d MiB, trim "
            "threshold %d MiB, process-wide; %s=0 turns this off).",
            MMAP_THRESHOLD >> 20,
            TRIM_THRESHOLD >> 20,
            ENV_SWITCH,
        )
    _applied = applied
    return applied
