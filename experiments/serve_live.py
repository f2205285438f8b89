"""Serving a replayed request stream live, for ``draftgym evaluate --serve`` and the fidelity diagnosis
(``experiments.serve_fidelity``): one stream on the batch-native engine under a policy (``serve_stream``), its
goodput (``_live``), a warm-up that pays the one-time costs untimed (``warm_up``), each live run's policy as loaded
(``fresh``), a note where a live stream's repeated prompts meet a drafter that keeps state across requests
(``repeated_prompts``), and the rows each arm served, as kept in a results file (``arm_rows``)."""

from __future__ import annotations

import copy
import sys
import time
from typing import Any


def serve_stream(loaded: Any, sim: Any, policy: Any, arms: list[Any], max_batch: int, max_new: int, cost: Any,
                 log: Any = None, drafter_options: Any = None) -> tuple[list[Any], float]:  # fmt: skip
    """Serve server 0's request stream of ``sim`` (after ``reset``) live under ``policy``; (the served requests,
    wall seconds). ``log``: an ``env.serving.ServeLog`` collecting where the time went; ``drafter_options``: the
    drafters' options, as the trace recorded them (``env.trace_record.recorded_drafter_options``). (A static arm, a
    policy with ``static_arm``, is served as an engine configured with it: ``env.serving.serve``.)"""
    from env.batch import BatchEngine
    from env.engine import NO_DRAFT
    from env.serving import Request, serve

    k = int(sim.n_req[0])
    prompts = sim.req_prompt[0, :k]
    reqs = [Request(str(i), sim.trace.prompt(int(p)), NO_DRAFT, max_new, float(sim.req_arr[0, i]))
            for i, p in enumerate(prompts)]  # fmt: skip
    closed = bool(sim.closed[0])
    caps = [int(c) for c in sim.req_cap[0, :k]] if closed else None
    engine = BatchEngine(loaded, max_rows=max_batch)
    t0 = time.perf_counter()
    served = serve(engine, reqs, caps=caps, max_batch=max_batch, policy=policy, arms=arms, cost=cost, log=log,
                   drafter_options=drafter_options)  # fmt: skip
    return served, time.perf_counter() - t0


def fresh(policy: Any) -> Any:
    """The policy as loaded, for one live stream: an online policy (a bandit) learns while it serves, and that must
    not carry into the next stream — each live run starts from the same state, whatever ran before or was cut off
    by a kill."""
    return copy.deepcopy(policy) if hasattr(policy, "update") else policy


def _live(
    loaded: Any,
    sim: Any,
    policy: Any,
    arms: list[Any],
    max_batch: int,
    max_new: int,
    cost: Any,
    drafter_options: Any = None,
    log: Any = None,
) -> float:
    """Serve server 0's request stream of ``sim`` (after ``reset``) live; committed tokens per second. ``log``: an
    ``env.serving.ServeLog`` (its ``arm_rows``: the rows each arm served)."""
    served, wall = serve_stream(loaded, sim, fresh(policy), arms, max_batch, max_new, cost, log=log,
                                drafter_options=drafter_options)  # fmt: skip
    first = min(s.arrival_s for s in served)
    from env.metrics import goodput

    return (
        goodput([len(s.token_ids) for s in served], first, max(s.finish_s for s in served))
        if wall > 0
        else 0.0
    )


def arm_rows(x: Any, arms: Any) -> dict[str, int] | None:
    """``x`` (read from a results file) as the rows each arm of the menu ``arms`` served, ``{arm: rows}``;
    anything else (absent, another menu's arm, a count that is no non-negative integer) None."""
    if not isinstance(x, dict) or not all(
        k in arms and type(v) is int and 0 <= v < 1 << 62 for k, v in x.items()
    ):
        return None
    return dict(x)


def add_rows(total: dict[str, int] | None, more: dict[str, int] | None) -> dict[str, int] | None:
    """The sum of two runs' rows per arm; None where either is unknown."""
    if total is None or more is None:
        return None
    return {a: total.get(a, 0) + more.get(a, 0) for a in {*total, *more}}


class _EveryArm:
    """A warm-up policy: the menu's arms in turn, one per step."""

    def __init__(self, k: int) -> None:
        self.k, self.i = k, -1

    def act(self, obs: Any) -> int:
        self.i += 1
        return self.i % self.k


def warm_up(loaded: Any, sim: Any, arms: list[Any], max_batch: int, cost: Any, log: Any = None,
            drafter_options: Any = None) -> None:  # fmt: skip
    """Serve two requests of ``sim``'s first stream, a few tokens each, every arm of the menu in turn, untimed:
    the first live run then pays no one-time cost (a model head's weights loaded and its kernels' first calls,
    ~2.8 s for eagle3 on a 2-core CPU) that the runs after it do not."""
    from env.batch import BatchEngine
    from env.engine import NO_DRAFT
    from env.serving import Request, serve

    prompts = [sim.trace.prompt(int(p)) for p in sim.req_prompt[0, :2]]
    reqs = [Request(f"warm{i}", p, NO_DRAFT, 8 * len(arms)) for i, p in enumerate(prompts)]  # (long accepts)
    serve(BatchEngine(loaded, max_rows=max_batch), reqs, concurrency=2, max_batch=max_batch,
          policy=_EveryArm(len(arms)), arms=arms, cost=cost, log=log, drafter_options=drafter_options)  # fmt: skip


def repeated_prompts(
    sim: Any, menu: list[Any], drafter_options: dict[str, dict[str, Any]] | None = None
) -> dict:
    """Server 0's stream of ``sim``: its requests, its distinct prompts (streams draw prompts with replacement), and
    the menu's drafters whose proposals read other requests' tokens as configured (``drafter_options``; a drafter's
    ``cross_request``: the suffix drafter's answer cache when on, a hybrid through such a part, the recycling
    table). Live, such a drafter finds a repeated prompt's answer where replay, recorded with each prompt once,
    did not: a note says so."""
    from tqdm import tqdm

    from drafters import DRAFTERS, make_drafter

    opts = drafter_options or {}
    k = int(sim.n_req[0])
    distinct = len(set(sim.req_prompt[0, :k].tolist()))
    names = sorted({
        a.drafter for a in menu if a.drafter is not None and hasattr(DRAFTERS.get(a.drafter), "carried")
        and getattr(make_drafter(a.drafter, **opts.get(a.drafter, {})), "cross_request", False)
    })  # fmt: skip
    if names and distinct < k:
        tqdm.write(f"note: this live stream repeats prompts ({distinct} distinct in {k} requests) and "
                   f"{', '.join(names)} read other requests' tokens: live they may find a repeated prompt's answer, "
                   "which replay does not model (for a like-for-like comparison, record the trace with the cache "
                   "off: draftgym record --drafter-option suffix.cache_requests=0, or for a hybrid "
                   "'hybrid.options={suffix={cache_requests=0}}'; live serves the trace's options)",
                   file=sys.stderr)  # fmt: skip
    return {"requests": k, "distinct_prompts": distinct, "cross_request_drafters": names}
