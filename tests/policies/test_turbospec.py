"""``TurboSpecPolicy``: SmartSpec's rule with its prices bent online to measured step times. Without a measurement
(replay) it is SmartSpec; a machine slower everywhere changes no choice; one where wide trees cost more than priced
against plain steps moves the choice toward plain steps in that batch size only; its state saves, loads and is
checked."""

from __future__ import annotations

import numpy as np
import pytest

from env.batch_cost import load_batch_cost
from env.serve_env import feature_names, obs_size
from policies.archive import npz_bytes
from policies.base import PolicyError, load_policy
from policies.serving import SmartSpecPolicy
from policies.turbospec import TurboSpecPolicy
from tests.policies.test_serving_policies import ARMS, _with_state, make_sim, obs_with, trace  # noqa: F401

CPU = load_batch_cost(None).to_json()  # the shipped calibration of a 2-core CPU: drafting is dear at 16 rows


def turbospec(m: int = 16, **kw) -> TurboSpecPolicy:
    return TurboSpecPolicy(ARMS, obs_size(m), feature_names(m), cost=CPU, **kw)


def smartspec(m: int = 16) -> SmartSpecPolicy:
    return SmartSpecPolicy(ARMS, obs_size(m), feature_names(m), cost=CPU)


def _stream(rows: int, n: int, seed: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [obs_with(16, rows, alpha=float(rng.uniform(0.2, 0.95)), match=float(rng.choice([0, 2, 8])))
            for _ in range(n)]  # fmt: skip


def _observations(m: int = 16) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [obs_with(m, int(rows), alpha=float(a), match=float(d))
            for rows, a, d in zip(rng.integers(1, m + 1, 60), rng.random(60), rng.integers(0, 17, 60))]  # fmt: skip


def _serve(p: TurboSpecPolicy, obs: np.ndarray, machine) -> int:
    """One live step: act, then the step measured as ``machine(priced seconds of the arm, of a plain step)``."""
    k = p.act(obs)
    _, seconds, _ = p.estimate(obs)
    p.update(obs, k, 1.0, {"step_s": machine(float(seconds[k]), float(seconds[ARMS.index("none")]))})
    return k


def test_without_measurements_it_is_smartspec():
    s, t = smartspec(), turbospec()
    for o in _observations():
        assert t.act(o) == s.act(o)
        t.update(o, t.act(o), 1.0, {})  # replay: no step_s, nothing learned
    assert (t.sums == 0).all()


def test_in_replay_it_serves_as_smartspec(trace):  # noqa: F811
    from policies.serving import run_policy

    cost = "roofline:h200/llama-3.1-8b"
    s = SmartSpecPolicy(ARMS, obs_size(4), feature_names(4), cost=load_batch_cost(cost).to_json())
    t = TurboSpecPolicy(ARMS, obs_size(4), feature_names(4), cost=load_batch_cost(cost).to_json())
    assert np.array_equal(run_policy(make_sim(trace, seed=3), s, online=True),
                          run_policy(make_sim(trace, seed=3), t, online=True))  # fmt: skip


def test_a_machine_slower_everywhere_changes_no_choice():
    s, t = smartspec(), turbospec()
    for o in _observations():
        assert _serve(t, o, lambda priced, plain: 1.4 * priced) == s.act(o)
    assert t.sums[:, 0].sum() > 0 and all(abs(t.slope(b)) < 1e-9 for b in range(len(t.buckets)))


def test_wide_trees_dearer_than_priced_move_the_choice_to_plain_steps_in_that_bucket_only():
    """At sixteen rows a step measures ``priced * (priced / plain)^0.5`` (wider trees dearer than the calibration
    says, plain steps as priced): serving a stream there, the policy learns the bend and, where SmartSpec drafts
    by a small margin, serves a plain step; at one row, a bucket it measured nothing in, it chooses as SmartSpec
    does. On a machine as priced it learns no bend."""
    s, t, flat = smartspec(), turbospec(), turbospec()
    for o in _stream(16, 200):
        _serve(t, o, lambda priced, plain: priced * (priced / plain) ** 0.5)
        _serve(flat, o, lambda priced, plain: priced)
    b = t.bucket(16)
    assert 0.3 < t.slope(b) <= 0.5 and abs(flat.slope(b)) < 1e-9  # (the ridge pulls it toward 0)
    flips = [o for o in _stream(16, 200, seed=2) if ARMS[s.act(o)] != "none" and ARMS[t.act(o)] == "none"]
    assert flips  # rows where drafting paid by a little under the calibrated curve
    assert not [o for o in _stream(16, 200, seed=2) if ARMS[s.act(o)] == "none" and ARMS[t.act(o)] != "none"]
    assert all(t.act(o) == s.act(o) for o in _stream(1, 100, seed=3))
    assert all(flat.act(o) == s.act(o) for o in _stream(16, 100, seed=3))


def test_an_update_after_another_arm_or_a_bad_time_learns_nothing():
    t = turbospec()
    o = obs_with(16, 4, alpha=0.9, match=4)
    k = t.act(o)
    t.update(o, (k + 1) % len(ARMS), 1.0, {"step_s": 1.0})  # not the arm it chose
    for bad in (float("nan"), float("inf"), -1.0, 0.0, "1.0", None, True):
        t.act(o)
        t.update(o, k, 1.0, {"step_s": bad})
    t.update(o, k, 1.0, {"step_s": 1.0})  # no act before it
    assert (t.sums == 0).all()
    t.act(o)
    t.update(o, k, 1.0, {"step_s": 1e9})  # a stall: one clipped outlier
    assert t.sums[t.bucket(4), 2] == pytest.approx(3.0)


def test_its_state_saves_loads_and_is_checked(tmp_path):
    t = turbospec(window=64)
    for o in _stream(16, 80) + _stream(4, 80):
        _serve(t, o, lambda priced, plain: priced * (priced / plain) ** 0.3)
    t.save(tmp_path / "t.zip")
    back = load_policy(tmp_path / "t.zip")
    assert isinstance(back, TurboSpecPolicy) and back.window == 64 and back.prior == 0.5
    assert np.array_equal(back.sums, t.sums) and back.slope(back.bucket(16)) > 0
    assert all(back.act(o) == t.act(o) for o in _observations())
    shape = t.sums.shape
    for state, needle in (
        ({"other": np.zeros(shape)}, "has no sums"),
        ({"sums": np.zeros((2, 2))}, "shape"),
        ({"sums": np.full(shape, np.nan)}, "must be finite"),
        ({"sums": np.full(shape, -1.0)}, "must be finite"),
        ({"sums": np.zeros(shape, bool)}, "real numbers"),
        ({"sums": np.tile([1.0, 0.0, 100.0, 0.0, 0.0], (shape[0], 1))}, "not sums of its updates"),
        ({"sums": np.tile([2.0, 2.0, 0.0, 0.5, 0.0], (shape[0], 1))}, "not sums of its updates"),
        ({"sums": np.tile([100.0, 0.0, 0.0, 0.0, 0.0], (shape[0], 1))}, "step weights in .0, 64."),
    ):
        bad = _with_state(tmp_path / "t.zip", tmp_path / "bad.zip", npz_bytes(**state))
        with pytest.raises(PolicyError, match=needle):
            load_policy(bad)
    for kw in ({"prior": 0.0}, {"window": 0}, {"window": 2.5}, {"prior": float("nan")}):
        with pytest.raises(PolicyError):
            turbospec(**kw)
    with pytest.raises(PolicyError, match="must hold none"):
        TurboSpecPolicy(ARMS[1:], obs_size(16), feature_names(16), cost=CPU)


@pytest.mark.model
def test_served_live_it_learns_from_every_step_the_engine_times(fp32_model):
    """Through the live server on the embedded model: every step it chose updates its bucket's sums with the
    engine's measured step time (the ``act``'s arm, the server's batch arm and the priced arm line up)."""
    from env.batch import BatchEngine
    from env.decoder import chat_prompt
    from env.engine import parse_arm
    from env.serving import Request, ServeLog, serve
    from env.workloads import load_workload

    arms, m = ["none", "ngram-d2", "ngram-d4"], 2
    p = TurboSpecPolicy(
        arms, obs_size(m), feature_names(m), cost=CPU, window=10**6
    )  # (no forgetting: counts)
    by_id = {q.prompt_id: q for q in load_workload()}
    reqs = [Request(i, chat_prompt(fp32_model.tokenizer, by_id[i].text), parse_arm("none"), 12)
            for i in ("6", "7", "11")]  # fmt: skip
    log = ServeLog()
    out = serve(BatchEngine(fp32_model, max_rows=m), reqs, concurrency=2, max_batch=m, policy=p,
                arms=[parse_arm(a) for a in arms], cost=load_batch_cost(None), log=log)  # fmt: skip
    assert len(out) == 3
    n = p.sums[:, 0]
    assert n.sum() == pytest.approx(log.steps, rel=1e-3) and n[p.bucket(1)] > 0 and n[p.bucket(2)] > 0
    assert (np.abs(p.sums[:, 2]) < 3.0 * n + 1e-9).all()  # log(measured / priced), clipped, per step
