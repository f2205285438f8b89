"""What an RL policy refuses, without training: layer sizes that are not positive, hyper-parameters outside their
range (a PPO mini-batch of one), a model of another observation size or menu at ``attach``, and a saved file whose
``network.json`` disagrees with its header (its checksum made to match, as a forger can)."""

from __future__ import annotations

import json

import pytest
import torch

from policies import PolicyError, load_policy
from policies.rl import SB3Policy
from tests.policies.synthetic import SYNTH_ARMS
from tests.policies.test_safe_files import with_member

OBS = 19


@pytest.mark.parametrize("arch", ["64,0", "0", "-4", "8,x", str(1 << 13)])
def test_layer_sizes_must_be_positive_and_bounded(arch):
    with pytest.raises(PolicyError, match="net_arch must"):
        SB3Policy(SYNTH_ARMS, OBS, net_arch=arch)
    with pytest.raises(PolicyError, match="vf_net_arch must"):
        SB3Policy(SYNTH_ARMS, OBS, vf_net_arch=arch)
    assert SB3Policy(SYNTH_ARMS, OBS, net_arch="1,4096").net_arch == [1, 4096]


@pytest.mark.parametrize(
    "algo,kw",
    [("ppo", {"batch_size": 1}), ("ppo", {"n_steps": 0}), ("ppo", {"gamma": 1.5}), ("ppo", {"learning_rate": 0}),
     ("dqn", {"gradient_steps": -2}), ("a2c", {"ent_coef": -0.1})],
)  # fmt: skip
def test_hyperparameters_outside_their_range_are_refused(algo, kw):
    with pytest.raises(PolicyError, match=f"{algo} {next(iter(kw))}"):
        SB3Policy(SYNTH_ARMS, OBS, algo=algo, **kw)
    SB3Policy(SYNTH_ARMS, OBS, algo="ppo", batch_size=2, gamma=1.0)  # the edges that are allowed


def _model(policy):
    return policy._new_model(policy._spaces_env(), None, seed=0, acting=True)


@pytest.mark.parametrize(
    "other",
    [dict(arms=SYNTH_ARMS, obs_size=OBS + 1), dict(arms=SYNTH_ARMS[:-1], obs_size=OBS)],
    ids=["obs", "arms"],
)
def test_a_model_of_other_spaces_is_refused_at_attach(other):
    p = SB3Policy(SYNTH_ARMS, OBS, net_arch="8")
    with pytest.raises(PolicyError, match="but the policy header says"):
        p.attach(_model(SB3Policy(other["arms"], other["obs_size"], net_arch="8")))
    assert p.model is None
    p.attach(_model(SB3Policy(SYNTH_ARMS, OBS, net_arch="8")))


def test_a_network_json_that_disagrees_with_the_header_is_refused(tmp_path):
    p = SB3Policy(SYNTH_ARMS, OBS, net_arch="8", gamma=0.5)
    p.attach(_model(p))
    path = tmp_path / "p.zip"
    p.save(path)
    assert load_policy(path).hyper == {"gamma": 0.5}  # control: the file as saved loads
    network = {**p.network(), "hyper": {"gamma": 0.25}}  # the same weights' shapes, another training
    bad = with_member(path, "network.json", json.dumps(network).encode(), tmp_path / "bad.zip")
    with pytest.raises(PolicyError, match="network.json .* disagrees with its header") as err:
        load_policy(bad)
    assert "\n" not in str(err.value)
    assert isinstance(load_policy(path).model.policy.state_dict()["action_net.weight"], torch.Tensor)
