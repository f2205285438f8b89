"""The live server with a policy choosing each step's arm (``env.serving.serve(policy=..., arms=...)``) on the
embedded model in fp32: whatever mix of arms a policy picks, per batch or per row, every request gets exactly the
tokens of plain decoding (greedy speculative decoding is lossless), and the policy sees the serving env's
observation of the live batch (``env.serve_env.LiveObserver``)."""

from __future__ import annotations

import numpy as np
import pytest

from env.batch import BatchEngine
from env.engine import NO_DRAFT, parse_arm
from env.serve_env import ROW_FEATURES, LiveObserver, ServeEnvError, obs_size
from env.serving import Request, ServeError, ServeLog, serve

pytestmark = pytest.mark.model

ARMS = [parse_arm(a) for a in ("none", "ngram-d2", "ngram-d4-k2-b8")]
MAX_NEW, MAX_BATCH = 12, 2
PROMPTS = ("6", "7", "11")  # built-in prompts (summarization, qa, rag) whose n-gram drafts get accepted early


class FakeClock:
    """The server's clock (``serve(clock=...)``): still, but for the time a policy spends."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class RandomPolicy:
    """A random arm each step: one for the batch (an int) or one per row (an array, one per slot); records what
    it saw and chose, and the online rewards it was given."""

    def __init__(self, seed: int, clock: FakeClock | None = None) -> None:
        self.rng = np.random.default_rng(seed)
        self.clock = clock  # its time passes only in act (1 s) and update (0.25 s)
        self.seen: list[np.ndarray] = []
        self.chosen: list[tuple[str, list[int]]] = []
        self.rewards: list[float] = []
        self.infos: list[dict] = []

    def act(self, obs):
        if self.clock is not None:
            self.clock.t += 1.0
        self.seen.append(np.array(obs))
        rows = int(round(float(obs[0]) * MAX_BATCH))
        if self.rng.random() < 0.5:
            k = int(self.rng.integers(len(ARMS)))
            self.chosen.append(("batch", [k] * rows))
            return k
        ks = self.rng.integers(len(ARMS), size=rows)  # exactly one per row the observation reports
        self.chosen.append(("row", ks.tolist()))
        return ks

    def update(self, obs, action, reward, info):
        if self.clock is not None:
            self.clock.t += 0.25
        self.rewards.append(reward)
        self.infos.append(info)


@pytest.fixture(scope="module")
def requests(fp32_model):
    from env.decoder import chat_prompt
    from env.workloads import load_workload

    by_id = {p.prompt_id: p for p in load_workload()}
    prompts = [by_id[i] for i in PROMPTS]
    return [
        Request(p.prompt_id, chat_prompt(fp32_model.tokenizer, p.text), NO_DRAFT, MAX_NEW) for p in prompts
    ]


@pytest.fixture(scope="module")
def plain(fp32_model, requests):
    out = serve(
        BatchEngine(fp32_model, max_rows=MAX_BATCH), requests, concurrency=MAX_BATCH, max_batch=MAX_BATCH
    )
    return {s.rid: s.token_ids for s in out}


@pytest.mark.parametrize("seed", [0, 1])
def test_any_mix_of_arms_is_lossless(fp32_model, requests, plain, seed):
    from env.roofline import roofline

    clock = FakeClock()
    policy = RandomPolicy(seed, clock)
    caps = [1, 1, 2]  # closed loop: request i enters while fewer than caps[i] are in flight
    log = ServeLog()
    out = serve(BatchEngine(fp32_model, max_rows=MAX_BATCH), requests, caps=caps, max_batch=MAX_BATCH,
                policy=policy, arms=ARMS, cost=roofline("h200", "llama-3.1-8b"), log=log, clock=clock)  # fmt: skip
    # the policy's own time is counted (its act within the step's time, its update after it); a clock that only the
    # policy moves makes this exact, with no wall-clock comparison
    acts, updates = len(policy.chosen), len(policy.rewards)
    assert log.policy_s == pytest.approx(acts + 0.25 * updates) and log.step_s == pytest.approx(acts)
    assert sorted(s.rid for s in out) == sorted(plain)
    for s in out:
        assert s.token_ids == plain[s.rid], s.rid
        assert 1 <= len(s.token_ids) <= MAX_NEW
    # the comparison means something: every arm was used, per batch and per row, on batches of 1 and 2 rows
    used = {k for _, ks in policy.chosen for k in ks}
    assert used == {0, 1, 2}
    assert {m for m, _ in policy.chosen} == {"batch", "row"}
    rows = [len(ks) for _, ks in policy.chosen]
    assert set(rows) == {1, 2} and rows[0] == 1  # the first request ran alone (the second's cap is 1)
    assert (
        sum(s.accepted for s in out) > 0 and sum(s.drafted - s.accepted for s in out) > 0
    )  # kept and rejected
    # the online reward (priced by the cost model) was given after every step
    assert len(policy.rewards) == len(policy.chosen) and all(np.isfinite(policy.rewards))
    # with the engine's step time alone (policies.turbospec reads it): the policy's act (1 s here) is not in it
    assert all(set(i) == {"step_s"} and i["step_s"] == 0.0 for i in policy.infos)
    for obs in policy.seen:
        assert obs.shape == (obs_size(MAX_BATCH),)
        flags = obs[9:].reshape(MAX_BATCH, len(ROW_FEATURES))[:, 0]
        assert flags.sum() == round(obs[0] * MAX_BATCH) >= 1 and (flags[:-1] >= flags[1:]).all()


def test_a_policy_needs_its_menu_and_valid_choices(fp32_model, requests):
    with pytest.raises(ServeError, match="arm menu"):
        serve(BatchEngine(fp32_model, max_rows=MAX_BATCH), requests, concurrency=2, policy=RandomPolicy(0))

    class Bad:
        def act(self, obs):
            return len(ARMS)

    with pytest.raises(ServeEnvError, match=r"valid arms: 0\.\.2"):
        serve(
            BatchEngine(fp32_model, max_rows=MAX_BATCH), requests[:1], concurrency=1, policy=Bad(), arms=ARMS
        )


def test_a_budget_too_small_for_the_menus_largest_tree_is_refused_not_waited_on():
    """With a policy a request reserves KV room for the menu's largest tree, not its own arm's: a budget that fits
    the request but not that could never admit it (the loop waited forever); refused in one line instead."""
    from tests.drafters.tiny import tiny_loaded

    req = Request("r0", [5, 6, 7, 8], NO_DRAFT, 10)
    assert req.reservation == 15

    class First:
        def act(self, obs):
            return 0

    with pytest.raises(ServeError, match="needs 23 KV positions with the menu's largest tree"):
        serve(BatchEngine(tiny_loaded(), max_rows=2), [req], concurrency=1, kv_budget=15, policy=First(),
              arms=[NO_DRAFT, parse_arm("ngram-d8")])  # fmt: skip


def test_the_live_observation_marks_the_live_rows(fp32_model, requests):
    from drafters import make_drafter
    from env.step import Stepper

    m = 3
    engine = BatchEngine(fp32_model, max_rows=m)
    stepper = Stepper(engine, ARMS)
    seqs = [stepper.start(r.prompt_ids, MAX_NEW, {"ngram": make_drafter("ngram")}) for r in requests[:2]]
    observer = LiveObserver(ARMS, m)
    obs = observer.observe(stepper, queue=1)
    assert obs.shape == (obs_size(m),) and obs.dtype == np.float32
    block = obs[9:].reshape(m, len(ROW_FEATURES))
    assert (
        block[:, 0].tolist() == [1, 1, 0]
        and obs[0] == pytest.approx(2 / m)
        and obs[1] == pytest.approx(1 / m)
    )
    assert np.allclose(block[:2, 1], [s.context / 1024 for s in seqs])
    assert np.allclose(block[:2, 5], 1 / MAX_NEW)  # one token (the prefill's) of twelve
    assert np.allclose(block[:2, 2], 0.5) and (block[2] == 0).all()  # no evidence yet: the prior's mean
    assert observer.choices(1, 2) == [1, 1] and observer.choices(np.array([2, 0, 1]), 2) == [2, 0]
    with pytest.raises(ServeEnvError):
        observer.choices(np.array([0]) + 3, 2)
    with pytest.raises(ServeEnvError):
        observer.choices(np.array([1, 1]), 3)  # fewer choices than rows
    outcomes = stepper.step(observer.choices(1, 2))  # ngram-d2 on both: evidence moves the estimate
    observer.record(outcomes)
    for o in outcomes:  # a chain's draft was rejected exactly when it was not all accepted
        assert o.result.chain and o.result.rejected == (o.info["accepted"] < o.info["drafted"])
    after = observer.observe(stepper, queue=0)[9:].reshape(m, len(ROW_FEATURES))
    for i, o in enumerate(outcomes):
        if o.info["drafted"] > 0:
            assert after[i, 2] != pytest.approx(0.5) and after[i, 3] == pytest.approx(o.info["accepted"] / 8)
    assert np.allclose(after[:2, 5], [len(s.tokens) / MAX_NEW for s in seqs])
    for s in list(stepper.seqs):
        observer.forget(s)
        stepper.retire(s)
    assert observer.stats == {}


def test_the_cache_is_grown_before_the_clock_starts(fp32_model):
    """A server allocates its KV cache up front: ``serve`` grows it to the largest reservation before its first
    clock reading, so no timed request pays for growing it (a cache starts at 256 positions)."""
    import time

    engine = BatchEngine(fp32_model, max_rows=2)
    start = engine.target.cache.capacity
    reqs = [
        Request("long", [100 + i % 50 for i in range(2 * start)], NO_DRAFT, 4),
        Request("short", [5, 6], NO_DRAFT, 4),
    ]
    seen = []

    def clock():  # the first reading starts the run's clock
        if not seen:
            seen.append(engine.target.cache.capacity)
        return time.perf_counter()

    out = serve(engine, reqs, concurrency=2, max_batch=2, clock=clock)
    assert seen[0] > max(r.reservation for r in reqs) > start
    assert engine.target.cache.capacity == seen[0]  # and not grown again while serving
    assert len(out) == 2 and all(1 <= len(s.token_ids) <= 4 for s in out)


def test_an_open_loop_server_waits_on_its_own_clock(fp32_model):
    """Open loop with the caller's clock: an idle server sleeps until the next arrival through ``sleep``, which
    moves that clock (a still clock with the real ``time.sleep`` would wait forever); the late request enters at
    its arrival time, not before."""
    clock = FakeClock()
    slept = []

    def sleep(s: float) -> None:
        slept.append(s)
        clock.t += s

    reqs = [Request("early", [5, 6, 7], NO_DRAFT, 3, 0.0), Request("late", [8, 9], NO_DRAFT, 3, 100.0)]
    out = serve(BatchEngine(fp32_model, max_rows=2), reqs, max_batch=2, clock=clock, sleep=sleep)
    by = {s.rid: s for s in out}
    assert by["late"].arrival_s == 100.0 and by["late"].first_token_s >= 100.0
    assert by["early"].finish_s < 100.0 and sum(slept) == pytest.approx(100.0 - by["early"].finish_s)
    assert all(1 <= len(s.token_ids) <= 3 for s in out)
