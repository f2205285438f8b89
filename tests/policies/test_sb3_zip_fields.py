"""A plain stable-baselines3 zip read as data, built by hand (no training): the plain fields of ``data`` next to
the pickled spaces must agree with the weights (observation shape, action count, an action space starting at 0),
PPO and A2C are told apart by PPO's own fields, and DQN's default activation is ReLU."""

from __future__ import annotations

import io
import json
import zipfile

import pytest
import torch

from policies import PolicyError
from policies.sb3_files import read_sb3_zip, state_shapes, torch_bytes

OBS, N = 4, 3
BOX = "<class 'gymnasium.spaces.box.Box'>"
DISCRETE = "<class 'gymnasium.spaces.discrete.Discrete'>"


def sb3_zip(data: dict, algo: str = "ppo") -> bytes:
    g = torch.Generator().manual_seed(0)
    state = {k: torch.randn(s, generator=g) for k, s in state_shapes(algo, OBS, N, [8]).items()}
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("data", json.dumps(data))
        zf.writestr("policy.pth", torch_bytes(state))
    return buf.getvalue()


def spaces(obs_shape=(OBS,), n=N, start=0) -> dict:
    return {
        "observation_space": {":type:": BOX, "_shape": list(obs_shape)},
        "action_space": {":type:": DISCRETE, "n": str(n), "start": str(start)},
    }


def test_spaces_that_agree_with_the_weights_are_read():
    z = read_sb3_zip(sb3_zip({**spaces(), "n_epochs": 10}), "m.zip")
    assert (z.algo, z.obs_size, z.n_actions, z.net_arch) == ("ppo", OBS, N, [8])


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (spaces(obs_shape=(OBS + 1,)), "observation space has shape"),
        (spaces(n=N + 1), f"action space has {N + 1} actions, the weights {N}"),
        (spaces(start=1), "action space starts at 1, not 0"),
    ],
    ids=["obs-shape", "action-count", "action-start"],
)
def test_spaces_that_disagree_with_the_weights_are_refused(data, needle):
    with pytest.raises(PolicyError, match=needle):
        read_sb3_zip(sb3_zip(data), "m.zip")


@pytest.mark.parametrize(
    ("fields", "algo"),
    [
        ({}, "ppo"),  # no data at all (not even the spaces): ppo
        ({"n_epochs": 10}, "ppo"),
        ({"clip_range": 0.2, "n_steps": 8}, "ppo"),
        ({"n_steps": 8}, "a2c"),
    ],
)
def test_ppo_and_a2c_are_told_apart_by_ppos_fields(fields, algo):
    z = read_sb3_zip(sb3_zip({**spaces(), **fields} if fields else {}), "m.zip")
    assert z.algo == algo and z.activation == "tanh"


def test_a_dqn_zip_without_an_activation_is_relu():
    z = read_sb3_zip(sb3_zip(spaces(), algo="dqn"), "m.zip")
    assert (z.algo, z.activation, z.n_actions) == ("dqn", "relu", N)
