"""``ppo-rows`` checked without training: its entropy bonus (``GridDistribution.entropy``) computed by hand, the
shape's entropy plus the mean over the active rows only (an empty slot neither adds nor dilutes); the menu's shapes
ordered by depth, not by name; a model of another menu refused at ``attach``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from env.serve_env import feature_names, obs_size
from policies.base import PolicyError
from policies.rl_rows import GLOBAL, SB3RowPolicy, menu_grid
from policies.serving import ROW_WIDTH
from tests.policies.test_rl_rows import TWO, M, _obs, _random_policy
from tests.policies.test_serving_policies import ARMS


def _entropy(logp: torch.Tensor) -> torch.Tensor:
    return -(logp.exp() * logp).sum(-1)


def test_the_entropy_is_the_shapes_plus_the_mean_of_the_active_rows():
    _, pol = _random_policy(seed=5)
    obs = _obs(6, seed=2)
    active = [1, 2, 4, 1, 3, 4]
    for i, n in enumerate(active):
        obs[i, GLOBAL::ROW_WIDTH] = (np.arange(4) < n).astype(np.float32)
    with torch.no_grad():
        dist = pol.get_distribution(torch.as_tensor(obs))
        got = dist.entropy()
        h_rows, h_shape = _entropy(dist.rows), _entropy(dist.shape)
    want = torch.stack([h_shape[i] + h_rows[i, :n].mean() for i, n in enumerate(active)])
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, h_shape + h_rows.mean(1))  # the empty slots would change it


def test_the_menus_shapes_are_ordered_by_depth_not_by_name():
    drafters, shapes, arm_of = menu_grid(["none", "suffix-d10", "ngram-d2", "ngram-d10", "suffix-d2"])
    assert drafters == ["ngram", "suffix"] and shapes == ["d2", "d10"]
    assert arm_of.tolist() == [[0, 0, 0], [2, 4, 0], [3, 1, 0]]


def test_a_model_of_another_menu_is_refused_at_attach():
    p = SB3RowPolicy(TWO, obs_size(M), feature_names(M))
    other = SB3RowPolicy(ARMS, obs_size(M), feature_names(M))  # six arms, the same observation
    model = other._new_model(other._spaces_env(), None, seed=0, acting=True)
    with pytest.raises(PolicyError, match="5 arms for each of 4 rows"):
        p.attach(model)
    assert p.model is None
