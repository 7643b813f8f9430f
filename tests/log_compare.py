"""Step-by-step comparison of two runs' logged numbers (the kill-and-resume tests, single- and multi-process, and
the cross-library resume tests)."""

import math

import pytest


# Wall-clock measurements differ between runs by nature; everything else must match.
TIMING_KEYS = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos"}


def step_logs(log_history: list[dict]) -> dict[int, dict]:
    """The training-step entries of a `log_history` (those with a `loss`), by step."""
    return {entry["step"]: entry for entry in log_history if "loss" in entry}


def assert_same_step_logs(reference, resumed, rtol=1e-5, atol=1e-7, skip=(), after_step=0):
    """Both runs logged the same steps, and every numeric value of the steps after `after_step` matches (NaN
    included), apart from timings and the keys in `skip`."""
    assert sorted(resumed) == sorted(reference)
    for step, entry in reference.items():
        if step <= after_step:
            continue
        for key, value in entry.items():
            if key in TIMING_KEYS or key in skip or not isinstance(value, (int, float)):
                continue
            other = resumed[step].get(key)
            assert other is not None, f"step {step}: {key} missing after resume"
            if math.isnan(value):
                assert math.isnan(other), f"step {step}: {key}"
            else:
                assert other == pytest.approx(value, rel=rtol, abs=atol), f"step {step}: {key}: {other} != {value}"
