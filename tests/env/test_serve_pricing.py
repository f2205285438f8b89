"""Replay charges a serving policy what serving it live adds to a step (``ServeSim.price_policy``): the cost model's
bookkeeping at the step's rows, the policy's act, and the match drafter's proposals for the rows that do not draft
with it; nothing else changes (the same tokens in the same steps), nothing is charged by default, and the act's
timing (``policies.act_cost``) leaves an online policy as it was."""

from __future__ import annotations

import numpy as np
import pytest

from env.cost import Curve
from env.serve_env import ServeEnvError, ServeSim
from tests.env.test_batch_cost import fitted

ACT = 4e-4
NGRAM_ROW = 2e-4  # fitted()'s n-gram proposal per row


def _pair(cost, arms=None, load="4"):
    kw = dict(cost=cost, loads=[load], requests=8, seed=3)
    if arms is not None:
        kw["arms"] = arms
    a, b = ServeSim(3, **kw), ServeSim(3, **kw)
    a.reset()
    b.reset()
    return a, b


def _expected_extra(sim, a, book):
    """What a priced step adds, computed here from the definition."""
    rows = sim.active.sum(1)
    acts = a if a.ndim == 2 else np.broadcast_to(a[:, None], sim.active.shape)
    names = [arm.drafter for arm in sim.arms]
    ngram = np.array([n == "ngram" for n in names])[acts] & sim.active
    extra = book(rows) + ACT + NGRAM_ROW * (rows - ngram.sum(1)) * any(n == "ngram" for n in names)
    return np.where((rows > 0) & ~sim.done(), extra, 0.0)


@pytest.mark.parametrize("per_row", [False, True])
def test_a_priced_policy_pays_the_book_its_act_and_the_match_proposals_and_nothing_else_changes(per_row):
    book = Curve((1, 4), (1e-3, 2e-3))
    base, priced = _pair(fitted(policy_book=book))
    priced.price_policy(ACT)
    rng = np.random.default_rng(0)
    want = np.zeros(base.num_envs)
    steps = 0
    while not base.done().all():
        k = len(base.arms)
        a = rng.integers(0, k, (3, base.max_batch)) if per_row else rng.integers(0, k, 3)
        want += _expected_extra(base, a, lambda r: fitted(policy_book=book).policy_book_s(r))
        r0, _ = base.step(a)
        r1, _ = priced.step(a)
        assert np.array_equal(base.active, priced.active) and np.array_equal(base.pos, priced.pos)
        assert (r1 <= r0).all()  # the reward sees the dearer step
        steps += 1
    assert steps > 5 and (base.tokens_total == priced.tokens_total).all()
    assert np.allclose(priced.clock - base.clock, want, rtol=1e-9, atol=1e-12)
    assert (priced.clock > base.clock).all()


def test_unpriced_by_default_and_without_a_book_only_the_act_and_the_proposals():
    base, priced = _pair(fitted())  # a cost model from before the book: no figure for it
    assert base.policy_act_s is None
    priced.price_policy(ACT)
    want = np.zeros(base.num_envs)
    a = np.zeros(3, np.int64)  # "none": every row pays the observation's n-gram proposal
    while not base.done().all():
        want += _expected_extra(base, a, lambda r: np.zeros_like(np.asarray(r, float)))
        base.step(a)
        priced.step(a)
    assert np.allclose(priced.clock - base.clock, want)
    priced.price_policy(None)  # off again
    assert priced.policy_act_s is None


def test_a_menu_without_a_drafter_pays_no_proposal():
    book = Curve((1, 16), (1e-3, 1e-3))
    base, priced = _pair(fitted(policy_book=book), arms=["none"])
    priced.price_policy(0.0)
    steps = np.zeros(3)
    while not base.done().all():
        steps += (~base.done()) & (base.active.sum(1) > 0)
        base.step(np.zeros(3, np.int64))
        priced.step(np.zeros(3, np.int64))
    assert np.allclose(priced.clock - base.clock, 1e-3 * steps)


@pytest.mark.parametrize("bad", [float("nan"), -1e-3, 11.0, float("inf")])
def test_an_act_time_out_of_range_is_refused(bad):
    sim = ServeSim(1, cost=fitted(), loads=["1"], requests=2)
    with pytest.raises(ServeEnvError, match="finite seconds"):
        sim.price_policy(bad)


def test_the_act_is_timed_on_observations_without_teaching_an_online_policy():
    from env.serve_env import obs_size
    from policies.act_cost import act_seconds, sample_observations
    from policies.serving import BucketUCB

    sim = ServeSim(2, cost=fitted(), loads=["4"], requests=6, seed=1)
    sim.reset()
    seen = sample_observations(sim, steps=8)
    assert seen.ndim == 2 and seen.shape[1] == obs_size(16) and len(seen) >= 8
    assert (seen[:, 0] > 0).all()  # every sample has rows in flight
    bandit = BucketUCB(sim.arm_names, obs_size(16))
    before = bandit.counts.copy()
    t = act_seconds(bandit, seen, calls=50)
    assert 0 < t < 0.05 and (bandit.counts == before).all()


def _copy_menu(name: str, arms: list[str], cost):
    from tests.env.test_serve_menu import _with_copy_of_ngram

    trace = _with_copy_of_ngram(name)
    kw = dict(trace=trace, arms=arms, cost=cost, max_batch=4, loads=["2"], requests=5, seed=1)
    a, b = ServeSim(3, **kw), ServeSim(3, **kw)
    a.reset()
    b.reset()
    return a, b


@pytest.mark.parametrize(
    "name, per_row",
    [("suffix", lambda c: 3e-4), ("eagle3", lambda c: c.draft_s("eagle3", 1, 16))],
)
def test_a_match_drafter_that_proposes_again_is_charged_at_every_row_one_at_a_time(name, per_row):
    """Observing with a drafter whose rows do not verify the observation's proposal (no ``exact_replay``: suffix,
    a model head) costs a proposal per row at the record shape's depth, whatever the rows then draft with."""
    from env.batch_cost import BatchedDraft
    from env.serve_sim import RECORD_DEPTH
    from env.step import RECORD_SHAPE

    assert RECORD_SHAPE.depth == RECORD_DEPTH
    cost = fitted(drafters={"ngram": NGRAM_ROW, "suffix": 3e-4},
                  batched={"eagle3": BatchedDraft((1, 4), (1e-3, 2e-3), (4e-3, 5e-3))})  # fmt: skip
    base, priced = _copy_menu(name, ["none", f"{name}-d2"], cost)
    priced.price_policy(ACT)
    assert not priced._match_reuse
    one = float(per_row(cost))
    assert one > NGRAM_ROW
    want, rng = np.zeros(3), np.random.default_rng(2)
    while not base.done().all():
        rows = base.active.sum(1)
        want += np.where((rows > 0) & ~base.done(), ACT + rows * one, 0.0)  # no book: an older file
        a = rng.integers(0, 2, 3)  # drafting with it or not: the same charge
        base.step(a)
        priced.step(a)
    assert np.allclose(priced.clock - base.clock, want)


def test_the_act_timing_reads_the_action_and_prices_the_online_reward(monkeypatch):
    from env.serve_env import DEFAULT_ARMS, obs_size
    from env.serve_obs import LiveObserver
    from policies.act_cost import act_seconds
    from policies.serving import BucketUCB

    seen = np.zeros((4, obs_size(16)), np.float32)
    seen[:, 0] = np.array([1, 2, 4, 16]) / 16
    calls = {"choices": 0, "forward": 0}
    real = LiveObserver.choices

    def counted(self, action, rows):
        calls["choices"] += 1
        return real(self, action, rows)

    monkeypatch.setattr(LiveObserver, "choices", counted)
    cost = fitted()

    class Counting:
        def forward_s(self, *a):
            calls["forward"] += 1
            return cost.forward_s(*a)

        def __getattr__(self, k):
            return getattr(cost, k)

    act_seconds(
        BucketUCB(list(DEFAULT_ARMS), obs_size(16)), seen, calls=8, arms=DEFAULT_ARMS, cost=Counting()
    )
    assert calls == {"choices": 8, "forward": 8}


def test_the_act_timing_takes_any_observation_without_a_menu_and_refuses_an_empty_one():
    from policies.act_cost import act_seconds

    class First:
        def act(self, obs):
            return 0

    assert 0 <= act_seconds(First(), np.zeros((3, 5), np.float32), calls=5) < 0.05  # no serving observation
    with pytest.raises(ValueError, match="non-empty"):
        act_seconds(First(), np.zeros((0, 5), np.float32))
