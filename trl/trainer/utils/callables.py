"""Helpers about callables (reward functions, tools, collate hooks): the identity default, readable names, and
whether a call returns a coroutine."""

import functools
import inspect
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
