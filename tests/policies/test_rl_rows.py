"""PPO with one arm per row (``policies.rl_rows``): the actor shared by the row slots, the log-probability and
entropy over the active rows only, the numpy actor equal to stable-baselines3's, and its file read as data."""

from __future__ import annotations

import hashlib
import json
import warnings

import numpy as np
import pytest

from env.serve_env import feature_names, make_sb3_serve_env, obs_size
from policies.base import PolicyError, load_policy
from policies.rl_rows import GLOBAL, SB3RowPolicy, menu_grid, row_inputs
from policies.serving import ROW_WIDTH, run_policy, train_serve_ppo
from tests.policies.test_safe_files import read_zip, write_zip
from tests.policies.test_serving_policies import ARMS, COST, make_sim, obs_with

M = 4


@pytest.fixture(scope="module")
def trace():
    from tests.env.conftest import make_trace

    return make_trace(seed=0, prompts=8, max_new=40)


@pytest.fixture(scope="module")
def trained(trace):
    def make_vec():
        return make_sb3_serve_env(4, trace=trace, cost=COST, max_batch=M, loads=["1", "4"], requests=4,
                                  reward="time_saved", seed=0, action="row")  # fmt: skip

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*mini-batch size.*")
        p, _ = train_serve_ppo(
            make_vec, ARMS, obs_size(M), feature_names(M), timesteps=512, seed=0, rows=True
        )
    return p


def _obs(n: int = 24, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        rows = int(rng.integers(1, M + 1))
        x = obs_with(M, rows, alpha=float(rng.uniform()), match=float(rng.integers(0, 9)))
        x[GLOBAL:] += rng.uniform(0, 0.3, M * ROW_WIDTH).astype(np.float32) * np.repeat(
            (np.arange(M) < rows).astype(np.float32), ROW_WIDTH
        )
        x[GLOBAL::ROW_WIDTH] = (np.arange(M) < rows).astype(np.float32)  # active flags stay 0 / 1
        out.append(x)
    return np.stack(out).astype(np.float32)


def test_trained_per_row_policy_acts_per_row_saves_and_loads(trained, trace, tmp_path):
    p = trained
    assert p.name == "ppo-rows" and p.kind == "rl" and p.per_row and p.network()["slots"] == M
    assert p.network()["drafters"] == ["ngram"] and p.network()["shapes"] == ["d1", "d2", "d3", "d5", "d8"]
    obs = _obs()
    a = p.act_batch(obs)
    assert a.shape == (len(obs), M) and a.min() >= 0 and a.max() < len(ARMS)
    # the numpy actor is stable-baselines3's deterministic action
    assert np.array_equal(a, p.model.predict(obs, deterministic=True)[0])
    assert np.array_equal(p.act(obs[3]), a[3])
    sim = make_sim(trace)
    sim.reset()
    g = run_policy(sim, p)
    assert np.isfinite(g).all() and (g > 0).all()
    p.save(tmp_path / "rows.zip")
    back = load_policy(tmp_path / "rows.zip", arms=ARMS, obs_size=obs_size(M))
    assert isinstance(back, SB3RowPolicy) and np.array_equal(back.act_batch(obs), a)


TWO = ["none", "ngram-d1", "ngram-d3", "suffix-d1", "suffix-d3"]  # two drafters at two shapes


def _random_policy(arms=TWO, seed=0):
    """A per-row policy with random weights (its heads not near uniform) and its SB3 network."""
    import torch

    p = SB3RowPolicy(arms, obs_size(M), feature_names(M))
    model = p._new_model(p._spaces_env(), None, seed=seed, acting=True)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in model.policy.parameters():
            t.add_(torch.randn(t.shape, generator=g) * 0.5)
    p.attach(model)
    return p, model.policy


def test_the_menu_grid_pairs_every_drafter_with_every_shape():
    drafters, shapes, arm_of = menu_grid(TWO)
    assert drafters == ["ngram", "suffix"] and shapes == ["d1", "d3"]
    assert arm_of.tolist() == [[0, 0, 0], [1, 3, 0], [2, 4, 0]]  # shape none; d1; d3 -- the last column: none
    d, sh, _ = menu_grid(ARMS)
    assert d == ["ngram"] and sh == ["d1", "d2", "d3", "d5", "d8"]
    for bad, why in [
        (["ngram-d1", "suffix-d1"], "needs 'none'"),
        (["none", "ngram-d1", "ngram-d3", "suffix-d1"], "suffix-d3 is missing"),
        (["none", "ngram-d1", "bogus-d1"], "unknown drafter"),
        (["none", "ngram-d1", "none"], "every drafter at every shape"),
    ]:
        with pytest.raises(PolicyError, match=why):
            menu_grid(bad)


def test_the_joint_log_probability_is_exact_and_sampling_follows_it():
    """Over every pair of arms of the two active rows, the probabilities sum to one (the arms a shape cannot give
    have none; both rows none is reached by the shape none and by each row's own none), and 4,000 sampled
    actions follow them."""
    import itertools

    import torch

    p, pol = _random_policy()
    x = _obs(1, seed=11)[0]
    x[GLOBAL::ROW_WIDTH] = [1, 1, 0, 0]
    obs = torch.as_tensor(x[None])
    k = len(TWO)
    pairs = list(itertools.product(range(k), repeat=2))
    acts = torch.tensor([[a, b, 2, 4] for a, b in pairs], dtype=torch.float32)  # empty slots: any arm
    with torch.no_grad():
        lp = pol.get_distribution(obs.expand(len(pairs), -1)).log_prob(acts).exp().numpy()
    assert lp.sum() == pytest.approx(1.0, abs=1e-5)
    prob = dict(zip(pairs, lp))
    assert prob[(1, 4)] < 1e-9 and prob[(2, 3)] < 1e-9  # ngram-d1 with suffix-d3: no shape gives both
    assert prob[(0, 0)] > 0 and prob[(1, 3)] > 0
    torch.manual_seed(0)
    with torch.no_grad():
        drawn = pol.get_distribution(obs.expand(4000, -1)).get_actions(deterministic=False)[:, :2].numpy()
    counts = {pr: 0 for pr in pairs}
    for a, b in drawn.tolist():
        counts[(a, b)] += 1
    for pr in pairs:  # each cell within 5 binomial standard deviations (and none drawn where p = 0)
        n, q = 4000, prob[pr]
        assert abs(counts[pr] - n * q) <= 5 * np.sqrt(n * q * (1 - q)) + 1, (pr, counts[pr], n * q)


def test_empty_slots_count_for_nothing_and_rollout_and_update_agree():
    import torch

    _, pol = _random_policy(seed=1)
    obs = torch.as_tensor(_obs(8, seed=5))
    rows = obs[:, GLOBAL::ROW_WIDTH].sum(1).long()
    a = torch.zeros(len(obs), M)
    b = a.clone()
    c = a.clone()
    for i, r in enumerate(rows.tolist()):
        b[i, r:] = 3  # an empty slot's arm: changes nothing
        c[i, 0] = 3  # an active row's arm: changes the probability
    with torch.no_grad():
        _, la, ea = pol.evaluate_actions(obs, a)
        _, lb, eb = pol.evaluate_actions(obs, b)
        _, lc, _ = pol.evaluate_actions(obs, c)
        # forward's log-probability (stored at rollout) is evaluate_actions' (the PPO ratio starts at 1)
        acts, _, lp = pol.forward(obs, deterministic=False)
        _, le, _ = pol.evaluate_actions(obs, acts.float())
    assert torch.equal(la, lb) and torch.equal(ea, eb)
    assert not torch.allclose(la, lc)
    torch.testing.assert_close(lp, le)


def test_every_row_slot_is_scored_by_the_same_actor():
    """Swapping two rows' blocks swaps their drafter scores: one actor for every slot."""
    import torch

    _, pol = _random_policy(seed=2)
    x = _obs(1, seed=3)[0]
    x[GLOBAL::ROW_WIDTH] = 1.0
    x[GLOBAL + 4] = 0.0  # row 0: no match
    x[GLOBAL + 2 * ROW_WIDTH + 4] = 0.5  # row 2: a long one
    y = x.copy()
    blk = y[GLOBAL:].reshape(M, ROW_WIDTH)
    blk[[0, 2]] = blk[[2, 0]]
    with torch.no_grad():
        rx = pol.get_distribution(torch.as_tensor(x[None])).rows[0].numpy()
        ry = pol.get_distribution(torch.as_tensor(y[None])).rows[0].numpy()
    np.testing.assert_allclose(ry[[2, 1, 0, 3]], rx, rtol=0, atol=1e-5)
    assert not np.allclose(rx[0], rx[2])  # the rows do differ


def test_the_numpy_actor_is_the_networks_deterministic_action():
    p, _ = _random_policy(seed=4)
    obs = _obs(64, seed=9)
    a = p.act_batch(obs)
    assert np.array_equal(a, p.model.predict(obs, deterministic=True)[0])
    drafting = [set(np.asarray(TWO)[r[r > 0]].tolist()) for r in a]
    shapes = [{x.split("-")[1] for x in arms} for arms in drafting]
    assert all(len(sh) <= 1 for sh in shapes)  # one tree shape per batch
    assert {len(d) for d in drafting} >= {2}  # some batches mix drafters across rows


def test_per_row_policy_refuses_what_does_not_fit():
    with pytest.raises(PolicyError, match="actor-critic"):
        SB3RowPolicy(ARMS, obs_size(M), feature_names(M), algo="dqn")
    with pytest.raises(PolicyError, match="not a serving observation"):
        SB3RowPolicy(ARMS, 10)
    with pytest.raises(PolicyError, match="is missing"):
        SB3RowPolicy(TWO[:-1], obs_size(M), feature_names(M))
    from gymnasium import spaces

    from policies.rl_rows import row_policy_class

    box = spaces.Box(0, 1, (obs_size(M),), np.float32)
    grid = menu_grid(ARMS)[2].tolist()
    with pytest.raises(PolicyError, match="MultiDiscrete"):
        row_policy_class()(box, spaces.Discrete(len(ARMS)), lambda _: 1e-3, arm_of=grid)
    with pytest.raises(PolicyError, match="reads observations"):
        row_policy_class()(box, spaces.MultiDiscrete([len(ARMS)] * (M + 1)), lambda _: 1e-3, arm_of=grid)
    with pytest.raises(PolicyError, match="grid"):
        row_policy_class()(box, spaces.MultiDiscrete([len(ARMS)] * M), lambda _: 1e-3, arm_of=[[0, 9]])
    for bad in (
        [[0, 0], [1, 1]],
        [[0, 0], [1, 2]],
        [[0, 1], [1, 0]],
    ):  # a shape's arm twice; none not last; not all none
        with pytest.raises(PolicyError, match="grid"):
            row_policy_class()(box, spaces.MultiDiscrete([len(ARMS)] * M), lambda _: 1e-3, arm_of=bad)


def test_row_inputs_put_the_batch_features_before_each_row():
    x = np.arange(obs_size(M), dtype=np.float32)
    r = row_inputs(x, M)
    assert r.shape == (M, GLOBAL + ROW_WIDTH)
    for i in range(M):
        assert np.array_equal(r[i, :GLOBAL], x[:GLOBAL])
        assert np.array_equal(r[i, GLOBAL:], x[GLOBAL + i * ROW_WIDTH : GLOBAL + (i + 1) * ROW_WIDTH])
    assert row_inputs(np.stack([x, x]), M).shape == (2, M, GLOBAL + ROW_WIDTH)


def test_hostile_per_row_files_are_refused_in_one_line(trained, tmp_path):
    src = tmp_path / "rows.zip"
    trained.save(src)
    members = read_zip(src)
    net, tensors = json.loads(members["network.json"]), members["policy.safetensors"]
    from safetensors.torch import load, save

    state = load(tensors)
    wide = dict(state)  # a head per slot: not this network
    wide["action_net.rows.weight"] = state["action_net.rows.weight"].repeat(M, 1)
    wide["action_net.rows.bias"] = state["action_net.rows.bias"].repeat(M)
    cases = {
        "wide_head": ({"policy.safetensors": save(wide)}, "do not fit"),
        "slots": ({"network.json": json.dumps({**net, "slots": M + 1}).encode()}, "disagrees"),
        # the shape head's logits read in another order: refused, not acted on with the wrong trees
        "shapes": (
            {"network.json": json.dumps({**net, "shapes": net["shapes"][::-1]}).encode()},
            "disagrees",
        ),
        "batch_network": (
            {
                "network.json": json.dumps(
                    {k: v for k, v in net.items() if k not in ("action", "slots")}
                ).encode()
            },
            "disagrees",
        ),  # fmt: skip
        "nan": (
            {
                "policy.safetensors": save(
                    {**state, "action_net.shape.bias": state["action_net.shape.bias"] * float("nan")}
                )
            },
            "NaN",
        ),  # fmt: skip
        "sb3_zip_only": ({"model.zip": b"PK\x05\x06" + b"\0" * 18}, "no stable-baselines3 zip form"),
    }
    for name, (members, match) in cases.items():
        items = read_zip(src)  # members replaced, their checksums made to match (a forger can do that)
        header = json.loads(items["header.json"])
        if name == "sb3_zip_only":  # a plain stable-baselines3 zip is read for batch policies only
            for gone in ("policy.safetensors", "network.json"):
                del items[gone], header["payload"][gone]
        for member, data in members.items():
            items[member], header["payload"][member] = data, hashlib.sha256(data).hexdigest()
        items["header.json"] = json.dumps(header).encode()
        bad = tmp_path / f"{name}.zip"
        write_zip(bad, items)
        with pytest.raises(PolicyError, match=match) as err:
            load_policy(bad, arms=ARMS, obs_size=obs_size(M))
        assert "\n" not in str(err.value), name
