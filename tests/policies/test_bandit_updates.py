"""One update of each bandit against its formula (exact numbers, not regret curves), and the checks of a loaded
bandit state at their boundaries: the index of the last arm, a negative sum of squares, a LinUCB matrix that is
positive definite in its lower triangle but not symmetric."""

from __future__ import annotations

import math

import numpy as np
import pytest

from policies import PolicyError
from policies.bandits import EXP3, UCB1
from policies.linucb import LinUCB


def test_exp3_one_update_adds_gamma_xhat_over_k_to_the_pulled_arm():
    """Uniform weights, K = 4, gamma = 0.2, reward 1 (of scale 1): p = 1/4, xhat = 4, gain = gamma xhat / K = 0.2."""
    p = EXP3(["a", "b", "c", "d"], gamma=0.2, seed=0)
    p.act(None)
    np.testing.assert_allclose(p.probs, 0.25)
    p.update(None, 2, 1.0)
    np.testing.assert_allclose(p.log_w, [-0.2, -0.2, 0.0, -0.2], atol=1e-12)


def test_exp3s_shares_e_alpha_over_k_of_the_total_weight():
    """EXP3.S: w_i <- w_i exp(gain_i) + (e alpha / K) sum_j w_j; from w = 1: w_i = exp(gain_i) + e alpha."""
    k, gamma, share = 4, 0.2, 0.01
    p = EXP3(["a", "b", "c", "d"], gamma=gamma, share=share, seed=0)
    p.act(None)
    p.update(None, 2, 1.0)
    w = np.exp([0.0, 0.0, gamma, 0.0]) + math.e * share / k * k
    np.testing.assert_allclose(p.log_w, np.log(w) - np.log(w).max(), atol=1e-12)


def _ucb_state():
    p = UCB1(["a", "b"], window=4)
    for arm, r in ((0, 0.5), (1, 1.0), (0, 0.25)):
        p.update(None, arm, r)
    return p, p.stats.to_json()


def test_a_bandit_state_naming_the_arm_one_past_the_last_is_refused():
    p, s = _ucb_state()
    p.stats.load_json(s)  # the state as saved loads
    s["recent"] = [[2, 1.0]]  # two arms: 0 and 1
    with pytest.raises(PolicyError, match="recent pulls name arms outside 0..1"):
        p.stats.load_json(s)


def test_a_bandit_state_with_a_negative_sum_of_squares_is_refused():
    p, s = _ucb_state()
    s["sums"] = [-1.0, 1.0]  # rewards may be negative: their sum too
    p.stats.load_json(s)
    s["sq"] = [-1.0, 1.0]
    with pytest.raises(PolicyError, match="sq holds non-finite or negative"):
        p.stats.load_json(s)


def test_linucb_update_adds_the_outer_product_of_the_observation_and_its_bias():
    """A_a += x x^T and b_a += (r / scale) x, x the observation with 1 appended; the other arm is untouched."""
    p = LinUCB(["a", "b"], 2, lam=0.5, scale=2.0)
    p.update(np.array([0.3, 0.7]), 1, 3.0)
    x = np.array([0.3, 0.7, 1.0])
    np.testing.assert_allclose(p.A[1], 0.5 * np.eye(3) + np.outer(x, x), atol=1e-12)
    np.testing.assert_allclose(p.A[0], 0.5 * np.eye(3))
    np.testing.assert_allclose(p.b, [[0.0, 0.0, 0.0], 1.5 * x], atol=1e-12)
    assert p.pulls.tolist() == [0.0, 1.0]


def test_linucb_learns_a_per_arm_bias_on_a_zero_observation():
    """With the observation all zeros only the appended constant tells the arms apart."""
    p = LinUCB(["a", "b"], 1, alpha=0.0)
    for _ in range(5):
        p.update(np.zeros(1), 0, 1.0)
        p.update(np.zeros(1), 1, 2.0)
    assert p.act(np.zeros(1)) == 1
    s = p.scores(np.zeros(1))
    assert s[1] > s[0] > 0


def test_a_linucb_state_of_an_asymmetric_matrix_is_refused():
    """Cholesky reads one triangle only: a matrix positive definite there but not symmetric is caught apart."""
    p = LinUCB(["a", "b"], 2)
    st = p.state()
    p.restore(st)
    p.A[0, 0, 2] += 5.0
    with pytest.raises(PolicyError, match="not symmetric positive definite"):
        p.restore(p.state())


def test_a_linucb_state_of_negative_pulls_is_refused_but_negative_rewards_load():
    p = LinUCB(["a", "b"], 2)
    p.update(np.array([0.5, 0.5]), 0, -3.0)  # b < 0: a negative reward's
    p.restore(p.state())
    p.pulls[1] = -1.0
    with pytest.raises(PolicyError, match="pulls holds non-finite or negative"):
        p.restore(p.state())
