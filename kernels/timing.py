"""Timing a few functions against each other: each called in turn within every repetition, so that a drift of the
machine's speed hits them alike (the weight-format probe, and the benchmark programs)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence


def interleaved_ms(fns: Sequence[Callable[[], object]], reps: int, warm: int = 1) -> list[float]:
    """Median ms of each function over ``reps`` repetitions, timed in turn, after ``warm`` untimed calls of each (a
    fresh process's first calls pay for thread start-up and kernel selection)."""
    for fn in fns:
        for _ in range(warm):
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [1e3 * statistics.median(ts) for ts in times]
