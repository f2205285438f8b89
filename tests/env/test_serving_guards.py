"""What the live server refuses, and what it records, on the tiny target: a serving policy's action that is no arm
index (refused as replay refuses it, ``ServeSim._actions``), a step choice that is no arm index, an arrival time
that is never reached, a prompt of non-integer token ids; and under a policy, each request's arm is ``policy``
with the steps it ran per arm."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from drafters import make_drafter
from env.batch import BatchEngine
from env.engine import NO_DRAFT, parse_arm
from env.serve_obs import LiveObserver, ServeEnvError
from env.serving import POLICY_ARM, Request, ServeError, ServeLog, check_load, serve
from env.step import Stepper
from env.target import PromptError, check_prompt
from tests.drafters.tiny import tiny_loaded

LOOP = [7, 21, 4, 60, 33, 12, 9, 51]
MENU = ("none", "ngram-d2", "ngram-d4")


@pytest.fixture(scope="module")
def loaded():
    return tiny_loaded()


def observer(max_batch: int = 3) -> LiveObserver:
    return LiveObserver([parse_arm(a) for a in MENU], max_batch=max_batch)


@pytest.mark.parametrize(
    "action",
    [1.7, True, np.float32(2.9), "2", [0.5, 1.5], math.nan, math.inf, None, {"x": 1}, np.array([True, False]),
     [[1], [1, 2]], [], 1 + 0j],
)  # fmt: skip
def test_live_choices_refuse_an_action_that_is_no_arm_index(action):
    """Replay refuses non-integral, bool, non-numeric and non-finite actions; live refuses the same (not 1.7 -> 1)."""
    with pytest.raises(ServeEnvError, match="integer arm indices"):
        observer().choices(action, 2)


@pytest.mark.parametrize("action", [3, -1, [0, 3], 1e30, [1, 1]])
def test_live_choices_refuse_an_arm_out_of_range_or_too_few(action):
    with pytest.raises(ServeEnvError, match="rows"):
        observer().choices(action, 3 if action == [1, 1] else 2)


def test_live_choices_take_integers_and_whole_floats_as_replay_does():
    obs = observer()
    assert obs.choices(2.0, 2) == [2, 2] and obs.choices(np.int64(1), 1) == [1]
    assert obs.choices(np.array([2.0, 0.0, 1.0]), 2) == [2, 0]  # one per slot: the first rows'
    assert obs.choices(np.array([[1, 2, 0]]), 3) == [1, 2, 0]
    assert all(type(c) is int for c in obs.choices(np.array([1, 2], np.uint8), 2))


@pytest.mark.parametrize("choice", [-1, 2, 1.9, None, True])
def test_a_step_choice_that_is_no_arm_index_is_refused_before_the_step(loaded, choice):
    """-1 would run the last arm, 1.9 arm 1, True arm 1, 2 an IndexError: each a one-line ValueError, nothing run."""
    st = Stepper(BatchEngine(loaded, max_rows=1), [NO_DRAFT, parse_arm("ngram-d4")])
    seq = st.start(LOOP + LOOP[:3], 8, {"ngram": make_drafter("ngram")})
    with pytest.raises(ValueError, match="arm index") as err:
        st.step([choice])
    assert "\n" not in str(err.value) and seq.steps == 1 and len(seq.tokens) == 1
    (o,) = st.step([np.int64(1)])  # a numpy integer is an arm index
    assert o.result.arm.name == "ngram-d4"


@pytest.mark.parametrize("arrival", [math.nan, math.inf, -math.inf, -1.0, "0", True, None])
def test_an_arrival_time_that_is_never_reached_is_refused(arrival):
    reqs = [Request("a", [5, 6, 7], NO_DRAFT, 4), Request("b", [5, 6], NO_DRAFT, 4, arrival)]
    with pytest.raises(ServeError, match="request b: arrival_s must be a finite time >= 0"):
        check_load(reqs, concurrency=None, max_batch=2, kv_budget=4096)
    check_load(reqs[:1], concurrency=1, max_batch=2, kv_budget=4096)  # the closed loop's default 0.0


@pytest.mark.parametrize("arrival", [math.nan, math.inf])
def test_serving_an_arrival_never_reached_fails_at_once_not_spinning(loaded, arrival):
    waits = []

    def sleep(s: float) -> None:  # the old open loop slept here forever: stop it instead of hanging the suite
        waits.append(s)
        if len(waits) > 50:
            raise AssertionError("serve() is waiting on an arrival that never comes")

    eng = BatchEngine(loaded, max_rows=2)
    with pytest.raises(ServeError, match="arrival_s"):
        serve(eng, [Request("a", [5, 6, 7], parse_arm("ngram-d4"), 4, arrival)], max_batch=2, sleep=sleep)
    assert not waits


@pytest.mark.parametrize(
    ("ids", "bad"),
    [
        ([5.0, 6], "5.0"),
        ([5, 6.5], "6.5"),
        ([True, 5], "True"),
        ([np.float32(5), 6], "np.float32(5.0)"),
        (["5"], "'5'"),
    ],
)
def test_a_prompt_of_non_integer_token_ids_is_refused_naming_the_id(ids, bad):
    for vocab in (None, 96):
        with pytest.raises(PromptError, match=re.escape(f"token id {bad} (")):
            check_prompt(ids, 512, vocab_size=vocab)
    check_prompt([5, np.int64(6), np.int32(7)], 512, vocab_size=96)


@pytest.mark.parametrize("chunk", [None, 3])
def test_the_server_refuses_float_token_ids_instead_of_truncating_them(loaded, chunk):
    eng = BatchEngine(loaded, max_rows=2)
    with pytest.raises(PromptError, match="token id 6.5"):
        serve(eng, [Request("a", [5, 6.5], parse_arm("ngram-d4"), 4)], concurrency=1, max_batch=2,
              prefill_chunk=chunk)  # fmt: skip


class Alternate:
    """The batch's arm by step: ngram-d2, ngram-d4, ngram-d2, ..."""

    def __init__(self) -> None:
        self.t = 0

    def act(self, obs: np.ndarray) -> int:
        self.t += 1
        return 1 if self.t % 2 else 2


def test_under_a_policy_each_request_records_policy_and_its_steps_per_arm(loaded):
    arms = [parse_arm(a) for a in MENU]
    # as serve-bench builds a policy's requests: a placeholder arm, ignored
    reqs = [Request(str(i), LOOP * 3 + [i + 3], NO_DRAFT, 16) for i in range(3)]
    log = ServeLog()
    out = serve(BatchEngine(loaded, max_rows=2), reqs, concurrency=2, max_batch=2, policy=Alternate(), arms=arms,
                log=log)  # fmt: skip
    assert {s.arm for s in out} == {POLICY_ARM}
    total: dict[str, int] = {}
    for s in out:
        assert sum(s.arm_steps.values()) == s.steps - 1  # every batch step (the prefill's token not one)
        for k, v in s.arm_steps.items():
            total[k] = total.get(k, 0) + v
    assert total == dict(log.arm_rows) and set(total) == {"ngram-d2", "ngram-d4"}


def test_without_a_policy_each_request_records_its_own_arm_and_steps(loaded):
    reqs = [Request(str(i), LOOP * 2 + [i + 3], parse_arm(a), 12) for i, a in enumerate(("none", "ngram-d4"))]
    out = serve(BatchEngine(loaded, max_rows=2), reqs, concurrency=2, max_batch=2)
    for s, r in zip(out, reqs):
        assert s.arm == r.arm.name and s.arm_steps == {r.arm.name: s.steps - 1}


def test_a_static_policy_is_served_as_an_engine_configured_with_its_arm(loaded):
    """A policy with ``static_arm`` runs no observation and no act: every request on that arm, as the same arm chosen
    every step through the policy path commits; an arm outside the menu is refused."""

    class Fixed:
        def __init__(self, k, static):
            self.k = k
            if static:
                self.static_arm = k

        def act(self, obs):
            return self.k

    arms = [parse_arm(a) for a in MENU]
    out = {}
    for static in (True, False):
        reqs = [Request(str(i), LOOP * 3 + [i + 3], NO_DRAFT, 16) for i in range(3)]
        log = ServeLog()
        got = serve(BatchEngine(loaded, max_rows=2), reqs, concurrency=2, max_batch=2, policy=Fixed(2, static),
                    arms=arms, log=log)  # fmt: skip
        out[static] = (got, log)
    (st, st_log), (po, po_log) = out[True], out[False]
    assert [s.token_ids for s in st] == [s.token_ids for s in po] and st_log.steps == po_log.steps > 0
    assert st_log.policy_s == 0 < po_log.policy_s and {s.arm for s in st} == {"ngram-d4"}
    assert dict(st_log.arm_rows) == dict(po_log.arm_rows) == {"ngram-d4": st_log.row_steps}
    with pytest.raises(ServeError, match="static policy's arm 3 is not in the menu of 3 arms"):
        serve(BatchEngine(loaded, max_rows=2), [Request("0", LOOP, NO_DRAFT, 4)], concurrency=1, policy=Fixed(3, True),
              arms=arms)  # fmt: skip


def test_the_live_record_updates_the_estimate_as_replay_does():
    """``LiveObserver.record`` keeps each row's counts in Python floats; they are ``update_alpha``'s, bit for bit."""
    from types import SimpleNamespace

    from env.serve_obs import tree_depth, update_alpha

    rng = np.random.default_rng(0)
    obs, seq = observer(), object()
    s, n, last = np.float64(0), np.float64(0), 0.0
    for _ in range(200):
        dr = int(rng.integers(0, 5))
        acc, rej = int(rng.integers(0, dr + 1)), bool(rng.integers(0, 2))
        obs.record(
            [
                SimpleNamespace(
                    seq=seq, info={"accepted": acc, "drafted": dr}, result=SimpleNamespace(rejected=rej)
                )
            ]
        )
        s, n = update_alpha(s, n, acc, dr, rej)
        last = float(acc) if dr > 0 else last
        assert obs.stats[id(seq)] == [float(s), float(n), last]
    import torch

    par = [-1, 0, 1, 0, 3, 4, 2]
    assert tree_depth(torch.tensor(par)) == tree_depth(np.array(par)) == tree_depth(par) == 3
    assert tree_depth([-1]) == 0


def test_a_policy_acts_with_numpy_blas_on_one_thread_and_the_limit_is_lifted_after(loaded):
    """NumPy's BLAS threads spin after each call on the cores the next forward needs (a LinUCB solve made a 2-core
    server's steps ~2.5x slower): serve runs the policy with BLAS on one thread, and restores it when done."""
    from threadpoolctl import threadpool_info, threadpool_limits

    def blas_threads() -> list[int]:
        return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]

    class Seeing:
        seen: list[list[int]] = []

        def act(self, obs):
            self.seen.append(blas_threads())
            return 0

    with threadpool_limits(
        2, user_api="blas"
    ):  # two before (one already would prove nothing: OMP_NUM_THREADS=1)
        before = blas_threads()
        pol = Seeing()
        reqs = [Request(str(i), LOOP * 2 + [i + 3], NO_DRAFT, 8) for i in range(2)]
        serve(BatchEngine(loaded, max_rows=2), reqs, concurrency=2, max_batch=2, policy=pol,
              arms=[parse_arm(a) for a in MENU])  # fmt: skip
        assert before and set(before) == {2} and pol.seen and all(t == [1] * len(before) for t in pol.seen)
        assert blas_threads() == before
