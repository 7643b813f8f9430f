"""What the asynchronous trainers do on several processes: rank 0 owns the rollouts, the others follow its decisions.

Rank 0 alone talks to the servers, runs the rollout worker and reads the queue; every other rank only receives the
rows rank 0 dispatches. So whatever rank 0 decides or fails at must reach the other ranks, or they wait forever in
their next collective: [`rank0_call`] broadcasts a value or an error from rank 0, and a failure while rank 0 reads
the queue travels as a marked micro-batch ([`RelayFailures`], [`collate_or_relay`], [`raise_relayed_failure`]) that
every rank turns into an error at the same training step. With one process none of this communicates.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from accelerate import PartialState
from torch.utils.data import IterableDataset


T = TypeVar("T")

# The key of the micro-batch that carries rank 0's error (the UTF-8 bytes of its message, one copy per rank).
FAILURE_KEY = "rank0_failure"


def _picklable(error: BaseException) -> BaseException:
    """`error` itself when it can be broadcast, else a `RuntimeError` with its type and message."""
    try:
        pickle.dumps(error)
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


def rank0_call(fn: Callable[[], T], is_source: bool, broadcast_result: bool = True) -> T | None:
    """Call `fn` on rank 0 only and raise its error, if any, on every rank.

    Args:
        fn: What rank 0 does (build a client, ask the server, start the worker).
        is_source: Whether this process is rank 0.
        broadcast_result: Whether the other ranks receive `fn`'s (picklable) result; without, they get `None`.

    Returns:
        `fn()` on rank 0; on the other ranks its result with `broadcast_result`, else `None`.
    """
    if PartialState().num_processes <= 1:
        return fn() if is_source else None
    from accelerate.utils import broadcast_object_list

    outcome: list[Any] = [None, None, None]  # (result, error, its cause: pickling drops `__cause__`)
    result = None
    if is_source:
        try:
            result = fn()
            outcome = [result if broadcast_result else None, None, None]
        except Exception as error:
            cause = error.__cause__
            outcome = [None, _picklable(error), _picklable(cause) if cause is not None else None]
            broadcast_object_list(outcome, from_process=0)
            raise
    broadcast_object_list(outcome, from_process=0)
    if outcome[1] is not None:
        raise outcome[1] from outcome[2]
    return result if is_source else outcome[0]


class _Failure:
    """A planner item standing for the error rank 0 hit while reading the rollout queue."""

    def __init__(self, error: BaseException):
        self.error = error


class RelayFailures(IterableDataset):
    """Rank 0's planner, with an error raised while planning turned into one last [`_Failure`] item.

    The item reaches the other ranks as a micro-batch (see [`collate_or_relay`]) instead of leaving them blocked in
    the dispatch of a micro-batch that never comes. `error` keeps the original exception for rank 0 to raise.
    """

    def __init__(self, planner: IterableDataset):
        self.planner = planner
        self.error: BaseException | None = None

    def __iter__(self) -> Iterator[Any]:
        try:
            yield from self.planner
        except Exception as error:
            self.error = error
            yield _Failure(error)


def _describe(error: BaseException) -> str:
    message = repr(error)
    if error.__cause__ is not None:
        message += f" (caused by {error.__cause__!r})"
    return message


def collate_or_relay(
    collator: Callable, num_processes: int, relay: RelayFailures
) -> Callable[[list], dict[str, torch.Tensor]]:
    """`collator`, except that a [`_Failure`], or an error of `collator` itself (kept in `relay.error`), becomes
    `{FAILURE_KEY: message bytes}` repeated once per process."""

    def failure_batch(error: BaseException) -> dict[str, torch.Tensor]:
        message = torch.tensor(list(_describe(error).encode()), dtype=torch.uint8)
        return {FAILURE_KEY: message.unsqueeze(0).repeat(num_processes, 1)}

    def collate(examples: list) -> dict[str, torch.Tensor]:
        if examples and isinstance(examples[0], _Failure):
            return failure_batch(examples[0].error)
        try:
            return collator(examples)
        except Exception as error:
            relay.error = error
            return failure_batch(error)

    return collate


def raise_relayed_failure(inputs: dict[str, Any], relay: RelayFailures | None) -> None:
    """Raise when `inputs` is rank 0's failure: rank 0 re-raises its own error, the other ranks a `RuntimeError`
    carrying its message."""
    if FAILURE_KEY not in inputs:
        return
    if relay is not None and relay.error is not None:
        raise relay.error
    message = bytes(inputs[FAILURE_KEY][0].tolist()).decode(errors="replace")
    raise RuntimeError(f"Training stopped on rank 0, which owns the rollouts: {message}")
