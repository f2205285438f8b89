"""The accept-length predictor: trained on the training prompts of the synthetic trace, it must beat the best
static arm on the held-out prompts by reading the feature that reveals the drafter's match."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from policies import load_policy
from policies.oracle import best_static, score_batch, score_greedy_oracle, score_static, static_table
from policies.predictor import train_predictor


@pytest.mark.parametrize("model", ["ridge", "mlp"])
def test_predictor_beats_the_best_static_arm_on_held_out_prompts(
    model, synth_env, synth_train_env, synth_split
):
    policy = train_predictor(synth_train_env, model=model, rounds=2, passes=2, max_iter=200)
    test = list(synth_split.test)
    best = best_static(static_table(synth_env, synth_split.train))
    static = score_static(synth_env, best, test).speedup
    learned = score_batch(synth_env, policy.act_batch, test, name=model, kind="predictor")
    oracle = score_greedy_oracle(synth_env, test).speedup
    assert learned.speedup > 1.05 * static
    assert (learned.speedup - static) / (oracle - static) > 0.4


def test_predictions_are_accept_lengths_and_costs(synth_train_env):
    policy = train_predictor(synth_train_env, model="ridge", rounds=1, passes=1)
    tb = synth_train_env.tables
    obs, _ = synth_train_env.reset(seed=0)
    acc, cost = policy.predict(obs)
    assert acc.shape == cost.shape == (len(synth_train_env.arm_names),)
    assert abs(acc[0]) < 0.2 and abs(cost[0] - 1.0) < 0.05  # "none": nothing accepted, one AR step
    assert cost[-1] > cost[1]  # the deep arm costs more
    assert tb.accept.shape[0] == len(acc)


def test_scores_are_the_documented_objectives(synth_train_env):
    """Tokens are the predicted accepted drafts + 1 (the bonus token; a negative prediction counts as none), the
    cost floored at 0.05 of an AR step: ``ratio`` scores tokens / cost, ``margin`` tokens - rate * cost."""
    policy = train_predictor(synth_train_env, model="ridge", rounds=1, passes=1)
    x = np.random.default_rng(0).random((16, len(synth_train_env.feature_names)))
    acc, cost = policy.predict(x)
    tokens, cost = np.maximum(acc, 0.0) + 1.0, np.maximum(cost, 0.05)
    policy.objective, policy.rate = "margin", 2.5
    np.testing.assert_allclose(policy.scores(x), tokens - 2.5 * cost, rtol=1e-12)
    policy.objective = "ratio"
    np.testing.assert_allclose(policy.scores(x), tokens / cost, rtol=1e-12)


def test_round_trip_without_pickle(synth_train_env, tmp_path):
    policy = train_predictor(synth_train_env, model="mlp", rounds=1, passes=1, max_iter=50)
    path = tmp_path / "pred.zip"
    policy.save(path)
    again = load_policy(path, arms=synth_train_env.arm_names, obs_size=len(synth_train_env.feature_names))
    x = np.random.default_rng(0).random((32, len(synth_train_env.feature_names)))
    assert np.allclose(policy.scores(x), again.scores(x))
    # the arm of the highest score, one row or a batch at a time (rows whose two best scores nearly tie left out)
    top2 = np.sort(again.scores(x), axis=-1)[:, -2:]
    clear = np.flatnonzero(top2[:, 1] - top2[:, 0] > 1e-6)
    best = again.scores(x).argmax(-1)[clear].tolist()
    assert (
        again.act_batch(x)[clear].tolist() == [again.act(x[i]) for i in clear] == best and len(set(best)) > 1
    )
    import zipfile

    assert all(not n.endswith(".pkl") for n in zipfile.ZipFile(path).namelist())


def test_a_predictor_file_of_inconsistent_layers_is_refused(synth_train_env, tmp_path):
    """Every array of a saved predictor is checked at load (shapes that chain, finite values), not mid-run."""
    from policies import PolicyError, load_policy

    policy = train_predictor(synth_train_env, model="mlp", rounds=1, passes=1, max_iter=20)
    w, b = policy.weights[0]
    policy.weights[0] = (w[:, :3].copy(), b[:3].copy())  # the next layer expects more inputs
    policy.save(tmp_path / "chain.zip")
    with pytest.raises(PolicyError, match="predictor layer 1: weight of shape"):
        load_policy(tmp_path / "chain.zip")
    policy.weights[0] = (w, b)
    policy.x_scale = policy.x_scale[:-1]
    policy.save(tmp_path / "scale.zip")
    with pytest.raises(PolicyError, match="predictor x_scale has shape"):
        load_policy(tmp_path / "scale.zip")
    policy.x_scale = np.full(policy.obs_size, np.nan)
    policy.save(tmp_path / "nan.zip")
    with pytest.raises(PolicyError, match="x_scale holds non-numeric or non-finite"):
        load_policy(tmp_path / "nan.zip")
    policy.x_scale = np.zeros(policy.obs_size)  # a standardization dividing by 0: NaN scores mid-run
    policy.save(tmp_path / "zero.zip")
    with pytest.raises(PolicyError, match="x_scale holds values below 1e-06"):
        load_policy(tmp_path / "zero.zip")
    policy.x_scale = np.full(policy.obs_size, 1e-310)  # finite and positive, yet every score overflows
    policy.save(tmp_path / "tiny.zip")
    with pytest.raises(PolicyError, match="x_scale holds values below 1e-06"):
        load_policy(tmp_path / "tiny.zip")
    policy.x_scale = np.ones(policy.obs_size)
    layers = list(policy.weights)
    wl, bl = layers[-1]
    policy.weights[-1] = (np.zeros_like(wl), np.full_like(bl, 10.0))
    policy.y_scale = np.full(2 * policy.num_arms, 1e308)  # inf - inf: NaN scores, and argmax would pick arm 0
    policy.save(tmp_path / "huge.zip")
    with pytest.raises(PolicyError, match="scores at the mean observation are not finite"):
        load_policy(tmp_path / "huge.zip")
    w0 = w.copy()
    w0[0] = 1e306  # finite at the mean observation, overflowing far from it
    policy.weights = [(w0, b), *layers[1:]]
    policy.y_scale = np.ones(2 * policy.num_arms)
    policy.save(tmp_path / "far.zip")
    far = load_policy(tmp_path / "far.zip")
    obs = np.asarray(far.x_mean, dtype=np.float32) + 1e4
    with np.errstate(all="ignore"), pytest.raises(PolicyError, match="scores overflow at this observation"):
        far.act_batch(obs[None])


def test_a_rate_given_is_kept_and_a_seed_past_numpys_range_refused(synth_train_env):
    from policies import PolicyError

    assert train_predictor(synth_train_env, model="ridge", rounds=1, passes=1, rate=2.5).rate == 2.5
    with pytest.raises(PolicyError, match="seed must be an integer"):
        train_predictor(synth_train_env, model="ridge", rounds=1, passes=1, seed=2**32)


@pytest.mark.parametrize(
    "script, kept, replays",
    [
        # ratio rule 2.0, then each rate's replay: rising, then falling; the fastest is neither first nor last
        ({None: 2.0, 2.0: 2.5, 2.5: 2.6, 2.6: 2.55, 2.55: 2.4}, 2.5, 5),
        # converging: stops once a rate replays within 1e-3 of itself, keeping the faster of the two last
        ({None: 2.0, 2.0: 2.3, 2.3: 2.3004, 2.3004: 2.0}, 2.3, 3),
        # the first rate is the fastest
        ({None: 2.0, 2.0: 2.5, 2.5: 2.2, 2.2: 2.1, 2.1: 2.05}, 2.0, 5),
    ],
)
def test_fit_rate_keeps_the_rate_whose_policy_replayed_fastest(monkeypatch, script, kept, replays):
    """Dinkelbach's iteration with the replays scripted (``script``: the speedup replayed under each rate; None:
    the ratio rule's): ``fit_rate`` starts from the ratio rule's speedup, replays each rate in turn (at most
    four), stops early when a rate replays as itself, and keeps the rate whose policy replayed fastest."""
    import policies.predictor as predictor

    policy = SimpleNamespace(objective="margin", rate=None, act_batch=None)
    seen = []

    def rollout(tb, prompts, choose):
        seen.append(None if policy.objective == "ratio" else policy.rate)
        return np.array([script[seen[-1]]]), np.array([1.0])

    monkeypatch.setattr(predictor, "rollout_actions", rollout)
    assert predictor.fit_rate(policy, None, None) == kept
    assert policy.objective == "margin" and policy.rate == kept and len(seen) == replays
    assert seen[1:] == [script[r] for r in seen[:-1]]  # each rate tried is the speedup replayed before it


@pytest.mark.parametrize("dtype", [np.bool_, np.str_])
def test_net_arrays_of_a_boolean_or_text_dtype_are_refused(dtype):
    """The npz reader lets booleans and text through (complex and objects it refuses itself): a boolean weight
    would act as 0/1, a text one fail mid-run; every array the forward uses must hold real numbers."""
    from policies import PolicyError
    from policies.archive import npz_bytes
    from policies.net_arrays import NetArrays

    net = NetArrays()
    net.init_net(2, 1)
    net.weights = [(np.ones((2, 3)), np.zeros(3)), (np.ones((3, 1)), np.zeros(1))]
    good = net.net_state()
    back = NetArrays()
    back.init_net(2, 1)
    back.restore_net(good, "2 inputs, 1 output")
    np.testing.assert_allclose(back.forward(np.array([1.0, 2.0])), [9.0])
    arrays = {"x_mean": np.zeros(2), "x_scale": np.ones(2), "y_mean": np.zeros(1), "y_scale": np.ones(1),
              "w0": np.ones((2, 3)).astype(dtype), "b0": np.zeros(3), "w1": np.ones((3, 1)), "b1": np.zeros(1)}  # fmt: skip
    with pytest.raises(PolicyError, match="w0 holds non-numeric or non-finite"):
        back.restore_net({"model.npz": npz_bytes(**arrays)}, "2 inputs, 1 output")
