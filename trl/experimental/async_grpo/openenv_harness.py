"""OpenEnv harness rollouts for AsyncGRPO (requires the `openenv` package, imported with this module).

A harness drives one OpenEnv session per rollout and reports its reward (column `harness_reward`). This release
defines the public types; driving sessions is not implemented yet, and [`HarnessRolloutWorker`] says so when built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import openenv  # noqa: F401  (a hard requirement of this module, as in TRL)

from .async_rollout_worker import AsyncRolloutWorker


__all__ = ["CaptureContractError", "HarnessRolloutOutcome", "HarnessRolloutWorker"]


class CaptureContractError(ValueError):
    """A harness turn could not be captured losslessly as token ids (the rendered prompt does not extend the held
    tokens)."""


@dataclass
class HarnessRolloutOutcome:
    """What one harness rollout produced: its reward, completion messages, trace and tool-call counts."""

    env_reward: float | None
    completion: list[dict[str, Any]]
    trace: list[Any] = field(default_factory=list)
    tool_call_count: int = 0
    tool_failure_count: int = 0
    tool_calls_by_name: dict[str, int] = field(default_factory=dict)
    timed_out: bool = False


class HarnessRolloutWorker(AsyncRolloutWorker):
    """Rollout worker driving an OpenEnv harness session per rollout (not implemented in this release).

    Raises:
        NotImplementedError: Always; inject another `rollout_worker=` or train without the harness.
    """

    def __init__(
        self,
        *,
        harness_session_factory: Any = None,
        harness_adapter: Any = None,
        rollout_reward_fn: Any = None,
        lossless_capture: bool = True,
        **kwargs: Any,
    ):
        raise NotImplementedError(
            "HarnessRolloutWorker (OpenEnv harness rollouts) is not implemented yet in this release; use the default "
            "rollout worker with tools/environment_factory, or inject your own rollout_worker=."
        )
