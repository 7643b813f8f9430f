"""Helpers about callables (reward functions, tools, collate hooks): the identity default, readable names, and
whether a call returns a coroutine."""

import asyncio
import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any


def identity(x: Any) -> Any:
    """Return `x` unchanged."""
    return x


def _unwrap_partial(func: Any) -> Any:
    while isinstance(func, functools.partial):
        func = func.func
    return func


def get_callable_name(func: Callable) -> str:
    """Readable name of a function, method, `functools.partial` or callable object (its class name)."""
    func = _unwrap_partial(func)
    name = getattr(func, "__name__", None)
    if name is not None:
        return name
    return type(func).__name__


def is_async_callable(func: Callable) -> bool:
    """Whether calling `func` returns a coroutine (async function, partial of one, or object with async `__call__`)."""
    func = _unwrap_partial(func)
    if inspect.iscoroutinefunction(func):
        return True
    if inspect.isclass(func):  # calling a class builds an instance, never a coroutine
        return False
    call = getattr(func, "__call__", None)  # noqa: B004
    return call is not None and not inspect.isfunction(func) and inspect.iscoroutinefunction(call)


def start_event_loop_in_daemon(
    name: str | None = None,
) -> tuple[threading.Thread, asyncio.AbstractEventLoop, threading.Event]:
    """Start a fresh asyncio event loop running forever on a daemon thread.

    Submit work with `asyncio.run_coroutine_threadsafe(coro, loop)` once `ready` is set.

    Args:
        name: Name of the thread.

    Returns:
        `(thread, loop, ready)`: the thread, its loop, and an event set once the loop runs.
    """
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.call_soon(ready.set)
        loop.run_forever()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread, loop, ready


def shutdown_event_loop_in_daemon(thread: threading.Thread | None, loop: asyncio.AbstractEventLoop | None) -> None:
    """Stop a loop started by [`start_event_loop_in_daemon`], wait up to 5 s for its thread, then close the loop.

    `None` arguments (nothing was started) are accepted and do nothing.
    """
    if loop is None:
        return
    if loop.is_running():
        loop.call_soon_threadsafe(loop.stop)
    if thread is not None:
        thread.join(timeout=5)
    if not loop.is_running() and not loop.is_closed():
        loop.close()
