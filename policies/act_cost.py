"""What a serving policy's own decision costs a live step: the seconds of one ``act`` on one observation (and, for an
online policy, its ``update``), as ``env.serving.serve`` calls them every step, timed on this machine. Replay
charges it (``env.serve_sim.ServeSim.price_policy``) beside the cost model's bookkeeping, so that a policy that
observes is not priced as if it decided for free while a static arm, served as an engine configured with it, pays
nothing."""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import numpy as np

CALLS = 200  # timed calls; the median kept


def sample_observations(sim: Any, steps: int = 32) -> np.ndarray:
    """Observations of ``sim``'s servers (reset) over its first ``steps`` steps under the first arm: ``[n, obs]``,
    the rows of servers that had requests in flight (the states a live policy reads)."""
    out = []
    a = np.zeros(sim.num_envs, np.int64)
    for _ in range(steps):
        if sim.done().all():
            break
        obs = sim.observe()
        out.append(obs[sim.active.any(1)].copy())
        sim.step(a)
    got = np.concatenate(out) if out else np.empty((0, sim.observe().shape[1]), np.float32)
    if got.shape[0] == 0:
        raise ValueError("the servers had no request in flight to observe")
    return got


def act_seconds(policy: Any, observations: np.ndarray, calls: int = CALLS) -> float:
    """Median seconds of one live decision of ``policy``: ``act`` on one observation (a row of ``observations``, in
    turn), then ``update`` with that action for an online policy (on a copy: the policy given does not learn)."""
    pol = copy.deepcopy(policy) if hasattr(policy, "update") else policy
    update = getattr(pol, "update", None)
    obs = np.asarray(observations, np.float32)
    times = []
    for i in range(max(int(calls), 1)):
        o = obs[i % len(obs)]
        t0 = time.perf_counter()
        a = pol.act(o)
        if update is not None:
            update(o, int(np.asarray(a).reshape(-1)[0]), 1.0, {})
        times.append(time.perf_counter() - t0)
    return float(statistics.median(times))


__all__ = ["CALLS", "act_seconds", "sample_observations"]
