"""Continuous batching over the batch-native engine (``env.batch``): requests arrive (open loop: arrival times, e.g.
Poisson at a rate or a recorded trace; closed loop: a fixed number in flight), join the running batch at any step
once a row slot and their KV reservation are free (whole prefill on admission, or chunk by chunk between batch
steps), and leave at end of sequence or ``max_new_tokens``; their slots are reused. A request that does not fit waits; nothing is killed for memory.

Times are wall-clock seconds from the start of the run; per request: arrival, first token, finish, and the
generated token ids.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from itertools import takewhile
from numbers import Integral, Real
from typing import Any

import numpy as np

from drafters import Drafter, Forkable, make_drafter
from env.batch import BatchEngine, Prefill
from env.engine import Arm
from env.machine import one_blas_thread
from env.step import Seq, Stepper


class ServeError(ValueError):
    """A load setting that cannot be served (concurrency, rate, batch or KV budget); meant for the user."""


@dataclass(frozen=True)
class Request:
    rid: str
    prompt_ids: list[int]
    arm: Arm
    max_new_tokens: int
    arrival_s: float = 0.0
    seed: int | None = None  # its own sampling seed: its text then does not depend on the order it entered in

    @property
    def reservation(self) -> int:
        """KV positions the request may need: its prompt, its answer and one step's largest tree."""
        draft = 0 if self.arm.drafter is None else self.arm.shape.max_nodes
        return len(self.prompt_ids) + self.max_new_tokens + draft + 1


@dataclass
class Served:
    """What a request got: its tokens and its times (seconds from the start of the run). ``arm``: the request's
    own arm, or ``POLICY_ARM`` when a serving policy chose every step's; ``arm_steps``: arm name -> the batch
    steps the request ran with it (the prefill's first token not counted)."""

    rid: str
    arm: str
    token_ids: list[int] = field(default_factory=list)
    arrival_s: float = 0.0
    first_token_s: float = 0.0
    finish_s: float = 0.0
    steps: int = 0  # verification steps (the prefill's first token counts as one)
    accepted: int = 0
    drafted: int = 0
    arm_steps: dict[str, int] = field(default_factory=dict)


POLICY_ARM = "policy"  # Served.arm of a request whose arms a serving policy chose, step by step


@dataclass
class ServeLog:
    """Where a run's time went: prefills on admission, batch steps (draft, forward, verify, commit), the rows
    those steps carried, and the tokens they committed (first tokens from prefill excluded)."""

    prefill_s: float = 0.0
    prefills: int = 0
    step_s: float = 0.0
    steps: int = 0
    row_steps: int = 0  # sum over steps of the rows in the batch
    step_tokens: int = 0
    arm_rows: Counter = field(default_factory=Counter)  # arm name -> rows that stepped with it
    policy_s: float = 0.0  # of step_s and after it: a serving policy's observation, act, record and update
    # of step_s, timed by the engine (time.perf_counter, whatever ``clock`` the server runs on): the rows' drafting
    # (a batched drafter's call counted once), and the batch forward, verification and commit
    draft_s: float = 0.0
    forward_s: float = 0.0

    @property
    def mean_batch(self) -> float:
        return self.row_steps / self.steps if self.steps else 0.0

    def as_dict(self) -> dict[str, float]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["arm_rows"] = dict(self.arm_rows)
        out["mean_batch"] = self.mean_batch
        return out


@dataclass
class _Flight:
    req: Request
    seq: Seq
    out: Served


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """``n`` arrival times (s) of a Poisson process of ``rate`` requests/s, the first at 0."""
    if rate <= 0:
        raise ServeError(f"the arrival rate must be > 0 requests/s, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def check_load(
    requests: Sequence[Request], *, concurrency: int | None, max_batch: int, kv_budget: int
) -> None:
    if concurrency is not None and concurrency < 1:
        raise ServeError(f"concurrency must be >= 1, got {concurrency}")
    if max_batch < 1:
        raise ServeError(f"the max batch must be >= 1, got {max_batch}")
    for r in requests:
        m = r.max_new_tokens
        if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 1:
            raise ServeError(
                f"request {r.rid}: max_new_tokens must be an integer >= 1, got {r.max_new_tokens!r}"
            )
        t = r.arrival_s  # a NaN or infinite arrival is never reached: the open loop would wait on it forever
        if isinstance(t, bool) or not isinstance(t, Real) or not 0 <= t < math.inf:
            raise ServeError(f"request {r.rid}: arrival_s must be a finite time >= 0 s, got {t!r}")
        s = r.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, Integral) or not 0 <= s < 2**64):
            raise ServeError(f"request {r.rid}: seed must be an integer in [0, 2**64) or None, got {s!r}")
    big = max((r.reservation for r in requests), default=0)
    if big > kv_budget:
        raise ServeError(f"the KV budget of {kv_budget} positions is too small for one request (needs {big})")


def serve(
    engine: BatchEngine,
    requests: Sequence[Request],
    *,
    concurrency: int | None = None,
    max_batch: int = 16,
    kv_budget: int = 1 << 20,
    drafter_options: dict[str, dict[str, object]] | None = None,
    on_finish: Callable[[Served], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    sleep: Callable[[float], None] = time.sleep,
    log: ServeLog | None = None,
    prefill_chunk: int | None = None,
    caps: Sequence[int] | None = None,
    policy: Any = None,
    arms: Sequence[Arm] | None = None,
    cost: Any = None,
    obs_max_batch: int | None = None,
) -> list[Served]:
    """Serve ``requests`` (arrival times in ``arrival_s``) with continuous batching. Closed loop when
    ``concurrency`` is given (at most that many in flight, arrival times ignored: the next one enters as soon as
    one leaves), open loop otherwise (a request enters at its arrival time, or later when the batch is full).
    Each request gets drafter instances of its own (its arm's drafter); ``log`` collects where the time went.
    ``prefill_chunk``: prefill the entering request ``prefill_chunk`` tokens at a time, one chunk between two
    steps of the running batch (their time per output token stays bounded), instead of whole on admission.
    ``caps``: closed loop with a concurrency per request (request i enters while fewer than ``caps[i]`` are in
    flight: a load ramp), in the order of ``requests``.

    ``policy``: an object with ``act(obs)`` choosing, every step, the arm of the batch (an int) or of each row (one
    int per row, in slot order) from ``arms`` (requests' own arms are then ignored), on the observation of
    ``env.serve_env`` (``LiveObserver``: the same features as replay; a policy with ``static_arm``, one arm every
    step, is served as an engine configured with that arm: every request on it, no observation); online policies (``update``) learn from
    each step's goodput relative to autoregressive decoding, priced by the batch cost model ``cost`` against the
    step's wall time, with ``info["step_s"]``, the engine's step alone (drafting, forward, verification, commit:
    ``policies.turbospec`` bends its prices to it); ``obs_max_batch``: the row slots of the observation (the
    policy's ``max_batch``; default ``max_batch``). ``clock`` and ``sleep``: the server's time (open loop, an idle
    server sleeps until the next arrival by ``sleep``; a caller with its own ``clock`` passes the ``sleep`` that
    moves it)."""
    static = None if policy is None else getattr(policy, "static_arm", None)
    if (
        static is not None
    ):  # one arm every step: served as an engine configured with it (no observation, no act)
        if not arms or not 0 <= static < len(arms):
            raise ServeError(f"the static policy's arm {static} is not in the menu of {len(arms or [])} arms")
        requests, policy = [replace(r, arm=list(arms)[static]) for r in requests], None
    if caps is not None:
        if len(caps) != len(requests) or min(caps, default=1) < 1:
            raise ServeError("caps: one concurrency >= 1 per request")
        concurrency = max(caps, default=1)
    if policy is not None and not arms:
        raise ServeError("a serving policy needs its arm menu (arms)")
    check_load(requests, concurrency=concurrency, max_batch=max_batch, kv_budget=kv_budget)
    if prefill_chunk is not None and prefill_chunk < 1:
        raise ServeError(f"the prefill chunk must be >= 1 token, got {prefill_chunk}")
    limit = min(max_batch, concurrency or max_batch, engine.target.max_rows)
    if limit < 1 and requests:  # nothing would ever be admitted: refused, not waited on
        raise ServeError(f"the engine serves {engine.target.max_rows} rows: no request can be admitted")
    menu = list(arms) if policy is not None else list(dict.fromkeys(r.arm for r in requests))
    observer = None
    if policy is not None:
        from env.serve_obs import LiveObserver

        observer = LiveObserver(menu, obs_max_batch or max_batch)
    index = {a: i for i, a in enumerate(menu)}
    stepper = Stepper(engine, menu)
    options = drafter_options or {}
    loaded_once: dict[
        str, Drafter
    ] = {}  # per drafter name: the first request's; later ones share its weights

    def drafter_for(name: str) -> Drafter:
        first = loaded_once.get(name)
        if first is None:
            first = loaded_once[name] = make_drafter(name, **options.get(name, {}))
            return first
        return first.fork() if isinstance(first, Forkable) else make_drafter(name, **options.get(name, {}))

    cap_of = {id(r): c for r, c in zip(requests, caps)} if caps is not None else {}
    deepest = max((a.shape.max_nodes for a in menu if a.drafter is not None), default=0)

    def need(req: Request) -> int:  # KV positions to reserve: with a policy, for the menu's largest tree
        return req.reservation if observer is None else len(req.prompt_ids) + req.max_new_tokens + deepest + 1

    # check_load saw the requests' own arms; a policy may pick the menu's deeper ones
    if kv_budget is not None and requests:
        big = max(requests, key=need)
        if need(big) > kv_budget:
            raise ServeError(
                f"request {big.rid} needs {need(big)} KV positions with the menu's largest tree "
                f"({deepest} nodes), over the budget of {kv_budget}: it could never be admitted"
            )

    queue = deque(requests if caps is not None else sorted(requests, key=lambda r: r.arrival_s))
    flights: dict[int, _Flight] = {}  # by id(seq)
    done: list[Served] = []
    reserved = 0
    log = log if log is not None else ServeLog()
    pending: tuple[Request, Prefill, float] | None = None  # the request being prefilled chunk by chunk
    # the KV cache grown once, before the clock starts, to the largest reservation (as a server allocates its cache
    # up front): no request pays for growing and first-touching it mid-run
    engine.target.cache.grow(max((need(r) for r in requests), default=0))
    # a policy's NumPy on one BLAS thread: its spinning threads would take the cores the next forward needs (set
    # here, before the clock starts: setting it scans the loaded libraries; lifted when the loop ends)
    blas = one_blas_thread() if observer is not None else contextlib.nullcontext()
    t0 = clock()

    def now() -> float:
        return clock() - t0

    def finish(f: _Flight) -> None:
        nonlocal reserved
        f.out.finish_s = now()
        f.out.token_ids = list(f.seq.tokens)
        f.out.steps, f.out.accepted, f.out.drafted = f.seq.steps, f.seq.accepted, f.seq.drafted
        if observer is not None:
            observer.forget(f.seq)
        stepper.retire(f.seq)
        del flights[id(f.seq)]
        reserved -= need(f.req)
        done.append(f.out)
        if on_finish is not None:
            on_finish(f.out)

    def can_enter() -> bool:
        busy = len(flights) + (pending is not None)
        return bool(
            queue
            and busy < min(limit, cap_of.get(id(queue[0]), limit))
            and (concurrency is not None or queue[0].arrival_s <= now())
            and reserved + need(queue[0]) <= kv_budget
        )

    def enter(req: Request, arrival: float, pf: Prefill | None) -> None:
        if observer is not None:  # every drafter of the menu: the policy may pick any arm
            drafters = {d: drafter_for(d) for d in observer.drafters}
        else:
            d = req.arm.drafter
            drafters = {} if d is None else {d: drafter_for(d)}
        seq = stepper.start(req.prompt_ids, req.max_new_tokens, drafters, prefill=pf, seed=req.seed)
        # under a policy the request's own arm is ignored
        arm = req.arm.name if observer is None else POLICY_ARM
        f = flights[id(seq)] = _Flight(req, seq, Served(req.rid, arm, arrival_s=arrival, first_token_s=now()))
        if seq.done:
            finish(f)

    with blas:
        while queue or flights or pending:
            if prefill_chunk is None:  # whole prefill on admission, as many as may enter
                while can_enter():
                    req = queue.popleft()
                    arrival = now() if concurrency is not None else req.arrival_s
                    reserved += need(req)
                    a = clock()
                    enter(req, arrival, None)
                    log.prefill_s += clock() - a
                    log.prefills += 1
            else:  # one request prefills at a time, one chunk between two steps of the batch
                if pending is None and can_enter():
                    req = queue.popleft()
                    reserved += need(req)
                    pending = (
                        req,
                        engine.begin_prefill(req.prompt_ids),
                        now() if concurrency is not None else req.arrival_s,
                    )
                if pending is not None:
                    req, pf, arrival = pending
                    a = clock()
                    if engine.prefill_chunk(pf, prefill_chunk):
                        pending = None
                        enter(req, arrival, pf)
                        log.prefills += 1
                    log.prefill_s += clock() - a
            if not flights:
                if queue and pending is None:  # open loop, idle until the next arrival
                    sleep(max(0.0, min(queue[0].arrival_s - now(), 0.05)))
                continue
            live = [flights[id(s)] for s in stepper.seqs]
            a = clock()
            if observer is not None:
                arrived = 0
                if concurrency is None:  # open loop: the queue is in arrival order, the arrived ones first
                    t = now()
                    arrived = sum(1 for _ in takewhile(lambda r, t=t: r.arrival_s <= t, queue))
                obs = observer.observe(stepper, arrived)
                choices = observer.choices(policy.act(obs), len(live))
                log.policy_s += clock() - a
            else:
                choices = [index[f.req.arm] for f in live]
            t_step = clock()
            outcomes = stepper.step(choices)
            step_s = clock() - t_step  # the engine's step alone: drafting, forward, verification, commit
            wall = clock() - a
            log.step_s += wall
            log.steps += 1
            log.row_steps += len(live)
            log.step_tokens += sum(len(o.tokens) for o in outcomes)
            log.draft_s += sum(o.result.draft_s for o in outcomes)
            log.forward_s += outcomes[0].result.verify_s if outcomes else 0.0
            for f, c in zip(live, choices):
                name = menu[c].name
                log.arm_rows[name] += 1
                f.out.arm_steps[name] = f.out.arm_steps.get(name, 0) + 1
            if observer is not None:
                b = clock()
                observer.record(outcomes)
                if cost is not None and hasattr(policy, "update"):
                    info = {"step_s": step_s}  # (a policy that corrects its cost model online reads it)
                    policy.update(obs, int(choices[0]), observer.reward(outcomes, wall, cost), info)
                log.policy_s += clock() - b
            for f in sorted(
                live, key=lambda f: -f.seq.row.slot
            ):  # the last slots first: packing moves fewer rows
                if f.seq.done:
                    finish(f)
    return sorted(done, key=lambda s: s.rid)
