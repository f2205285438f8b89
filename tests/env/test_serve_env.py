"""``draftgym/SpecServe-v0`` (``env.serve_env``) on a synthetic trace priced by the H200 roofline model: the API
contract (Gymnasium's and stable-baselines3's checkers, registration, the vector env), greedy replay (every arm
commits the same tokens), a mixed batch's price, the rewards' known values, row and batch actions, invalid actions,
autoreset, the myopic oracle, the observation's packing and determinism for a seed (the loads: test_serve_loads)."""

from __future__ import annotations

import dataclasses
import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

import env  # noqa: F401  (registers draftgym/SpecServe-v0)
from env.batch_cost import load_batch_cost, step_context
from env.serve_env import (
    CTX_NORM,
    DEFAULT_ARMS,
    ROW_FEATURES,
    SERVE_ID,
    ServeEnvError,
    ServeSim,
    SpecServeEnv,
    SpecServeVectorEnv,
    alpha_estimate,
    feature_names,
    make_sb3_serve_env,
    obs_size,
    serve_observation,
)
from tests.env.conftest import SERVE_ROWS as M
from tests.env.conftest import serve_kw as kw


@pytest.fixture(scope="module")
def trace(serve_trace):
    return serve_trace


def run_const(sim: ServeSim, k: int) -> None:
    while not sim.done().all():
        sim.step(np.full(sim.num_envs, k))


# ---- API contract -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("action", ["batch", "row"])
def test_gymnasium_and_sb3_checkers_pass(trace, action):
    from gymnasium.utils.env_checker import check_env as gym_check
    from stable_baselines3.common.env_checker import check_env as sb3_check

    e = SpecServeEnv(action=action, **kw(trace))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gym_check(e, skip_render_check=True)
        sb3_check(e, warn=True)
    assert [str(w.message) for w in caught] == []
    assert e.observation_space.shape == (obs_size(M),) and len(e.feature_names) == obs_size(M)
    if action == "batch":
        assert e.action_space == gym.spaces.Discrete(len(DEFAULT_ARMS))
    else:
        assert e.action_space == gym.spaces.MultiDiscrete([len(DEFAULT_ARMS)] * M)


def test_registered_env_runs_an_episode_through_the_wrappers(trace):
    e = gym.make(SERVE_ID, **kw(trace))
    assert e.spec.id == SERVE_ID and isinstance(e.unwrapped, SpecServeEnv)
    obs, info = e.reset(seed=1)
    assert e.observation_space.contains(obs) and info["row_mask"].sum() >= 1
    e.action_space.seed(1)
    for _ in range(2000):
        obs, r, term, trunc, info = e.step(e.action_space.sample())
        assert e.observation_space.contains(obs) and np.isfinite(r) and not trunc
        if term:
            break
    assert term and info["goodput"] > 0


def test_make_vec_uses_the_vector_entry_point(trace):
    v = gym.make_vec(SERVE_ID, num_envs=4, vectorization_mode="vector_entry_point", **kw(trace))
    assert isinstance(v.unwrapped, SpecServeVectorEnv) and v.num_envs == 4
    obs, _ = v.reset(seed=0)
    assert obs.shape == (4, obs_size(M)) and v.single_observation_space.contains(obs[0])
    obs, r, term, trunc, info = v.step(np.zeros(4, np.int64))
    assert obs.shape == (4, obs_size(M)) and r.shape == term.shape == trunc.shape == (4,)
    assert np.all(r == 1.0) and info["tokens"].shape == (4,)  # arm 0 is "none"


def test_bad_arguments_are_serve_env_errors(trace):
    for over, needle in [
        ({"reward": "speed"}, "unknown reward 'speed'"),
        ({"arms": ["none", "nosuch-d3"]}, "unknown drafter 'nosuch'"),
        ({"arms": []}, "menu is empty"),
        ({"arms": ["none", "suffix-d3"]}, "no recorded trees for suffix"),
        ({"loads": []}, "load list is empty"),
        ({"loads": ["9"]}, r"concurrency must be in 1\.\.4"),
        ({"loads": ["poisson@-1"]}, "a multiple of the unit rate in 0.01..1000"),
        ({"loads": ["heavy"]}, "unknown load 'heavy'"),
        ({"prompt_ids": ["p0", "zz"]}, "not in the trace: zz"),
        ({"max_batch": 0}, r"max_batch must be an integer in \[1, 4096\], got 0"),
        ({"max_new_tokens": 400}, "max_new_tokens must be in 2..40"),
        # not integers, or sizes no machine holds: named, not a numpy error deep in the simulator
        ({"max_batch": "16"}, r"max_batch must be an integer in \[1, 4096\], got '16'"),
        ({"max_batch": 1.5}, "max_batch must be an integer"),
        ({"requests": float("nan")}, "requests must be an integer"),
        ({"max_new_tokens": float("nan")}, "max_new_tokens must be an integer >= 2"),
        ({"requests": 10**12}, "requests must be an integer in"),
        ({"seed": -1}, "seed must be a non-negative integer"),
        ({"seed": float("nan")}, "seed must be a non-negative integer"),
        ({"arms": ["none", "ngram-d2", "ngram-d2"]}, r"lists \['ngram-d2'\] more than once"),
    ]:
        with pytest.raises(ServeEnvError, match=needle):
            SpecServeEnv(**kw(trace, **over))
    with pytest.raises(ServeEnvError, match="unknown action mode 'slot'"):
        SpecServeEnv(action="slot", **kw(trace))
    with pytest.raises(ServeEnvError, match="4096 servers x 8192 requests: at most 16777216 in all"):
        ServeSim(4096, **kw(trace, requests=8192))


# ---- greedy replay: only time differs between arms ----------------------------------------------------------------


@pytest.mark.parametrize("load", ["2", "ramp", "bursty", "poisson@3"])
def test_every_static_arm_commits_the_recorded_tokens(trace, load):
    max_new = 20
    lengths = np.minimum(np.diff(trace.traj_off), max_new)  # each trajectory cut at max_new_tokens
    runs = {}
    for k in range(len(DEFAULT_ARMS)):
        sim = ServeSim(3, **kw(trace, loads=[load], requests=8, max_new_tokens=max_new, seed=11))
        sim.reset()
        run_const(sim, k)
        runs[k] = sim
    first = runs[0]
    want = np.array([lengths[first.req_prompt[i, : first.n_req[i]]].sum() for i in range(3)])
    for k, sim in runs.items():
        assert np.array_equal(sim.req_prompt, first.req_prompt)  # the same request streams
        assert np.array_equal(sim.finished, sim.n_req)
        # the prefill's first token plus every step's: the whole trajectory, whatever the arm
        assert np.array_equal(sim.tokens_total, want), DEFAULT_ARMS[k]
    deep = runs[len(DEFAULT_ARMS) - 1]
    assert deep.steps.sum() < first.steps.sum()  # fewer steps, and less simulated time, with drafts
    assert (deep.clock < first.clock).all()
    assert np.allclose(first.goodput(), first.tokens_total / first.clock)


# ---- pricing ------------------------------------------------------------------------------------------------------


def test_a_mixed_batch_is_priced_as_a_chain_as_deep_as_its_deepest_row(trace):
    """Our engine pads every row's tree to the batch's widest: one row drafting deep and three not cost the forward
    of four rows of that depth (not of their mean)."""
    sim = ServeSim(1, **kw(trace, loads=[str(M)], seed=0))
    sim.reset()
    deep = np.array([[len(DEFAULT_ARMS) - 1] + [0] * (M - 1)])  # the deepest n-gram arm at row 0, none beside
    for _ in range(40):
        o = sim.outcome(deep)
        if int(o["rows"][0]) == M and int(o["dr"][0, 0]) > 1:
            break
        sim.step(deep)
    assert int(o["rows"][0]) == M and o["dr"][0, 1:].sum() == 0 and int(o["dr"][0, 0]) > 1
    nodes = int(o["dr"][0, 0]) + 1
    ctx = step_context(sim.cost, sim.prompt_len[sim.prompt] + sim.pos, sim.active)
    assert int(o["nodes"][0]) == nodes
    assert o["forward"][0] == pytest.approx(float(np.asarray(sim.cost.forward_s(M, nodes, ctx)).ravel()[0]))


# ---- rewards ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reward, want", [("goodput_ratio", 1.0), ("time_saved", 0.0)])
def test_plain_decoding_has_the_reward_of_autoregressive_decoding(trace, reward, want):
    e = SpecServeEnv(reward=reward, **kw(trace))
    for seed in range(3):
        e.reset(seed=seed)
        term, n = False, 0
        while not term:
            _, r, term, _, info = e.step(0)
            assert r == want and info["cost_s"] == info["ar_cost_s"]
            n += 1
        assert n > 1


def test_rewards_follow_their_formulas(trace):
    e = SpecServeEnv(**kw(trace))
    f = SpecServeEnv(reward="time_saved", **kw(trace))
    e.reset(seed=5)
    f.reset(seed=5)
    term, ratios = False, []
    rng = np.random.default_rng(1)
    while not term:
        k = int(rng.integers(len(DEFAULT_ARMS)))
        _, r, term, _, info = e.step(k)
        _, s, _, _, info2 = f.step(k)
        t, rows, c, ar = info["tokens"], info["rows"], info["cost_s"], info["ar_cost_s"]
        assert r == pytest.approx(t * ar / (rows * c), rel=1e-6)
        assert s == pytest.approx(t / rows - c / ar, rel=1e-5, abs=1e-6)
        assert info2["tokens"] == t and info2["cost_s"] == c
        ratios.append(r)
    assert max(ratios) > 1.5  # drafts on the repetitive trace pay at this batch


def test_row_actions_all_k_equal_the_batch_action_k(trace):
    b = SpecServeEnv(action="batch", **kw(trace))
    r = SpecServeEnv(action="row", **kw(trace))
    for seed in range(3):
        ob, _ = b.reset(seed=seed)
        orow, _ = r.reset(seed=seed)
        assert np.array_equal(ob, orow)
        ks = np.random.default_rng(seed).integers(0, len(DEFAULT_ARMS), 10_000)
        for k in ks:
            ob, rb, tb, _, ib = b.step(int(k))
            orow, rr, tr, _, ir = r.step(np.full(M, k))
            assert np.array_equal(ob, orow) and rb == rr and tb == tr
            assert {x: ib[x] for x in ("tokens", "rows", "cost_s", "clock_s")} == {
                x: ir[x] for x in ("tokens", "rows", "cost_s", "clock_s")}  # fmt: skip
            if tb:
                assert ib["goodput"] == ir["goodput"]
                break


def test_row_actions_are_in_the_observations_order(trace):
    sim = ServeSim(1, **kw(trace, loads=["4"]))
    sim.reset()
    sim.active[0] = [False, True, False, True]  # rows in slots 1 and 3: the observation lists them first
    slots = sim._actions(np.array([[2, 5, 0, 0]]))
    assert slots[0, 1] == 2 and slots[0, 3] == 5


def test_rows_leave_and_enter_in_the_live_engines_order(trace):
    """The simulator's slots follow ``env.batch.BatchTarget.retire`` (the last slots leave first, each hole taken
    by the batch's last row) and admission (new rows at the end), so a per-row policy sees rows in the order the
    live engine keeps them: checked against a list replaying those two rules."""
    sim = ServeSim(6, **kw(trace, loads=["3", "4", "ramp", "bursty"], requests=12, seed=7))
    sim.reset()
    live = [[int(sim.req_prompt[i, q]) for q in range(sim.ptr[i])] for i in range(6)]
    rng = np.random.default_rng(3)
    moved = 0
    while not sim.done().all():
        ptr = sim.ptr.copy()
        _, o = sim.step(rng.integers(0, len(DEFAULT_ARMS), size=(6, M)))
        for i in range(6):
            for j in sorted(np.flatnonzero(o["end"][i]), reverse=True):  # the live loop: last slots first
                last = live[i].pop()
                if j < len(live[i]):
                    live[i][j] = last
                    moved += 1
            live[i] += [int(sim.req_prompt[i, q]) for q in range(ptr[i], sim.ptr[i])]
            rows = int(sim.active[i].sum())
            assert sim.active[i, :rows].all() and not sim.active[i, rows:].any()  # packed
            assert sim.prompt[i, :rows].tolist() == live[i]
    assert moved > 0  # some rows did move into a hole


def test_the_observation_after_a_same_step_reset_is_a_whole_one(trace):
    v = SpecServeVectorEnv(5, autoreset_mode=AutoresetMode.SAME_STEP, **kw(trace, requests=3))
    v.reset(seed=1)
    rng = np.random.default_rng(0)
    resets = 0
    for _ in range(300):
        obs, _, term, _, _ = v.step(rng.integers(0, len(DEFAULT_ARMS), size=5))
        resets += int(term.sum())
        assert np.array_equal(obs, v.sim.observe())  # only the reset servers were recomputed: the same
    assert resets > 0


# ---- invalid actions ----------------------------------------------------------------------------------------------


def test_invalid_actions_are_refused(trace):
    k = len(DEFAULT_ARMS)
    b = SpecServeEnv(**kw(trace, loads=["1"]))
    b.reset(seed=0)
    for bad, needle in [(k, f"action {k} is not a valid arm"), (-1, "action -1"), (2.5, "integer arm indices"),
                        ("1", "integer arm indices"), (None, "integer arm indices"), (np.nan, "integer arm indices"),
                        (np.array([0, 1]), "one arm index"), (np.zeros((1, 1)), "one arm index")]:  # fmt: skip
        with pytest.raises(ServeEnvError, match=needle):
            b.step(bad)
    b.step(np.int64(1))
    b.step(2.0)  # a whole float is an index
    r = SpecServeEnv(action="row", **kw(trace, loads=["1"]))
    r.reset(seed=0)
    for bad, needle in [(np.zeros(M - 1, np.int64), r"shape \(4,\)"), (np.full(M, k), f"action {k}"),
                        (np.full(M, 0.5), "integer")]:  # fmt: skip
        with pytest.raises(ServeEnvError, match=needle):
            r.step(bad)
    _, _, _, _, info = r.step(np.array([1, 99, -7, 99]))  # one row (load 1): the other slots are ignored
    assert info["rows"] == 1
    while True:
        *_, term, _, _ = b.step(0)
        if term:
            break
    with pytest.raises(ServeEnvError, match="call reset"):
        b.step(0)


# ---- the vector env -----------------------------------------------------------------------------------------------


def test_same_step_autoreset_gives_the_final_observation(trace):
    v = SpecServeVectorEnv(
        4, autoreset_mode=AutoresetMode.SAME_STEP, **kw(trace, loads=["1", "2"], requests=2)
    )
    v.reset(seed=0)
    seen = 0
    for _ in range(500):
        obs, r, term, trunc, info = v.step(np.full(4, 3))
        assert not trunc.any()
        if term.any():
            assert np.array_equal(info["_final_obs"], term)
            fin = info["final_obs"][term]
            assert (fin[:, 0] == 0).all()  # the final observation: every request finished, no row left
            assert (obs[term][:, 0] > 0).all()  # while the returned one starts the next episode
            assert (info["goodput"][term] > 0).all() and np.isnan(info["goodput"][~term]).all()
            seen += int(term.sum())
        if seen >= 8:
            break
    assert seen >= 8


def test_autoreset_mode_by_its_documented_name(trace):
    v = SpecServeVectorEnv(2, autoreset_mode="same_step", **kw(trace))
    assert v.metadata["autoreset_mode"] == AutoresetMode.SAME_STEP


def test_next_step_autoreset(trace):
    v = SpecServeVectorEnv(3, **kw(trace, loads=["2"], requests=2))
    v.reset(seed=0)
    ended = np.zeros(3, bool)
    for _ in range(500):
        obs, r, term, _, _ = v.step(np.full(3, 4))
        assert not (term & ended).any()  # the step after an end resets: not terminated again
        assert (r[ended] == 0).all()
        assert (obs[ended][:, 0] > 0).all()  # a fresh episode's first rows
        if ended.any():
            break
        ended = term.copy()
    assert ended.any()


def test_the_vector_replay_is_deterministic_for_a_seed(trace):
    def rollout(seed):
        v = SpecServeVectorEnv(4, action="row", **kw(trace))
        obs, _ = v.reset(seed=seed)
        rng = np.random.default_rng(0)
        out = [obs]
        for _ in range(60):
            obs, r, term, _, info = v.step(rng.integers(0, len(DEFAULT_ARMS), (4, M)))
            out += [obs, r, term, info["cost_s"]]
        return out, v.sim.req_prompt.copy()

    a, pa = rollout(7)
    b, pb = rollout(7)
    c, pc = rollout(8)
    assert all(np.array_equal(x, y) for x, y in zip(a, b)) and np.array_equal(pa, pb)
    assert not np.array_equal(pa, pc)


def test_the_sb3_vec_env_reports_terminal_observations(trace):
    venv = make_sb3_serve_env(3, **kw(trace, loads=["1"], requests=2))
    venv.seed(0)
    obs = venv.reset()
    assert obs.shape == (3, obs_size(M))
    for _ in range(500):
        venv.step_async(np.full(3, 2))
        obs, r, done, infos = venv.step_wait()
        if done.any():
            i = int(np.flatnonzero(done)[0])
            assert infos[i]["terminal_observation"][0] == 0 and infos[i]["goodput"] > 0
            assert infos[i]["TimeLimit.truncated"] is False
            break
    assert done.any()


# ---- the myopic oracle and the observation ---------------------------------------------------------------------------


@pytest.mark.parametrize("draft_s", [None, 4e-3])
def test_myopic_best_commits_the_most_tokens_per_second(trace, draft_s):
    """Priced in full: with n-gram proposals as dear as a forward (4 ms a row), the best arm is not the one whose
    forward alone commits the most tokens per second."""
    cost = load_batch_cost(kw(trace)["cost"])
    if draft_s is not None:
        cost = dataclasses.replace(cost, draft_per_row_s={"ngram": draft_s})
    sim = ServeSim(6, **kw(trace, seed=9, cost=cost))
    sim.reset()
    rng = np.random.default_rng(2)
    checked = differ = 0
    while not sim.done().all():
        best = sim.myopic_best()
        o = sim.outcome(np.broadcast_to(best[:, None], (6, M)))
        rate = o["tokens"] / o["cost"]
        live = ~sim.done()
        by_forward = np.zeros(6)
        for k in range(len(DEFAULT_ARMS)):
            ok = sim.outcome(np.full((6, M), k))
            assert (rate[live] >= (ok["tokens"] / ok["cost"])[live] * (1 - 1e-12)).all()
            by_forward = np.maximum(by_forward, ok["tokens"] / ok["forward"])
        differ += int((o["tokens"] / o["forward"] < by_forward * (1 - 1e-12))[live].sum())
        checked += 1
        sim.step(rng.integers(0, len(DEFAULT_ARMS), 6))
    assert checked > 5
    if draft_s is not None:  # the case tells the two apart: the forward-only best is not the oracle's
        assert differ > 0


def test_serve_observation_packs_active_rows_first():
    active = np.array([[False, True, False, True], [True, True, False, False]])
    context = np.array([[900, 100, 800, 300], [50, 60, 70, 80]])
    s = np.array([[9.0, 1.0, 9.0, 3.0], [0.0, 2.0, 5.0, 5.0]])
    n = np.array([[9.0, 2.0, 9.0, 3.0], [2.0, 2.0, 5.0, 5.0]])
    last = np.array([[8, 2, 8, 4], [0, 1, 3, 3]])
    match = np.array([[16, 0, 16, 8], [4, 0, 9, 9]])
    prog = np.array([[0.9, 0.1, 0.9, 0.5], [0.2, 0.4, 0.8, 0.8]])
    obs = serve_observation(active, context, s, n, last, match, prog, np.array([2, 0]), 4)
    assert obs.shape == (2, obs_size(4)) and len(feature_names(4)) == obs_size(4)
    block = obs[:, 9:].reshape(2, 4, len(ROW_FEATURES))
    # server 0: slots 1 and 3 listed first, in slot order, then zeros
    assert block[0, :, 0].tolist() == [1, 1, 0, 0]
    assert np.allclose(block[0, :2, 1], np.array([100, 300]) / CTX_NORM)
    assert np.allclose(block[0, :2, 2], [alpha_estimate(1, 2), alpha_estimate(3, 3)])
    assert np.allclose(block[0, :2, 3], [2 / 8, 4 / 8]) and np.allclose(block[0, :2, 4], [0, 8 / 16])
    assert np.allclose(block[0, :2, 5], [0.1, 0.5]) and (block[0, 2:] == 0).all()
    assert obs[0, 0] == 2 / 4 and obs[0, 1] == 2 / 4 and obs[0, 4] == 1 / 4  # rows, queue, rows with a match
    assert obs[0, 3] == pytest.approx(300 / CTX_NORM)  # the longest active context, not the idle slots'
    assert obs[0, 2] == pytest.approx((100 + 300) / CTX_NORM / 4)  # tokens in flight, per slot of the batch
    assert obs[0, 5] == pytest.approx((alpha_estimate(1, 2) + alpha_estimate(3, 3)) / 2)
    # server 1: already packed
    assert block[1, :, 0].tolist() == [1, 1, 0, 0] and np.allclose(
        block[1, :2, 1], np.array([50, 60]) / CTX_NORM
    )
    # a sim's observation lists its active rows first too
    sim_obs = serve_observation(active[:1], context[:1], s[:1], n[:1], last[:1], match[:1], prog[:1], [0], 6)
    assert sim_obs.shape == (1, obs_size(6)) and sim_obs[0, 9::6].tolist() == [1, 1, 0, 0, 0, 0]


# ---- the shipped defaults ------------------------------------------------------------------------------------------


def test_default_env_uses_the_bundled_trace_and_the_shipped_cost_model():
    from env.batch_cost import FittedBatchCost, load_batch_cost

    e = gym.make(SERVE_ID)
    obs, info = e.reset(seed=0)
    assert obs.shape == (obs_size(16),) and e.unwrapped.arm_names == list(DEFAULT_ARMS)
    assert e.unwrapped.sim.trace.num_prompts == 60  # 10 Spec-Bench prompts per category
    cost = load_batch_cost(None)
    assert isinstance(cost, FittedBatchCost) and cost.model_id == "smollm2-135m-instruct"
    assert "machine" in cost.meta and cost.meta["command"].startswith("draftgym calibrate --batch")
    _, reward, *_ = e.step(0)
    assert reward == pytest.approx(1.0)  # plain decoding is the unit


def test_shipped_serving_policies_load_for_the_default_env():
    from experiments.serve_policies import shipped_serve_policies
    from policies.base import load_policy

    paths = shipped_serve_policies()
    names = {p.stem for p in paths}
    assert {"fitted-table", "trt-auto", "smartspec", "turbospec", "bucket-ucb", "linucb", "ppo"} <= names
    obs = gym.make(SERVE_ID).reset(seed=1)[0]
    for p in paths:
        pol = load_policy(p)
        assert list(pol.arm_names) == list(DEFAULT_ARMS) and pol.obs_size == obs_size(16)
        assert tuple(pol.features) == tuple(feature_names(16))
        a = np.asarray(pol.act(obs))  # one arm for the batch, or one per row slot (ppo-rows)
        assert a.shape in ((), (16,)) and ((a >= 0) & (a < len(DEFAULT_ARMS))).all()
        assert pol.meta["split"]["test"] and not set(pol.meta["split"]["test"]) & set(
            pol.meta["split"]["train"]
        )


def test_a_fitted_cost_model_prices_a_ragged_batch_at_its_longest_row(trace):
    """The shipped cost model was measured on our engine, whose ragged rows attend over the longest row's span:
    the replay prices every step at the longest active context (a roofline model: the mean)."""
    from env.batch_cost import load_batch_cost

    cost = load_batch_cost(None)
    sim = ServeSim(3, **kw(trace, cost=cost, loads=["3", "ramp"], requests=6, seed=1))
    sim.reset()
    for _ in range(30):
        ctx = sim.prompt_len[sim.prompt] + sim.pos
        longest = np.where(sim.active, ctx, 0).max(1)
        rows = sim.active.sum(1)
        _, o = sim.step(np.zeros(3, np.int64))  # plain decoding: no drafting cost
        live = rows > 0
        want = cost.forward_s(rows[live], 1, longest[live])
        assert np.allclose(o["cost"][live], want, rtol=1e-12)


def test_actions_of_any_integer_dtype_step_alike(trace):
    runs = []
    for dtype in (np.int8, np.uint8, np.int16, np.int64):
        sim = ServeSim(2, **kw(trace, loads=["3"], seed=5))
        sim.reset()
        rewards = [sim.step(np.full(2, 4, dtype))[0] for _ in range(20)]
        runs.append(np.concatenate(rewards))
    assert all(np.array_equal(runs[0], r) for r in runs[1:])
