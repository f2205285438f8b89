"""A kill in the middle of a long command, for the tests of its resume."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def dies_on_call(n: int, real: Callable[..., Any]) -> Callable[..., Any]:
    """``real``, raising ``KeyboardInterrupt`` (a kill) on its ``n``-th call instead of running it."""
    calls = []

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    return wrapped
