"""What a serving policy's own decision costs a live step: the seconds of one ``act`` on one observation, the action
read into arms, and, for an online policy, the reward it learns from and its ``update``, as ``env.serving.serve``
runs them every step, timed on this machine. Replay
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
VERSION = 3  # of what is timed: a timing kept by an earlier version is timed again (experiments' cache)


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


def act_seconds(policy: Any, observations: np.ndarray, calls: int = CALLS, *, arms: Any = None,
                cost: Any = None) -> float:  # fmt: skip
    """Median seconds of one live decision of ``policy`` as ``env.serving.serve`` makes it: ``act`` on one
    observation (a row of ``observations``, in turn); with ``arms`` (the menu), the action read into one arm per
    row (``LiveObserver.choices``: an array of per-row arms takes the checked path); for an online policy, the
    reward it learns from priced by ``cost`` (the batch cost model at the step's rows) and its ``update`` (on a
    copy: the policy given does not learn)."""
    from env.engine import parse_arm
    from env.machine import one_blas_thread
    from env.serve_obs import LiveObserver
    from policies.serving import _max_batch

    pol = copy.deepcopy(policy) if hasattr(policy, "update") else policy
    update = getattr(pol, "update", None)
    obs = np.asarray(observations, np.float32)
    if obs.ndim != 2 or len(obs) == 0:
        raise ValueError("observations must be a non-empty [n, obs] array")
    # the rows of a serving observation: read only where they are needed (the action read, the reward)
    max_batch = _max_batch(obs.shape[1]) if arms is not None or cost is not None else 0
    observer = None if arms is None else LiveObserver([parse_arm(str(a)) for a in arms], max_batch)
    with one_blas_thread():  # as the live server runs it
        times = _timed(pol, obs, calls, max_batch, observer, update, cost)
    return float(statistics.median(times))


def _timed(pol: Any, obs: np.ndarray, calls: int, max_batch: int, observer: Any, update: Any,
           cost: Any) -> list[float]:  # fmt: skip
    from env.batch_cost import step_context
    from policies.serving import rows_of

    times = []
    for i in range(max(int(calls), 1)):
        o = obs[i % len(obs)]
        rows = max(rows_of(o, max_batch), 1) if max_batch else 1
        t0 = time.perf_counter()
        a = pol.act(o)
        if observer is not None:
            observer.choices(a, rows)
        if update is not None:
            if cost is not None:  # LiveObserver.reward: the step's autoregressive cost at its context
                ctx = np.full((1, rows), 512.0)
                cost.forward_s(rows, 1, float(step_context(cost, ctx, np.ones_like(ctx, bool))[0]))
            update(o, int(np.asarray(a).reshape(-1)[0]), 1.0, {"step_s": 0.05})  # (as the server measures it)
        times.append(time.perf_counter() - t0)
    return times


__all__ = ["CALLS", "VERSION", "act_seconds", "sample_observations"]
