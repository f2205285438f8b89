"""The loads of the serving env (``draftgym/SpecServe-v0``) and the request stream of one episode under each.

Loads (``loads``: one is drawn per episode):

- ``"C"`` (an integer): closed loop, C requests in flight (the next enters as soon as one leaves);
- ``"ramp"``: closed loop whose concurrency doubles from 1 to ``max_batch`` and back (1, 2, 4, 8, 16, 8, 4, 2, 1
  at 16), each level held for as many requests as the level (``ramp_caps``);
- ``"poisson@X"``: open loop, Poisson arrivals at X times the unit rate (the rate at which one row decoding
  autoregressively finishes requests of the trace's mean length under the cost model);
- ``"bursty"``: open loop, bursts of a geometric number of requests (mean 8) arriving together, at 2x the unit
  rate on average.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from env.serve_obs import ServeEnvError


@dataclass(frozen=True)
class Load:
    name: str
    closed: bool
    level: float  # concurrency (closed), or multiple of the unit rate (open)


RATE_RANGE = (0.01, 1000.0)  # poisson@X: X times the unit rate


def parse_load(text: str, max_batch: int) -> Load:
    t = str(text).strip()
    if t in ("ramp", "bursty"):
        return Load(t, t == "ramp", 0.0)
    if t.startswith("poisson@"):
        try:
            x = float(t.removeprefix("poisson@"))
        except ValueError:
            x = -1.0
        if not RATE_RANGE[0] <= x <= RATE_RANGE[1]:  # NaN and inf too; a live server would wait on the rest
            raise ServeEnvError(f"load {t!r}: the rate is a multiple of the unit rate in "
                                f"{RATE_RANGE[0]}..{RATE_RANGE[1]}, e.g. poisson@2")  # fmt: skip
        return Load(t, False, x)
    try:
        c = int(t)
    except ValueError:
        raise ServeEnvError(
            f"unknown load {t!r}; valid: a concurrency (1, 2, 4, ...), ramp, bursty, poisson@X"
        ) from None
    if not 1 <= c <= max_batch:
        raise ServeEnvError(f"load {t}: the concurrency must be in 1..{max_batch} (max_batch)")
    return Load(t, True, float(c))


def levels_upto(max_batch: int) -> list[int]:
    """1, 2, 4, ... up to ``max_batch`` (which ends the list)."""
    up = [1]
    while up[-1] * 2 <= max_batch:
        up.append(up[-1] * 2)
    if up[-1] != max_batch:
        up.append(max_batch)
    return up


def ramp_caps(max_batch: int) -> list[int]:
    """The ramp's concurrency cap per request: 1, 2, 4, ... ``max_batch`` and back down, each level held for as
    many requests as the level."""
    up = levels_upto(max_batch)
    caps = []
    for c in up + up[-2::-1]:
        caps += [c] * c
    return caps


def request_stream(load: Load, requests: int, max_batch: int, unit_rate: float,
                   rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """(arrival seconds, closed-loop concurrency cap) per request of one episode (``ramp``: its own count)."""
    if load.name == "ramp":
        caps = np.asarray(ramp_caps(max_batch), np.int64)
        return np.zeros(len(caps)), caps
    if load.closed:
        return np.zeros(requests), np.full(requests, int(load.level), np.int64)
    if load.name == "bursty":
        sizes = []
        while sum(sizes) < requests:
            sizes.append(int(rng.geometric(1 / 8)))
        mean_gap = 8.0 / (2.0 * unit_rate)
        gaps = rng.exponential(mean_gap, size=len(sizes))
        gaps[0] = 0.0  # the first burst at 0, every later one a whole gap after the one before
        starts = np.cumsum(gaps)
        arr = np.repeat(starts, sizes)[:requests]
    else:
        gaps = rng.exponential(1.0 / (load.level * unit_rate), size=requests)
        gaps[0] = 0.0
        arr = np.cumsum(gaps)
    return arr, np.full(requests, max_batch, np.int64)


__all__ = ["Load", "levels_upto", "parse_load", "ramp_caps", "request_stream"]
