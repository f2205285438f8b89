"""Serving policies (``policies.serving``): the batch table picks by rows, TensorRT-LLM's AUTO table, a table fitted
from goodputs, SmartSpec's rule at the extremes of acceptance under the H200 roofline, save and load through
``policies.base.load_policy`` (and a damaged bandit state refused), and runs on the replayed server."""

from __future__ import annotations

import hashlib
import json
import warnings
import zipfile

import numpy as np
import pytest

from env.roofline import roofline
from env.serve_env import DEFAULT_ARMS, ROW_FEATURES, ServeSim, feature_names, obs_size
from policies.archive import npz_bytes
from policies.base import PolicyError, load_policy
from policies.serving import (
    BatchTablePolicy,
    BucketUCB,
    SmartSpecPolicy,
    fit_batch_table,
    run_policy,
    static_goodputs,
    train_serve_ppo,
    trt_auto,
)
from tests.env.conftest import make_trace
from tests.hostile import npz_payload, replace_members

ARMS = list(DEFAULT_ARMS)  # none, ngram-d1, d2, d3, d5, d8
COST = "roofline:h200/llama-3.1-8b"


def obs_with(m: int, rows: int, alpha: float = 0.5, match: float = 8.0, context: float = 256.0) -> np.ndarray:
    """A serving observation of ``rows`` active rows of the same acceptance, match depth and context."""
    x = np.zeros(obs_size(m), np.float32)
    x[0] = rows / m
    block = x[9:].reshape(m, len(ROW_FEATURES))
    block[:rows, 0] = 1.0
    block[:rows, 1] = context / 1024
    block[:rows, 2] = alpha
    block[:rows, 4] = match / 16
    return x


@pytest.fixture(scope="module")
def trace():
    return make_trace(seed=0, prompts=8, max_new=40)


def make_sim(trace, num_envs=4, loads=("1", "4"), seed=0, **kw):
    return ServeSim(
        num_envs, trace=trace, cost=COST, max_batch=4, loads=list(loads), requests=6, seed=seed, **kw
    )


# ---- batch tables ---------------------------------------------------------------------------------------------------


def test_a_batch_table_picks_by_rows():
    m = 16
    p = BatchTablePolicy(
        ARMS, obs_size(m), feature_names(m), table=[[2, "ngram-d8"], [8, "ngram-d3"], [1 << 30, "none"]]
    )
    want = {1: "ngram-d8", 2: "ngram-d8", 3: "ngram-d3", 8: "ngram-d3", 9: "none", 16: "none"}
    for rows, arm in want.items():
        assert ARMS[p.act(obs_with(m, rows))] == arm, rows
    batch = np.stack([obs_with(m, r) for r in want])
    assert [ARMS[a] for a in p.act_batch(batch)] == list(want.values())
    short = BatchTablePolicy(ARMS, obs_size(m), table=[[4, "ngram-d5"]])  # past the last bound: its arm
    assert ARMS[short.act(obs_with(m, 12))] == "ngram-d5"
    assert p.kind == "schedule" and p.type_name == "serve_table"


def test_bad_batch_tables_are_refused():
    size = obs_size(4)
    for table, needle in [([], "at least one entry"), ([[4, "none"], [2, "ngram-d1"]], "must increase"),
                          ([[2, "none"], [2, "ngram-d1"]], "must increase"), ([[2, "eagle-d3"]], "not in the arm menu"),
                          ([["x", "none"]], "max_rows must be an integer"), ([[1, "none", 3]], "max_rows, arm"),
                          ([["7", "none"]], "max_rows must be an integer in"), ([[True, "none"]], "must be an integer"),
                          ([[2.7, "none"]], "must be an integer"), ([[-5, "none"]], r"must be an integer in \[1, "),
                          ([[0, "none"]], "got 0"), ([[1 << 31, "none"]], "got 2147483648"),
                          ([[2, 3]], "max_rows, arm"), ("x", "max_rows, arm")]:  # fmt: skip
        with pytest.raises(PolicyError, match=needle):
            BatchTablePolicy(ARMS, size, table=table)
    with pytest.raises(PolicyError, match="not a serving observation"):
        BatchTablePolicy(ARMS, 20, table=[[1, "none"]])  # 9 + 6 * M it is not
    with pytest.raises(PolicyError, match="features differ"):
        BucketUCB(ARMS, size, [f"f{i}" for i in range(size)])


def test_a_batch_table_for_other_features_is_refused():
    size = obs_size(4)
    with pytest.raises(PolicyError, match="features differ"):
        BatchTablePolicy(ARMS, size, [f"f{i}" for i in range(size)], table=[[1, "none"]])


def test_trt_auto_is_tensorrt_llms_rule():
    m = 64
    p = trt_auto(ARMS, obs_size(m), feature_names(m))
    assert p.table == [(4, "ngram-d5"), (32, "ngram-d3"), (1 << 30, "none")] and p.name == "trt-auto"
    for rows, arm in {
        1: "ngram-d5",
        4: "ngram-d5",
        5: "ngram-d3",
        32: "ngram-d3",
        33: "none",
        64: "none",
    }.items():
        assert ARMS[p.act(obs_with(m, rows))] == arm, rows
    with pytest.raises(PolicyError, match="needs arms"):
        trt_auto(["none", "ngram-d3"], obs_size(4))


def test_fit_batch_table_takes_the_best_arm_per_level_and_merges():
    g = {
        "1": {"none": 1.0, "ngram-d5": 3.0, "ngram-d3": 2.0},
        "2": {"none": 2.0, "ngram-d5": 4.0, "ngram-d3": 3.5},
        "4": {"none": 4.0, "ngram-d5": 4.5, "ngram-d3": 5.0},
        "8": {"none": 7.0, "ngram-d5": 5.0, "ngram-d3": 7.5},
        "16": {"none": 9.0, "ngram-d5": 5.0, "ngram-d3": 8.0},
        "ramp": {"none": 99.0, "ngram-d5": 0.0, "ngram-d3": 0.0},  # not a concurrency: ignored
    }
    p = fit_batch_table(g, ARMS, obs_size(16), feature_names(16))
    assert p.table == [(2, "ngram-d5"), (8, "ngram-d3"), (1 << 30, "none")]  # the last bound is open
    assert p.name == "fitted-table"
    one = fit_batch_table(
        {"1": {"none": 1.0, "ngram-d2": 2.0}, "4": {"none": 1.0, "ngram-d2": 3.0}}, ARMS, obs_size(4)
    )
    assert one.table == [(1 << 30, "ngram-d2")]
    with pytest.raises(PolicyError, match="integer concurrencies"):
        fit_batch_table({"ramp": {"none": 1.0}}, ARMS, obs_size(4))


# ---- SmartSpec -------------------------------------------------------------------------------------------------------


def smartspec(m: int = 16, arms=ARMS) -> SmartSpecPolicy:
    return SmartSpecPolicy(
        arms, obs_size(m), feature_names(m), cost=roofline("h200", "llama-3.1-8b").to_json()
    )


def test_smartspec_drafts_deep_when_drafts_are_accepted_and_not_when_rejected():
    p = smartspec()
    assert (
        ARMS[p.act(obs_with(16, 1, alpha=1.0, match=16))] == "ngram-d8"
    )  # ~9 tokens for about one step's time
    assert ARMS[p.act(obs_with(16, 1, alpha=0.0, match=16))] == "none"  # one token either way: the cheapest
    assert ARMS[p.act(obs_with(16, 1, alpha=1.0, match=0))] == "none"  # nothing to draft: nothing gained
    # a chain is no longer than the drafter's proposal: at match depth 3, d3 ~ d5 ~ d8 in tokens, d3 cheapest
    s = p.scores(obs_with(16, 1, alpha=1.0, match=3))
    assert ARMS[int(np.argmax(s))] == "ngram-d3" and s[ARMS.index("ngram-d3")] > s[ARMS.index("ngram-d1")]
    # at alpha 0.5 the expected tokens are (1 - a^(d+1)) / (1 - a); the score is tokens / the step's seconds
    c = roofline("h200", "llama-3.1-8b")
    s = p.scores(obs_with(16, 2, alpha=0.5, match=16, context=512))
    d = 2
    t = c.forward_s(2, d + 1, 512) + c.draft_s("ngram", 2)
    assert s[ARMS.index("ngram-d2")] == pytest.approx(2 * (1 - 0.5 ** (d + 1)) / 0.5 / t, rel=1e-4)


def _smartspec_scores_one_arm_at_a_time(p: SmartSpecPolicy, obs: np.ndarray) -> np.ndarray:
    """The rule written arm by arm (as it was before it was priced in one call per drafter)."""
    from env.batch_cost import step_context
    from env.serve_env import CTX_NORM, DEPTH_NORM

    block = np.asarray(obs[9:], np.float64).reshape(p.max_batch, len(ROW_FEATURES))
    live = block[:, 0] > 0.5
    rows = max(int(live.sum()), 1)
    alpha = np.clip(block[live, 2], 0.0, 0.999)
    match = block[live, 4] * DEPTH_NORM
    ctx = float(step_context(p.cost_model, block[None, :, 1] * CTX_NORM, live[None])[0])
    out = np.zeros(len(p.arms))
    for k, (a, d) in enumerate(zip(p.arms, p.depths)):
        dd = np.minimum(d, match) if p.capped[k] else np.full(match.shape, d)
        tokens = np.where(dd > 0, (1 - alpha ** (dd + 1)) / (1 - alpha), 1.0).sum()
        t = float(p.cost_model.forward_s(rows, 1 + (dd.max() if dd.size else 0), ctx))
        if a.drafter is not None:
            t += float(p.cost_model.draft_s(a.drafter, rows, d))
        out[k] = tokens / t
    return out


@pytest.mark.parametrize("which", ["roofline", "fitted-with-a-head"])
def test_smartspec_prices_every_arm_in_one_call_per_drafter_as_it_did_one_arm_at_a_time(which):
    from env.batch_cost import BatchedDraft
    from tests.env.test_batch_cost import fitted

    arms = ["none", "ngram-d1", "ngram-d3", "ngram-d8", "eagle3-d1", "eagle3-d2", "eagle3-d5"]
    cost = (roofline("h200", "llama-3.1-8b") if which == "roofline" else
            fitted(batched={"eagle3": BatchedDraft((1, 4), (1e-3, 2e-3), (4e-3, 5e-3))}))  # fmt: skip
    p = SmartSpecPolicy(arms, obs_size(16), feature_names(16), cost=cost.to_json())
    rng = np.random.default_rng(0)
    for rows in [0, 1, 2, 5, 16] * 20:
        o = obs_with(16, rows, alpha=float(rng.uniform(0, 1)), match=float(rng.integers(0, 17)),
                     context=float(rng.uniform(16, 2000)))  # fmt: skip
        block = o[9:].reshape(16, len(ROW_FEATURES))
        block[:rows, 2] = rng.uniform(0, 1, rows)  # each row its own acceptance and match
        block[:rows, 4] = rng.integers(0, 17, rows) / 16
        want = _smartspec_scores_one_arm_at_a_time(p, o)
        got = p.scores(o)
        assert np.allclose(got, want, rtol=1e-12, atol=0) and int(np.argmax(got)) == int(np.argmax(want))


def test_smartspec_refuses_trees_and_non_cost_models():
    with pytest.raises(PolicyError, match="prices chains only"):
        smartspec(arms=["none", "ngram-d4-k2-b8"])
    with pytest.raises(PolicyError, match="batch cost model"):
        SmartSpecPolicy(ARMS, obs_size(4), cost={"format": "draftgym-cost-model"})
    bad = roofline("h200", "llama-3.1-8b").to_json()
    bad["acc"]["bytes_s"] = float("nan")
    with pytest.raises(PolicyError, match="SmartSpec"):
        SmartSpecPolicy(ARMS, obs_size(4), cost=bad)


# ---- save and load ---------------------------------------------------------------------------------------------------


def _trained_bucket(trace) -> BucketUCB:
    b = BucketUCB(ARMS, obs_size(4), feature_names(4), buckets=(1, 2, 4), c=0.3)
    sim = make_sim(trace)
    sim.reset()
    run_policy(sim, b, learn=True)
    assert b.counts.sum() > 0
    return b


def test_round_trips_through_load_policy(trace, tmp_path):
    rng = np.random.default_rng(0)
    obs = np.stack([obs_with(4, int(r), alpha=float(a), match=float(d))
                    for r, a, d in zip(rng.integers(1, 5, 60), rng.random(60), rng.integers(0, 17, 60))])  # fmt: skip
    policies = {
        "serve_table": BatchTablePolicy(
            ARMS, obs_size(4), feature_names(4), table=[[1, "ngram-d8"], [3, "ngram-d2"], [1 << 30, "none"]]
        ),  # fmt: skip
        "smartspec": smartspec(4),
        "bucket_ucb": _trained_bucket(trace),
    }
    for type_name, p in policies.items():
        p.meta = {"name": type_name}
        p.save(tmp_path / f"{type_name}.zip")
        back = load_policy(
            tmp_path / f"{type_name}.zip", arms=ARMS, obs_size=obs_size(4), features=feature_names(4)
        )
        assert type(back) is type(p) and back.type_name == type_name and back.kind == p.kind
        assert back.params() == p.params() and back.meta == {"name": type_name}
        assert [back.act(o) for o in obs] == [p.act(o) for o in obs]
    back = load_policy(tmp_path / "bucket_ucb.zip")
    assert np.array_equal(back.counts, policies["bucket_ucb"].counts)
    assert np.array_equal(back.sums, policies["bucket_ucb"].sums)
    assert len({p.act(o) for o in obs for p in [policies["smartspec"]]}) > 1  # the comparison is not trivial
    with pytest.raises(PolicyError, match="trained for arms"):
        load_policy(tmp_path / "serve_table.zip", arms=ARMS[:3])


def _with_state(src, dst, state: bytes):
    with zipfile.ZipFile(src) as z:
        header = json.loads(z.read("header.json"))
    header["payload"]["state.npz"] = hashlib.sha256(state).hexdigest()  # the checksum made to match
    return replace_members(src, dst, {"state.npz": state, "header.json": json.dumps(header).encode()})


def test_a_damaged_bucket_bandit_state_is_refused(trace, tmp_path):
    b = _trained_bucket(trace)
    b.save(tmp_path / "b.zip")
    neg = b.counts.copy()
    neg[0, 0] = -3
    marker = tmp_path / "RAN"
    for name, state, needle in [
        ("negative", npz_bytes(counts=neg, sums=b.sums), "negative or non-finite"),
        ("nan", npz_bytes(counts=b.counts, sums=b.sums * np.nan), "negative or non-finite"),
        ("shape", npz_bytes(counts=b.counts[:1], sums=b.sums[:1]), "wrong shape"),
        ("no-sums", npz_bytes(counts=b.counts), "cannot restore"),
        ("pickle", npz_payload(marker, counts=b.counts, sums=b.sums), "cannot restore"),
    ]:
        path = _with_state(tmp_path / "b.zip", tmp_path / f"{name}.zip", state)
        with pytest.raises(PolicyError, match=needle) as err:
            load_policy(path)
        assert "\n" not in str(err.value), name
    assert not marker.exists()
    # a changed state without its checksum is caught as corruption
    replace_members(
        tmp_path / "b.zip", tmp_path / "tampered.zip", {"state.npz": npz_bytes(counts=neg, sums=b.sums)}
    )
    with pytest.raises(PolicyError, match="does not match its checksum"):
        load_policy(tmp_path / "tampered.zip")
    # the same state, unchanged, still loads
    assert load_policy(
        _with_state(tmp_path / "b.zip", tmp_path / "ok.zip", npz_bytes(counts=b.counts, sums=b.sums))
    )


def test_bucket_ucb_tries_every_arm_then_exploits():
    b = BucketUCB(ARMS, obs_size(4), buckets=(1, 4), c=0.0)
    o1, o4 = obs_with(4, 1), obs_with(4, 3)
    assert [b.bucket(o1), b.bucket(o4), b.bucket(obs_with(4, 4))] == [0, 1, 1]
    tried = []
    for _ in range(len(ARMS)):
        a = b.act(o1)
        tried.append(a)
        b.update(o1, a, 2.0 if a == 3 else 1.0)
    assert sorted(tried) == list(range(len(ARMS)))  # one pull each, in order
    assert b.act(o1) == 3 and b.act(o4) == 0  # bucket 1 has learned nothing yet
    with pytest.raises(PolicyError, match="bucket bounds must be positive row counts"):
        BucketUCB(ARMS, obs_size(4), buckets=(0, 2))
    with pytest.raises(PolicyError, match="exploration constant must be >= 0, got -1"):
        BucketUCB(ARMS, obs_size(4), c=-1)


def test_bucket_ucb_explores_an_arm_pulled_less_by_its_confidence_bonus():
    """UCB1: mean + c * sqrt(ln N / n). Arm 0 pulled once at 0.8, every other arm 100 times at 0.9 (arm 2 at
    0.95): with c = 0.5 arm 0's bonus (0.5 * sqrt(ln 501 / 1) = 1.25) beats the others' (0.125), so it is tried
    again; with c = 0 the best mean wins."""
    o = obs_with(4, 2)
    for c, want in [(0.5, 0), (0.0, 2)]:
        b = BucketUCB(ARMS, obs_size(4), buckets=(4,), c=c)
        b.update(o, 0, 0.8)
        for a in range(1, len(ARMS)):
            for _ in range(100):
                b.update(o, a, 0.95 if a == 2 else 0.9)
        assert b.act(o) == want, c


# ---- running in replay ------------------------------------------------------------------------------------------------


def test_run_policy_gives_finite_positive_goodputs(trace):
    m = 4
    policies = [trt_auto(ARMS, obs_size(m), feature_names(m)), smartspec(m),
                BucketUCB(ARMS, obs_size(m), feature_names(m))]  # fmt: skip
    for p in policies:
        sim = make_sim(trace)
        sim.reset()
        g = run_policy(sim, p, learn=isinstance(p, BucketUCB))
        assert g.shape == (4,) and np.isfinite(g).all() and (g > 0).all() and sim.done().all()
    assert policies[2].counts.sum() > 0
    sim = make_sim(trace)
    sim.reset()
    g_oracle = run_policy(sim, None, oracle=True)
    assert np.isfinite(g_oracle).all() and (g_oracle > 0).all()


def test_static_goodputs_use_the_same_streams(trace):
    def make(n, loads, seed):
        return make_sim(trace, n, loads=loads, seed=seed)

    g = static_goodputs(make, ARMS, ["1", "4"], episodes=3, seed=1)
    assert set(g) == {"1", "4"} and all(set(v) == set(ARMS) for v in g.values())
    assert all(x > 0 and np.isfinite(x) for v in g.values() for x in v.values())
    assert g["1"]["ngram-d5"] > g["1"]["none"]  # drafts pay at one row on the repetitive trace
    assert g["4"]["none"] > g["1"]["none"]  # batching pays without drafts


def test_a_few_hundred_ppo_steps_give_a_loadable_policy(trace, tmp_path):
    from env.serve_env import make_sb3_serve_env

    def make_vec():
        return make_sb3_serve_env(4, trace=trace, cost=COST, max_batch=4, loads=["1", "4"], requests=4,
                                  reward="time_saved", seed=0)  # fmt: skip

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*mini-batch size.*")
        p, _ = train_serve_ppo(make_vec, ARMS, obs_size(4), feature_names(4), timesteps=256, seed=0)
    assert p.kind == "rl" and p.arm_names == tuple(ARMS)
    sim = make_sim(trace)
    sim.reset()
    g = run_policy(sim, p)
    assert np.isfinite(g).all() and (g > 0).all()
    p.save(tmp_path / "ppo.zip")
    back = load_policy(tmp_path / "ppo.zip", arms=ARMS, obs_size=obs_size(4))
    obs = np.stack([obs_with(4, r, alpha=a) for r in (1, 2, 3, 4) for a in (0.0, 0.5, 1.0)])
    assert np.array_equal(back.act_batch(obs), p.act_batch(obs))


def test_ppo_killed_midway_resumes_from_its_checkpoint(trace, tmp_path):
    """A kill after three checkpoints: the rerun steps only the rest (counted on the env) and makes exactly the
    updates an uninterrupted run makes (a checkpoint is written after its rollout's update, not before it); its
    learning curve and training seconds carry on, and the checkpoints kept are the last two."""
    from stable_baselines3.common.vec_env import VecEnvWrapper

    from env.serve_env import make_sb3_serve_env

    steps = [0]

    class Counted(VecEnvWrapper):
        def reset(self):
            return self.venv.reset()

        def step_wait(self):
            out = self.venv.step_wait()
            steps[0] += self.num_envs
            return out

    def make_vec():
        return Counted(make_sb3_serve_env(4, trace=trace, cost=COST, max_batch=4, loads=["1", "4"], requests=4,
                                          seed=0))  # fmt: skip

    calls = [0]

    def make_eval(kill_at=None):
        calls[0] += 1
        if calls[0] == kill_at:
            raise KeyboardInterrupt
        sim = make_sim(trace)
        sim.reset()
        return sim

    kw = dict(timesteps=1280, seed=0, eval_every=256, checkpoint_every=256)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*mini-batch size.*")
        whole, _ = train_serve_ppo(make_vec, ARMS, obs_size(4), feature_names(4), make_eval=make_eval, **kw,
                                   checkpoints=tmp_path / "whole")  # fmt: skip
        ckpt = tmp_path / "ckpt"
        kw["checkpoints"] = ckpt
        steps[0] = calls[0] = 0
        with pytest.raises(KeyboardInterrupt):  # the 4th evaluation (rollout 4's end) dies before its update
            train_serve_ppo(
                make_vec, ARMS, obs_size(4), feature_names(4), make_eval=lambda: make_eval(4), **kw
            )
        assert steps[0] == 1024
        assert sorted(p.name for p in ckpt.glob("*.zip")) == ["model_512_steps.zip", "model_768_steps.zip"]
        saved = json.loads((ckpt / "curve.json").read_text())
        assert saved["timesteps"] == 768 and [c["timesteps"] for c in saved["curve"]] == [256, 512, 768]
        steps[0] = 0
        p, curve = train_serve_ppo(make_vec, ARMS, obs_size(4), feature_names(4), make_eval=make_eval, **kw)
    assert steps[0] == 1280 - 768  # resumed, not started again
    assert p.model.num_timesteps == 1280 and p.model._n_updates == whole.model._n_updates
    assert curve[:3] == saved["curve"]
    assert [c["timesteps"] for c in curve] == [256, 512, 768, 1024, 1280]
    assert all(a["seconds"] <= b["seconds"] for a, b in zip(curve, curve[1:]))
    assert p.train_wall_s >= saved["wall_s"] > 0
    assert {p.name for p in ckpt.glob("*.zip")} == {"model_768_steps.zip", "model_1024_steps.zip"}


def test_an_online_policy_serves_every_replayed_stream_as_it_serves_one_live(trace):
    """``online``: each server gets a copy of the bandit as given, learning from that server's steps only (as a
    fresh copy serves one live stream); the bandit itself is left as it was, and server 0 of a vectorized run
    equals the same stream run alone."""
    import copy

    m = 4
    bandit = BucketUCB(ARMS, obs_size(m), feature_names(m))
    before = copy.deepcopy(bandit.counts)
    sim = make_sim(trace, num_envs=3, loads=("4",))
    sim.reset()
    g = run_policy(sim, bandit, online=True)
    assert np.array_equal(bandit.counts, before)  # the copies learned, not the policy given
    frozen = make_sim(trace, num_envs=3, loads=("4",))
    frozen.reset()
    assert not np.allclose(run_policy(frozen, bandit), g)  # learning changed the choices
    # one copy per server: server 0's result does not depend on the other servers' steps
    alone = make_sim(trace, num_envs=1, loads=("4",))
    alone.reset()
    assert run_policy(alone, bandit, online=True)[0] == pytest.approx(g[0])
