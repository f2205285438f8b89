"""Timing a few functions against each other: each called in turn within every repetition, so that a drift of the
machine's speed hits them alike (the weight-format probe, and the benchmark programs)."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path


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


# The largest file ``--json`` may take for an earlier result (read whole to check that it is one): a larger one is
# not overwritten.
EARLIER_JSON_MAX_BYTES = 64 << 20


def holds_other_than_json(path: Path) -> bool:
    """``path`` is an existing file that is not one JSON object or array: not an earlier result of a ``--json``
    output (a policy, a trace, a model file, a JSONL of questions or records named there by a misplaced flag),
    which writing it would destroy. An empty file holds nothing to lose; one over ``EARLIER_JSON_MAX_BYTES`` is not
    read and counts as something else."""
    if not path.is_file():
        return False
    try:
        with path.open("rb") as fh:
            data = fh.read(EARLIER_JSON_MAX_BYTES + 1)
    except OSError:
        return False
    if len(data) > EARLIER_JSON_MAX_BYTES:
        return True
    if not data.strip():
        return False
    try:  # the whole file: a JSONL's first line alone is a JSON value too
        value = json.loads(data)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return True
    return not isinstance(value, (dict, list))
