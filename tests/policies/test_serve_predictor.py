"""The serving accept-length predictor (``policies.serve_predictor``): its regressor learns what every arm gets
accepted at a row from the row's features (a shuffled labelling does not), its shrink table is chosen per load
from the documented factors, it prices arms as SmartSpec does, and its file round-trips and refuses damage."""

from __future__ import annotations

import numpy as np
import pytest

from env.roofline import roofline
from env.serve_env import DEFAULT_ARMS, ServeSim, feature_names, obs_size
from policies.base import PolicyError, load_policy
from policies.serve_predictor import (
    SHRINKS,
    ServePredictorPolicy,
    collect,
    predictor_ticks,
    row_inputs,
    train_serve_predictor,
)
from policies.serving import SmartSpecPolicy
from tests.env.conftest import make_trace

ARMS = list(DEFAULT_ARMS)  # none, ngram-d1, d2, d3, d5, d8
COST = roofline("h200", "llama-3.1-8b").to_json()
M = 4


@pytest.fixture(scope="module")
def trace():
    return make_trace(seed=0, prompts=8, max_new=40)


def make_for(trace):
    def factory(prompts):
        def make(n, loads, seed=0):
            return ServeSim(n, trace=trace, cost="roofline:h200/llama-3.1-8b", max_batch=M, arms=ARMS,
                            loads=list(loads), requests=6, seed=seed, prompt_ids=list(prompts))  # fmt: skip

        return make

    return factory


@pytest.fixture(scope="module")
def trained(trace):
    return train_serve_predictor(make_for(trace), list(trace.prompt_ids), ARMS, obs_size(M), feature_names(M), COST,
                                 loads=["1", "4", "ramp"], levels=[1, 2, 4], episodes=4, max_iter=80)  # fmt: skip


def _mse(policy, x, y):
    return float(((policy.forward(x) - y) ** 2).mean())


def test_the_regressor_learns_accepted_tokens_from_the_rows(trace, trained):
    """On rows it did not fit (other streams), it predicts every arm's accepted tokens much better than their
    mean; fitted on the same rows with the labels shuffled among them, it does not."""
    rng = np.random.default_rng(5)
    make = make_for(trace)(list(trace.prompt_ids))
    smart = SmartSpecPolicy(ARMS, obs_size(M), feature_names(M), cost=COST)
    x, y = collect(make, smart, ["1", "4"], 4, 0.3, rng, seed=1234)
    assert x.shape[1] == 4 and y.shape == (len(x), len(ARMS)) and len(x) > 200
    base = float(((y - y.mean(0)) ** 2).mean())
    assert _mse(trained, x, y) < 0.75 * base  # 0.60 when written
    assert np.allclose(trained.forward(x)[:, 0], 0.0, atol=0.05)  # "none" drafts nothing
    shuffled = ServePredictorPolicy(ARMS, obs_size(M), feature_names(M), cost=COST, max_iter=80)
    xt, yt = collect(make, smart, ["1", "4"], 4, 0.3, rng, seed=99)
    shuffled.fit_net(xt, yt[rng.permutation(len(yt))], model="mlp", hidden=64, layers=2, alpha=1e-4,
                     max_iter=80, seed=0)  # fmt: skip
    assert _mse(shuffled, x, y) > 0.9 * base  # 0.99 when written


def test_the_shrink_table_is_chosen_per_level_from_the_factors(trace, trained, monkeypatch):
    """Each level takes the factor whose replay on the held-out half served the most (ties: the smaller);
    adjacent levels of one factor merge."""
    import policies.serve_predictor as sp

    assert all(f in SHRINKS for _, f in trained.shrink)
    seen = []

    def replay(sim, policy):  # 0.3 serves most at two rows, 0.5 as much as 0.15 at four, all alike at one
        level, f = sim.load_name[0], policy.factor(1)
        seen.append((level, f))
        best = {"2": 0.3, "4": 0.15}.get(level)
        return np.array([2.0 if f == best or (level == "4" and f == 0.5) else 1.0])

    monkeypatch.setattr(sp, "run_policy", replay)
    got = train_serve_predictor(make_for(trace), list(trace.prompt_ids), ARMS, obs_size(M), feature_names(M), COST,
                                loads=["1"], levels=[1, 2, 4], episodes=2, rounds=1, max_iter=20)  # fmt: skip
    assert sorted(seen) == sorted((str(c), f) for c in (1, 2, 4) for f in SHRINKS)
    assert got.shrink == [[1, 0.0], [2, 0.3], [1 << 30, 0.15]]
    assert got.factor(1) == 0.0 and got.factor(2) == 0.3 and got.factor(3) == 0.15 and got.factor(99) == 0.15
    short = ServePredictorPolicy(ARMS, obs_size(M), feature_names(M), cost=COST, shrink=[[2, 0.1]])
    assert short.factor(3) == 0.1  # a table that stops short: its last level's factor above it


def test_it_prices_as_smartspec_with_its_own_tokens(trace, trained):
    """The same prices (cost model, padded chain, drafting) as SmartSpec; only the expected tokens differ: the
    predicted accepted tokens, shrunk, kept within each row's chain, plus one."""
    import copy

    smart = SmartSpecPolicy(ARMS, obs_size(M), feature_names(M), cost=COST)
    trained = copy.deepcopy(trained)  # a shrink of its own at each batch size: the batch's is applied
    trained.set_shrink([[1, 0.0], [2, 0.3], [1 << 30, 0.5]])
    sim = make_for(trace)(list(trace.prompt_ids))(2, ["4"], seed=3)
    sim.reset()
    for _ in range(6):
        obs = sim.observe()[0].copy()
        tok_p, t_p, r = trained.estimate(obs)
        tok_s, t_s, _ = smart.estimate(obs)
        assert np.allclose(t_p, t_s) and r == int(sim.active[0].sum())
        x, live = row_inputs(obs[None], M)
        acc = trained.forward(x[0][live[0]]).T * (1 - trained.factor(r))  # [K, R]
        match = obs[9:].reshape(M, 6)[live[0], 4] * 16  # the n-gram's proposal at each row bounds its chains
        depths = np.array([0, 1, 2, 3, 5, 8])[:, None]
        want = (1 + np.where(depths > 0, np.clip(acc, 0, np.minimum(depths, match[None, :])), 0)).sum(1)
        assert np.allclose(tok_p, want) and tok_p[0] == pytest.approx(r)  # none: each row's own token
        sim.step(np.full(2, trained.act(obs)))


def test_round_trip_and_damaged_files(trained, tmp_path):
    path = tmp_path / "predictor.zip"
    trained.save(path)
    again = load_policy(path, arms=ARMS, obs_size=obs_size(M))
    assert again.kind == "predictor" and again.shrink == trained.shrink
    obs = np.random.default_rng(0).random((16, obs_size(M))).astype(np.float32)
    obs[:, 9::6] = obs[:, 9::6] > 0.3  # row slots active or not
    assert all(np.allclose(trained.scores(o), again.scores(o)) for o in obs)
    import zipfile

    assert all(not n.endswith(".pkl") for n in zipfile.ZipFile(path).namelist())
    bad = ServePredictorPolicy(ARMS, obs_size(M), feature_names(M), cost=COST)
    bad.weights, bad.x_mean = list(trained.weights), trained.x_mean[:-1]
    bad.x_scale, bad.y_mean, bad.y_scale = trained.x_scale, trained.y_mean, trained.y_scale
    bad.save(tmp_path / "inputs.zip")
    with pytest.raises(PolicyError, match="serve predictor weights are not for 4 row inputs and 6 arms"):
        load_policy(tmp_path / "inputs.zip")
    for shrink, msg in (([[4, 0.2], [2, 0.1]], "must increase"), ([[1 << 30, 1.5]], "shrink factor"),
                        ([[1 << 30, float("nan")]], "shrink factor"), ([], "non-empty"),
                        ([[4]], "is not \\[max_rows, factor\\]")):  # fmt: skip
        with pytest.raises(PolicyError, match=msg):
            ServePredictorPolicy(ARMS, obs_size(M), feature_names(M), cost=COST, shrink=shrink)
    with pytest.raises(PolicyError, match="not trained"):
        ServePredictorPolicy(ARMS, obs_size(M), feature_names(M), cost=COST).act(obs[0])


def test_one_training_prompt_fits_without_a_shrink(trace):
    one = train_serve_predictor(make_for(trace), [trace.prompt_ids[0]], ARMS, obs_size(M), feature_names(M), COST,
                                loads=["1"], levels=[1, 2, 4], episodes=2, rounds=1, max_iter=20)  # fmt: skip
    assert one.fitted and one.shrink == [[1 << 30, 0.0]]


def test_the_shrink_is_chosen_on_held_out_prompts_and_the_final_fit_reads_them_all(trace, monkeypatch):
    """The regressor that chooses the shrink is fitted on the even-numbered training prompts and replayed on the
    odd-numbered ones (never on those it fitted); the policy is then fitted on all of them. Each fit's first
    round visits states with SmartSpec, the next with the policy itself (DAgger); levels come in any order."""
    import policies.serve_predictor as sp

    best = {"1": 0.3, "2": 0.0, "4": 0.5}  # the factor that serves most at each level

    def replay(sim, policy):
        return np.array([2.0 if policy.factor(1) == best[sim.load_name[0]] else 1.0])

    monkeypatch.setattr(sp, "run_policy", replay)
    made, behaviors = [], []
    collect = sp.collect

    def recorded(make, behavior, *a, **k):
        behaviors.append(type(behavior).__name__)
        return collect(make, behavior, *a, **k)

    monkeypatch.setattr(sp, "collect", recorded)

    def factory(prompts):
        made.append(list(prompts))
        return make_for(trace)(prompts)

    ids = list(trace.prompt_ids)
    ticks = []
    got = train_serve_predictor(factory, ids, ARMS, obs_size(M), feature_names(M), COST, loads=["1"],
                                levels=[4, 1, 2], episodes=2, rounds=2, max_iter=20,
                                tick=lambda: ticks.append(1))  # fmt: skip
    assert made == [ids[0::2], ids[1::2], ids]
    assert behaviors == ["SmartSpecPolicy", "ServePredictorPolicy"] * 2
    assert (
        got.shrink == [[1, 0.3], [2, 0.0], [1 << 30, 0.5]]
        and len(ticks) == predictor_ticks(len(ids), 3, 2) == 2 * 2 + 3
    )
    one = []
    train_serve_predictor(make_for(trace), ids[:1], ARMS, obs_size(M), feature_names(M), COST, loads=["1"],
                          levels=[1, 2], episodes=2, rounds=1, max_iter=20, tick=lambda: one.append(1))  # fmt: skip
    assert len(one) == predictor_ticks(1, 2, 1) == 1
