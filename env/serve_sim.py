"""The serving simulator behind ``draftgym/SpecServe-v0`` (``env.serve_env``, the Gymnasium adapters): ``ServeSim``,
a server decoding a stream of requests with continuous batching, numpy-vectorized over many independent servers,
replayed from a recorded trace and priced by a batch cost model (``env.batch_cost``). The loads and their request
streams (``env.serve_loads``) and the observation (``env.serve_obs``, shared with the live server) are re-exported
here.

Greedy replay is exact for the n-gram drafter (DESIGN.md "Traces and replay"): the tokens a request commits are
its recorded trajectory whatever the arms, so only the time and the steps differ between policies.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from env.batch_cost import BatchCost, load_batch_cost, step_context
from env.engine import Arm, as_arm
from env.reset_checks import seed_value, whole
from env.serve_loads import *  # noqa: F403  (the loads' names, re-exported)
from env.serve_loads import __all__ as _load_names
from env.serve_loads import parse_load, ramp_caps, request_stream
from env.serve_obs import *  # noqa: F403  (the observation's names, re-exported)
from env.serve_obs import (
    ServeEnvError,
    integer_actions,
    is_packed,
    match_drafter,
    obs_size,
    packed_positions,
    serve_observation,
    update_alpha,
)
from env.serve_obs import __all__ as _obs_names
from env.trace import Trace, TraceError, load_trace

SERVE_ID = "draftgym/SpecServe-v0"
RECORD_DEPTH = 16  # env.step.RECORD_SHAPE's: the shape a drafter without its own largest one proposes at
DEFAULT_ARMS = ("none", "ngram-d1", "ngram-d2", "ngram-d3", "ngram-d5", "ngram-d8")
DEFAULT_LOADS = ("1", "2", "4", "8", "16", "ramp", "bursty")
ACTIONS = ("batch", "row")
REWARDS = ("goodput_ratio", "time_saved")
MAX_SERVERS = 1 << 16  # num_envs
MAX_BATCH = 4096  # rows a server batches at most (serve-bench's concurrency levels go as far)
MAX_SIM_REQUESTS = (
    1 << 24
)  # requests of all servers' streams together (each stream is drawn in full at a reset)


class _UnpricedSteps:
    """The per-sequence tables' cost columns, unused here: the batch cost model prices every serving step. (The
    single-sequence cost model would refuse a drafter it was not calibrated for, e.g. ``suffix``.)"""

    def step_cost(self, arm: Arm, nodes: Any, context: Any, chain: Any) -> np.ndarray:
        return np.ones(np.shape(context), np.float32)

    def ar_cost(self, context: Any) -> np.ndarray:
        return np.ones(np.shape(context), np.float32)


def _tables(trace: Trace, arms: Sequence[Arm], max_new: int):
    from env.replay import build_tables, tree_index

    if any(a.drafter is not None and a.drafter not in trace.trees for a in arms):
        missing = sorted({a.drafter for a in arms if a.drafter is not None and a.drafter not in trace.trees})
        raise ServeEnvError(
            f"the trace has no recorded trees for {', '.join(missing)} (it has: {', '.join(trace.trees)})"
        )
    tb = build_tables(trace, arms, _UnpricedSteps(), max_new_tokens=max_new)  # type: ignore[arg-type]
    npos = trace.traj.shape[0]
    match = np.zeros(npos, np.int64)
    name = match_drafter([a.drafter for a in arms if a.drafter is not None] or sorted(trace.trees)[:1])
    if name is not None:  # the longest proposal the match drafter has at each position
        ix = tree_index(trace, name)
        np.maximum.at(match, ix["pos"], ix["depth"])
    return tb, match


class ServeSim:
    """``num_envs`` independent servers replaying ``trace`` (vectorized with numpy). ``reset(mask)``, ``step(a)``
    with ``a`` of shape ``[E]`` (one arm per server) or ``[E, M]`` (one per row slot; empty slots ignored),
    ``observe()``."""

    def __init__(
        self,
        num_envs: int = 1,
        *,
        trace: Trace | str | None = None,
        arms: Sequence[str | Arm] = DEFAULT_ARMS,
        cost: BatchCost | str | None = None,
        max_batch: int = 16,
        loads: Sequence[str] = DEFAULT_LOADS,
        requests: int = 32,
        max_new_tokens: int | None = None,
        prompt_ids: Sequence[str] | None = None,
        reward: str = "goodput_ratio",
        seed: int | None = None,
    ) -> None:
        from drafters import DrafterError

        if reward not in REWARDS:
            raise ServeEnvError(f"unknown reward {reward!r}; valid: {', '.join(REWARDS)}")
        self.reward_kind = reward

        num_envs = whole(num_envs, "num_envs", ServeEnvError, 1, MAX_SERVERS)
        max_batch = whole(max_batch, "max_batch", ServeEnvError, 1, MAX_BATCH)
        requests = whole(requests, "requests", ServeEnvError, 1, MAX_SIM_REQUESTS)
        if num_envs * requests > MAX_SIM_REQUESTS:
            raise ServeEnvError(
                f"{num_envs} servers x {requests} requests: at most {MAX_SIM_REQUESTS} in all"
            )
        if max_new_tokens is not None:
            max_new_tokens = whole(max_new_tokens, "max_new_tokens", ServeEnvError, 2)
        if seed is not None:
            seed = seed_value(seed, ServeEnvError)
        if isinstance(arms, str):  # "none,ngram-d4" (its characters were read as arms)
            arms = [a for a in arms.split(",") if a.strip()]
        if not isinstance(arms, Iterable):
            raise ServeEnvError(f"arms is a list of arms or a comma list of names, got {arms!r:.60}")
        if isinstance(prompt_ids, str):  # "12" was served as prompts "1" and "2"
            raise ServeEnvError(
                f"prompt_ids is a list of the trace's prompt ids, got the string {prompt_ids!r:.60}"
            )
        try:
            self.arms = [as_arm(a.strip() if isinstance(a, str) else a) for a in arms]
        except DrafterError as err:
            raise ServeEnvError(str(err)) from err
        if not self.arms:
            raise ServeEnvError("the arm menu is empty")
        self.arm_names = [a.name for a in self.arms]
        twice = sorted({n for n in self.arm_names if self.arm_names.count(n) > 1})
        if twice:
            raise ServeEnvError(f"the arm menu lists {twice} more than once")
        self.trace = (
            trace
            if isinstance(trace, Trace)
            else (default_serve_trace() if trace is None else load_trace(trace))
        )
        self.cost = load_batch_cost(cost)
        for name in sorted({a.drafter for a in self.arms if a.drafter is not None}):
            self.cost.draft_s(name, 0)  # a drafter the cost model cannot price: refused here, not at a step
        self.num_envs, self.max_batch, self.requests = int(num_envs), int(max_batch), int(requests)
        self.loads = [
            parse_load(x, self.max_batch) for x in (loads if not isinstance(loads, str) else [loads])
        ]
        if not self.loads:
            raise ServeEnvError("the load list is empty")
        max_new = self.trace.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        try:
            self.tb, self.match = _tables(self.trace, self.arms, max_new)
        except TraceError as err:
            raise ServeEnvError(str(err)) from err
        ids = self.trace.prompt_ids
        if prompt_ids is None:
            chosen = np.arange(len(ids))
        else:
            where = {p: i for i, p in enumerate(ids)}
            bad = [p for p in prompt_ids if p not in where]
            if bad:
                raise ServeEnvError(f"prompt ids not in the trace: {', '.join(map(str, bad[:5]))}")
            chosen = np.array([where[p] for p in prompt_ids], np.int64)
        self.pool = np.intersect1d(chosen, self.tb.startable)
        if self.pool.size == 0:
            raise ServeEnvError("no prompt of the trace has a step to take")
        self.prompt_len = self.trace.prompt_len.astype(np.int64)
        tb = self.tb
        # one gather a step: (tokens, accepted, drafted, flags) of arm k at trace position t packed as 4 small
        # ints in one word at [k * T + t], read back through a view of the gathered words as [E, M, 4]; flags:
        # bit 0 the request ends, bit 1 a draft was rejected (the acceptance estimate's failure)
        flags = (tb.ends > 0).astype(np.int64) | (tb.rejected.astype(np.int64) << 1)
        fields = np.stack([tb.tokens, tb.accepted, tb.drafted, flags], axis=-1).astype(np.int64)
        small = np.int8 if fields.max(initial=0) <= np.iinfo(np.int8).max else np.int16
        words = np.ascontiguousarray(fields.astype(small))  # [K, T, 4]
        self._table = words.view(np.int32 if small is np.int8 else np.int64).reshape(-1)  # [K * T]
        self._field_dtype = small
        self._positions = int(tb.tokens.shape[1])  # T
        self._offset = tb.offset.astype(np.int64)
        names = sorted({a.drafter for a in self.arms if a.drafter is not None})
        self.drafter_names = names
        self.arm_drafter = np.array([-1 if a.drafter is None else names.index(a.drafter) for a in self.arms])
        self.arm_depth = np.array([0 if a.drafter is None else a.shape.depth for a in self.arms])
        # the model heads whose catch-up the cost model prices (``catch_up_s``): a head proposing at a row catches
        # up on every token since its last proposal there, the prompt at the first; the fixed part of its price
        # holds the last step's commits, the rest is charged by the tokens before them (``pend`` - ``took``); a head
        # is priced so where any batch size pays for many tokens (a roofline's is free below its ridge)
        price, each = getattr(self.cost, "catch_up_s", None), np.arange(1, self.max_batch + 1)
        self._catch = [
            j for j, n in enumerate(names) if price is not None and np.any(price(n, each, 1e4) > 0)
        ]
        # what serving a policy live adds to each step (``price_policy``); None: not charged (a static arm is served
        # as an engine configured with it, and the oracle is a bound)
        self.policy_act_s: float | None = None
        # the drafter the live observation proposes with at every row's root
        live_match = match_drafter(names)
        self._match_index = -1 if live_match is None else names.index(live_match)
        # whether a row drafting with it verifies the observation's proposal (cut to its arm: ``exact_replay``,
        # the n-gram drafter) or proposes again; the depth the observation proposes at (``env.step.largest_shape``:
        # a drafter without a class-wide largest shape, the record shape's)
        self._match_reuse, self._match_depth = True, 1
        if live_match is not None:
            from drafters import DRAFTERS

            cls = DRAFTERS.get(live_match)
            self._match_reuse = bool(getattr(cls, "exact_replay", False))
            self._match_depth = 1 if self._match_reuse else RECORD_DEPTH
        # the unit rate: one row decoding autoregressively, requests of the mean length at the mean context (the
        # prefill commits a request's first token, so L tokens take L - 1 steps)
        lengths = self.tb.length[self.pool].astype(np.float64)
        ctx = float(np.mean(self.prompt_len[self.pool] + lengths / 2))
        ar1 = float(self.cost.forward_s(1, 1, ctx))
        self.unit_rate = 1.0 / (
            float(np.mean(lengths) - 1) * ar1
            + float(np.mean(self.cost.prefill_s(self.prompt_len[self.pool])))
        )
        q = max(self.requests, len(ramp_caps(self.max_batch)))
        e, m = self.num_envs, self.max_batch
        self.q_max = q
        self.active = np.zeros((e, m), bool)
        self.prompt = np.zeros((e, m), np.int32)
        self.pos = np.zeros((e, m), np.int32)
        self.s = np.zeros((e, m), np.float64)
        self.n = np.zeros((e, m), np.float64)
        self.last = np.zeros((e, m), np.int64)
        self.pend = np.zeros((e, m, len(self._catch)), np.int64)  # tokens each catch-up head has yet to read
        self.took = np.zeros((e, m), np.int64)  # tokens each row's last step committed
        self.req_prompt = np.zeros((e, q), np.int64)
        self.req_arr = np.full((e, q), np.inf)
        self.req_cap = np.ones((e, q), np.int64)
        self.n_req = np.zeros(e, np.int64)
        self.closed = np.ones(e, bool)
        self.load_name = [""] * e  # each server's load this episode
        self.ptr = np.zeros(e, np.int64)
        self.finished = np.zeros(e, np.int64)
        self.clock = np.zeros(e, np.float64)
        self.tokens_total = np.zeros(e, np.int64)
        self.steps = np.zeros(e, np.int64)
        self.rngs = [np.random.default_rng(None if seed is None else [seed, i]) for i in range(e)]
        self._obs = np.empty((e, obs_size(m)), np.float32)

    def price_policy(self, act_s: float | None) -> None:
        """Charge every step what serving a policy live adds to it (``env.serving.serve`` with a policy): the
        cost model's ``policy_book_s`` (the observation's bookkeeping and the record), the match drafter's
        proposals (the observation reads their depth at every row's root: for the n-gram drafter, whose rows
        verify that same proposal cut to their arm, only the rows that do not draft with it; for any other, every
        row, one at a time at the record shape's depth, and a row drafting with it proposes again), and
        ``act_s``, the policy's own act (and update, and the reward it learns from) a step, timed by the caller.
        None: charge nothing (the default)."""
        if act_s is not None and not (np.isfinite(act_s) and 0 <= act_s <= 10.0):
            raise ServeEnvError(f"a policy's act must be finite seconds in [0, 10], got {act_s!r}")
        self.policy_act_s = None if act_s is None else float(act_s)

    def _observed(self, j: int) -> bool:
        """Whether drafter ``j`` proposes at every row each step for an observing policy (``price_policy``)."""
        return self.policy_act_s is not None and not self._match_reuse and j == self._match_index

    def _policy_s(self, rows: np.ndarray, ad: np.ndarray | None) -> np.ndarray:
        book = getattr(self.cost, "policy_book_s", None)
        extra = np.full(rows.shape, float(self.policy_act_s or 0.0))
        if book is not None:
            extra = extra + np.asarray(book(rows), np.float64)
        if self._match_index >= 0 and ad is not None:
            name = self.drafter_names[self._match_index]
            if self._match_reuse:
                others = rows - ((ad == self._match_index) & self.active).sum(1)
                extra = extra + self.cost.draft_s(name, others, 1)
            else:  # a proposal per row, each alone
                one = np.ones_like(rows)
                extra = extra + rows * np.asarray(self.cost.draft_s(name, one, self._match_depth), np.float64)
        return np.where(rows > 0, extra, 0.0)

    # ---- episodes ------------------------------------------------------------------------------------------------

    def seed(self, seed: int | None, only: Sequence[int] | None = None) -> None:
        """Server i draws from ``[seed, i]`` (``only``: those servers; the others keep their streams)."""
        for i in range(self.num_envs) if only is None else only:
            self.rngs[i] = np.random.default_rng(None if seed is None else [seed, i])

    def seed_each(self, seeds: Sequence[int], only: Sequence[int] | None = None) -> None:
        """Server i draws from ``[seeds[i], 0]``: the stream of a one-server simulator seeded with ``seeds[i]``."""
        for i in range(self.num_envs) if only is None else only:
            self.rngs[i] = np.random.default_rng([int(seeds[i]), 0])

    def reset(self, mask: np.ndarray | None = None, load: str | None = None) -> None:
        """Start new episodes (``mask``: those servers only); ``load``: that load instead of a random one."""
        idx = np.arange(self.num_envs) if mask is None else np.flatnonzero(mask)
        fixed = None if load is None else parse_load(load, self.max_batch)
        for i in idx:
            rng = self.rngs[i]
            li = int(rng.integers(len(self.loads)))
            ld = fixed or self.loads[li]
            arr, cap = request_stream(ld, self.requests, self.max_batch, self.unit_rate, rng)
            k = len(arr)
            self.n_req[i], self.closed[i], self.load_name[i] = k, ld.closed, ld.name
            self.req_arr[i, :k], self.req_cap[i, :k] = arr, cap
            self.req_arr[i, k:] = np.inf
            self.req_prompt[i, :k] = rng.choice(self.pool, size=k)
        self.active[idx] = False
        self.ptr[idx] = 0
        self.finished[idx] = 0
        self.clock[idx] = 0.0
        self.tokens_total[idx] = 0
        self.steps[idx] = 0
        self._admit(idx)

    def set_requests(self, i: int, prompts: Sequence[int], arrivals: Sequence[float], caps: Sequence[int],
                     closed: bool, load: str = "given") -> None:  # fmt: skip
        """Server ``i`` starts an episode of exactly these requests (trace prompt indices, arrival seconds, closed-
        loop caps; ``load``: its name in ``info``): evaluation replays the stream a live run serves."""
        k = len(prompts)
        if k > self.q_max:
            self._grow(k)
        self.n_req[i], self.closed[i], self.load_name[i] = k, closed, load
        self.req_prompt[i, :k], self.req_arr[i, :k], self.req_cap[i, :k] = prompts, arrivals, caps
        self.req_arr[i, k:] = np.inf
        self.active[i] = False
        self.ptr[i] = self.finished[i] = self.tokens_total[i] = self.steps[i] = 0
        self.clock[i] = 0.0
        self._admit(np.array([i]))

    def _grow(self, q: int) -> None:
        pad = q - self.q_max
        self.req_prompt = np.pad(self.req_prompt, ((0, 0), (0, pad)))
        self.req_arr = np.pad(self.req_arr, ((0, 0), (0, pad)), constant_values=np.inf)
        self.req_cap = np.pad(self.req_cap, ((0, 0), (0, pad)), constant_values=1)
        self.q_max = q

    def _may_admit(self) -> np.ndarray:
        """Servers where a request may enter now (a cheap test; ``_admit`` decides)."""
        rows = self.active.sum(1)
        ix = np.arange(self.num_envs)
        ptr = np.minimum(self.ptr, self.q_max - 1)
        ok = np.where(
            self.closed, rows < self.req_cap[ix, ptr], (self.req_arr[ix, ptr] <= self.clock) | (rows == 0)
        )
        return ok & (self.ptr < self.n_req) & (rows < self.max_batch)

    def _admit(self, idx: np.ndarray | None = None) -> None:
        """Requests enter free slots (closed loop: up to the cap; open loop: those that arrived), each paying its
        prefill; an idle open-loop server jumps to its next arrival. Open loop, as the live server does: requests
        that arrive during those prefills enter too, before the next step (another pass, until none arrived)."""
        e = np.arange(self.num_envs) if idx is None else np.asarray(idx)
        while e.size:  # a pass: servers that admitted (open loop) or were idle look again
            act = self.active[e]
            rows = act.sum(1)
            left = self.n_req[e] - self.ptr[e]
            arrived = (self.req_arr[e] <= self.clock[e, None]).sum(1)
            arrived = np.minimum(arrived, self.n_req[e])
            n_open = np.maximum(arrived - self.ptr[e], 0)
            # closed loop: request ptr + k enters while fewer than its own cap are in flight (as env.serving does)
            ks = np.arange(self.max_batch)
            qk = np.minimum(self.ptr[e, None] + ks, self.q_max - 1)
            ok = rows[:, None] + ks < self.req_cap[e[:, None], qk]
            n = np.where(self.closed[e], np.cumprod(ok, 1).sum(1), n_open)
            n = np.minimum(np.minimum(n, self.max_batch - rows), left)
            if n.any():
                free = ~act
                rank = np.cumsum(free, axis=1) - 1
                new = free & (rank < n[:, None])
                q = np.minimum(self.ptr[e, None] + rank, self.q_max - 1)
                ni, nj = np.nonzero(new)  # the new rows: server e[ni], slot nj
                ei = e[ni]
                rp = self.req_prompt[ei, q[ni, nj]]
                self.prompt[ei, nj] = rp
                for arr in (self.pos, self.last, self.took, self.s, self.n):
                    arr[ei, nj] = 0
                if self._catch:  # a head's first proposal at a row reads the prompt
                    self.pend[ei, nj] = self.prompt_len[rp][:, None]
                self.active[ei, nj] = True
                pf = np.zeros(new.shape)
                pf[ni, nj] = self.cost.prefill_s(self.prompt_len[rp])
                pf = pf.sum(1)  # per server, summed in slot order
                self.clock[e] += pf
                self.tokens_total[e] += new.sum(1)  # the prefill's first token
                self.ptr[e] += n
            waiting = (self.ptr[e] < self.n_req[e]) & ~self.closed[e]
            idle = waiting & ~self.active[e].any(1)
            ii = e[idle]
            self.clock[ii] = np.maximum(self.clock[ii], self.req_arr[ii, self.ptr[ii]])
            e = e[idle | (waiting & (n > 0) & (self.active[e].sum(1) < self.max_batch))]

    # ---- steps ---------------------------------------------------------------------------------------------------

    def done(self) -> np.ndarray:
        return self.finished >= self.n_req

    def queue(self) -> np.ndarray:
        out = np.zeros(self.num_envs, np.int64)
        o = np.flatnonzero(~self.closed)  # closed loop: nobody waits
        if o.size:
            arrived = np.minimum((self.req_arr[o] <= self.clock[o, None]).sum(1), self.n_req[o])
            out[o] = np.maximum(arrived - self.ptr[o], 0)
        return out

    def observe(self, idx: np.ndarray | None = None) -> np.ndarray:
        """The observation of every server (``[E, F]``, a buffer the next call overwrites); ``idx``: recompute
        those servers' rows only (the others keep the last call's)."""
        if idx is None:
            g = self._offset[self.prompt] + self.pos
            progress = (self.pos + 1) / self.tb.max_new_tokens
            return serve_observation(self.active, self.prompt_len[self.prompt] + self.pos, self.s, self.n,
                                     self.last, self.match[g], progress, self.queue(), self.max_batch,
                                     self._obs)  # fmt: skip
        i = np.asarray(idx)
        if i.size:
            prompt, pos = self.prompt[i], self.pos[i]
            g = self._offset[prompt] + pos
            self._obs[i] = serve_observation(self.active[i], self.prompt_len[prompt] + pos, self.s[i], self.n[i],
                                             self.last[i], self.match[g], (pos + 1) / self.tb.max_new_tokens,
                                             self.queue()[i], self.max_batch)  # fmt: skip
        return self._obs

    def _actions(self, actions: Any) -> np.ndarray:
        k = len(self.arms)
        a = integer_actions(actions, k)
        batch = a.ndim == 1 and a.shape[0] == self.num_envs
        if not batch and a.shape != (self.num_envs, self.max_batch):
            raise ServeEnvError(
                f"actions must have shape ({self.num_envs},) or ({self.num_envs}, {self.max_batch}), got {a.shape}"
            )
        a = a.astype(np.int64, copy=False)
        act = self.active
        if batch:
            live = a[act.any(1)]  # a server without rows ignores its action
        elif not is_packed(act):  # per row, in the observation's order: back to slots
            a = np.take_along_axis(a, packed_positions(act), 1)
        if not batch:  # rows packed in slots 0..rows-1 (the simulator keeps them so): the observation's order
            live = a[act]
        if live.size and (live.min() < 0 or live.max() >= k):
            bad = int(live.min()) if live.min() < 0 else int(live.max())
            raise ServeEnvError(
                f"action {bad} is not a valid arm index; valid: 0..{k - 1} ({', '.join(self.arm_names)})"
            )
        a = np.clip(a, 0, k - 1)
        return np.broadcast_to(a[:, None], (self.num_envs, self.max_batch)) if batch else a

    def outcome(self, a: np.ndarray) -> dict[str, np.ndarray]:
        """What actions ``a`` ([E, M]) would do this step, without doing it."""
        act = self.active
        g = self._offset[self.prompt] + self.pos  # empty slots: stale, read in range and masked
        # [E, M] words of (tokens, accepted, drafted, ends)
        words = np.take(self._table, a * self._positions + g, mode="clip")
        words *= act  # empty slots: nothing
        tok, acc, dr, flags = np.moveaxis(words.view(self._field_dtype).reshape(*words.shape, 4), -1, 0)
        end, rejected = (flags & 1) > 0, (flags & 2) > 0
        rows = act.sum(1)
        nodes = dr.max(1).astype(np.int64) + 1  # the widest tree in the batch (empty slots have drafted 0)
        r1 = np.maximum(rows, 1)
        ctx = step_context(self.cost, self.prompt_len[self.prompt] + self.pos, act)
        # the step, and an autoregressive step of the same rows
        cost = np.asarray(self.cost.forward_s(r1, nodes, ctx), np.float64)
        ar = np.asarray(self.cost.forward_s(r1, np.ones_like(nodes), ctx), np.float64)
        forward = cost
        ad = None
        if self.drafter_names:
            ad, depth = self.arm_drafter[a], self.arm_depth[a]
            for j, name in enumerate(self.drafter_names):
                mine = (ad == j) & act  # the rows drafting with it, and the deepest tree they draft
                cost = cost + self.cost.draft_s(name, mine.sum(1), np.where(mine, depth, 0).max(1))
            for c, j in enumerate(self._catch):
                # an observing policy's match head proposes at every row alone first (``price_policy``): it
                # reads them there, and the arm's proposal after it has nothing left to read
                seen = self._observed(j)
                mine = act if seen else (ad == j) & act
                behind = np.where(mine, np.maximum(self.pend[..., c] - self.took, 0), 0).sum(1)
                cost = cost + self.cost.catch_up_s(self.drafter_names[j], 1 if seen else mine.sum(1), behind)
        if self.policy_act_s is not None:
            cost = cost + self._policy_s(rows, ad)
        total = tok.sum(1)
        if self.reward_kind == "time_saved":  # autoregressive batch steps saved: tokens / rows - cost / ar
            reward = np.where(rows > 0, total / r1 - cost / ar, 0.0)
        else:  # goodput relative to autoregressive decoding at the same batch
            reward = np.where(rows > 0, total * ar / (r1 * cost), 0.0)
        return {"tok": tok, "acc": acc, "dr": dr, "end": end, "rejected": rejected, "rows": rows, "nodes": nodes, "cost": cost,
                "forward": forward, "ar": ar, "tokens": total, "reward": reward}  # fmt: skip

    def step(self, actions: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """One batch step of every server not done; returns (reward [E], info arrays)."""
        a = self._actions(actions)
        running = ~self.done()
        o = self.outcome(a)
        act = self.active
        o["cost"] = np.where(running, o["cost"], 0.0)
        o["forward"] = np.where(running, o["forward"], 0.0)
        self.clock += o["cost"]
        self.s, self.n = update_alpha(self.s, self.n, o["acc"], o["dr"], o["rejected"])
        self.last = np.where(act & (o["dr"] > 0), o["acc"], self.last)
        self.pos = self.pos + o["tok"]
        # a proposing head caught up; every row's commits are pending again
        for c, j in enumerate(self._catch):
            read = act if self._observed(j) else (self.arm_drafter[a] == j) & act
            self.pend[..., c] = np.where(read, 0, self.pend[..., c]) + o["tok"]
        if self._catch:
            self.took = o["tok"].astype(np.int64)
        self.finished += o["end"].sum(1)
        self.tokens_total += o["tokens"]
        self.steps += running
        self._retire(o["end"])
        self._admit(np.flatnonzero(self._may_admit()))
        return o["reward"].astype(np.float32), o

    def _retire(self, end: np.ndarray) -> None:
        """Rows that ended leave as they do in the live engine (``env.batch.BatchTarget.retire``), the last slots
        first, each hole taken by the batch's last row: rows stay packed in slots 0..rows-1, in the live order."""
        e = np.flatnonzero(end.any(1))
        if e.size == 0:
            return
        m = self.max_batch
        slot = np.arange(m)
        ended = np.sort(np.where(end[e], slot, -1), axis=1)[:, ::-1]  # ended slots, last first; -1 after
        length = self.active[e].sum(1)
        perm = np.broadcast_to(slot, (e.size, m)).copy()  # perm[j]: the old slot whose row is now in slot j
        for c in range(int(end[e].sum(1).max())):
            d = ended[:, c]
            tail = length - 1
            move = np.flatnonzero((d >= 0) & (d != tail))
            perm[move, d[move]] = perm[move, tail[move]]
            length = length - (d >= 0)
        src = (e[:, None], perm)
        for name in ("prompt", "pos", "s", "n", "last", *(("took", "pend") if self._catch else ())):
            arr = getattr(self, name)
            arr[e] = arr[src]
        self.active[e] = slot < length[:, None]

    def goodput(self) -> np.ndarray:
        """Committed tokens per simulated second of each server's episode so far."""
        return np.where(self.clock > 0, self.tokens_total / np.maximum(self.clock, 1e-12), 0.0)

    def myopic_best(self) -> np.ndarray:
        """The oracle's batch arm: the one that commits the most tokens per second this step."""
        best, arg = np.full(self.num_envs, -np.inf), np.zeros(self.num_envs, np.int64)
        for k in range(len(self.arms)):
            o = self.outcome(np.full((self.num_envs, self.max_batch), k))
            rate = o["tokens"] / np.maximum(o["cost"], 1e-12)
            better = rate > best
            best, arg = np.where(better, rate, best), np.where(better, k, arg)
        return arg


def default_serve_trace() -> Trace:
    """The bundled serving trace (Spec-Bench prompts, the embedded model, n-gram trees)."""
    from importlib import resources
    from pathlib import Path

    path = Path(str(resources.files("env") / "data" / "serve_trace.npz"))
    return load_trace(path if path.is_file() else None)


__all__ = [
    *_obs_names,
    *_load_names,
    "SERVE_ID",
    "DEFAULT_ARMS",
    "DEFAULT_LOADS",
    "ACTIONS",
    "REWARDS",
    "ServeSim",
    "default_serve_trace",
]
