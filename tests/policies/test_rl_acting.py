"""An RL policy acts as stable-baselines3's ``predict(obs, deterministic=True)``, with random weights and no
training: through the numpy copy of its actor (tanh and relu networks), through ``predict`` itself when the network
is no plain MLP (an ELU one), on observations past [-1, 1] as well, per row for ``ppo-rows``; and rebuilding a
model to act leaves torch's global random generator as it was."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from env.serve_env import feature_names, obs_size
from policies.rl import SB3Policy
from policies.rl_rows import SB3RowPolicy
from tests.policies.synthetic import SYNTH_ARMS
from tests.policies.test_rl_rows import TWO, M, _obs

OBS = 19


def _random(p, seed=0):
    """``p`` holding a model of random weights (its heads far from uniform: the argmax is not a tie)."""
    model = p._new_model(p._spaces_env(), None, seed=seed, acting=True)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in model.policy.parameters():
            t.add_(torch.randn(t.shape, generator=g))
    p.attach(model)
    return p, model


def _obs_wide(n=200, seed=0):
    """Observations of the scale of the env's features (token counts, lengths): well past [-1, 1]."""
    return np.random.default_rng(seed).uniform(-6, 6, (n, OBS)).astype(np.float32)


@pytest.mark.parametrize(
    "algo,activation,numpy_copy",
    [("ppo", "tanh", True), ("ppo", "relu", True), ("dqn", "relu", True), ("a2c", "elu", False),
     ("ppo", "elu", False)],
)  # fmt: skip
def test_an_rl_policy_acts_as_its_deterministic_predict(algo, activation, numpy_copy):
    p, model = _random(SB3Policy(SYNTH_ARMS, OBS, algo=algo, activation=activation, net_arch="16,8"), seed=3)
    assert (p._layers is not None) == numpy_copy
    obs = _obs_wide()
    expected = model.predict(obs, deterministic=True)[0]
    assert len(set(expected.tolist())) > 1  # the comparison means something
    for _ in range(2):  # deterministic: the same arms every call
        assert np.array_equal(p.act_batch(obs), expected)
        assert [p.act(o) for o in obs] == expected.tolist()
        assert np.array_equal(p.predict(obs)[0], expected)  # predict's default is deterministic


def test_a_per_row_policy_without_a_numpy_copy_acts_deterministically():
    p, model = _random(SB3RowPolicy(TWO, obs_size(M), feature_names(M), activation="elu"), seed=4)
    assert p._layers is None
    obs = _obs(64, seed=9)
    expected = model.predict(obs, deterministic=True)[0]
    assert len({tuple(r) for r in expected.tolist()}) > 1
    for _ in range(2):
        assert np.array_equal(p.act_batch(obs), expected)
        assert np.array_equal(p.act(obs[5]), expected[5])


def test_rebuilding_a_model_to_act_leaves_the_global_generator_alone():
    p, model = _random(SB3Policy(SYNTH_ARMS, OBS, net_arch="16,8"))
    state = {k: v.clone() for k, v in model.policy.state_dict().items()}
    torch.manual_seed(123)
    before = torch.get_rng_state()
    again = p.acting_model(state)
    assert torch.equal(torch.get_rng_state(), before)
    assert all(torch.equal(again.policy.state_dict()[k], v) for k, v in state.items())
