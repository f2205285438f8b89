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
    which writing it would destroy; nor is a JSON object with a ``format`` (a file of draftgym's own kinds: a cost
    model, a batch cost model; no ``--json`` result has one). An empty file holds nothing to lose; one over
    ``EARLIER_JSON_MAX_BYTES`` is not read and counts as something else."""
    value = _earlier_json(path)
    return value is not _NOTHING and (
        value is _OTHER
        or not isinstance(value, (dict, list))
        or (isinstance(value, dict) and "format" in value)
    )


def holds_other_than(path: Path, formats: tuple[str, ...]) -> bool:
    """``path`` is an existing file that is not a JSON object of one of ``formats`` (its ``format`` field): the
    earlier output a file of that kind may replace (an empty file holds nothing to lose)."""
    value = _earlier_json(path)
    return value is not _NOTHING and not (isinstance(value, dict) and value.get("format") in formats)


def format_of(path: Path) -> str | None:
    """The ``format`` of a JSON object file (a draftgym file of its own kind), else None."""
    value = _earlier_json(path)
    return str(value["format"])[:60] if isinstance(value, dict) and "format" in value else None


_NOTHING, _OTHER = object(), object()


def _earlier_json(path: Path) -> object:
    """The JSON value of the file at ``path``; ``_NOTHING`` for no file or an empty one, ``_OTHER`` for one that is
    not JSON (or too large to read for it)."""
    if not path.is_file():
        return _NOTHING
    try:
        with path.open("rb") as fh:
            data = fh.read(EARLIER_JSON_MAX_BYTES + 1)
    except OSError:
        return _NOTHING
    if len(data) > EARLIER_JSON_MAX_BYTES:
        return _OTHER
    if not data.strip():
        return _NOTHING
    try:  # the whole file: a JSONL's first line alone is a JSON value too
        return json.loads(data)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return _OTHER
