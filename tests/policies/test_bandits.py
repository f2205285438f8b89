"""Bandits against known answers: stationary Bernoulli arms (regret below Auer's UCB1 bound and growing like
log T), EXP3 under an adaptive adversary (within its weak-regret bound, where deterministic UCB1 earns nothing),
drift (discounted and sliding-window variants beat plain UCB1 after a switch), and LinUCB on a linear problem."""

from __future__ import annotations

import numpy as np
import pytest

from policies.bandits import EXP3, UCB1, ThompsonSampling
from policies.linucb import LinUCB
from tests.policies.synthetic import (
    auer_ucb1_bound,
    exp3_bound,
    run_adaptive_adversary,
    run_linear,
    run_stochastic,
)

MEANS = np.array([0.3, 0.5, 0.7, 0.45])
ARMS = [f"arm{i}" for i in range(len(MEANS))]
T = 6000
CHECKPOINTS = (750, 1500, 3000, 6000)


def mean_curve(make, seeds=range(5), horizon=T, means=MEANS):
    curves = [run_stochastic(make(seed), means, horizon, np.random.default_rng(100 + seed)) for seed in seeds]
    return np.mean(curves, axis=0)


@pytest.mark.parametrize(
    "make",
    [
        lambda s: UCB1(ARMS, seed=s),
        lambda s: ThompsonSampling(ARMS, seed=s),
    ],
    ids=["ucb1", "thompson"],
)
def test_stochastic_regret_is_logarithmic(make):
    regret = mean_curve(make)
    for t in CHECKPOINTS:  # below the analytic bound at every horizon
        assert regret[t - 1] <= auer_ucb1_bound(MEANS, t), (t, regret[t - 1])
    # the shape: each doubling of T adds at most what the bound's log term adds (8 ln 2 sum 1/Delta_i), so the
    # regret grows like log T; the growth exponent over the last doubling is far below 1 (linear) and 0.5 (sqrt)
    gaps = MEANS.max() - MEANS
    per_doubling = 8 * np.log(2) * np.sum(1 / gaps[gaps > 0])
    r = [regret[t - 1] for t in CHECKPOINTS]
    for a, b in zip(r, r[1:]):
        assert b - a <= per_doubling, r
    assert np.log2(r[-1] / r[-2]) < 0.4, r


def test_exp3_regret_within_bound_and_sublinear():
    for t in (1500, 6000):
        curves = [
            run_stochastic(EXP3(ARMS, horizon=t, seed=s), MEANS, t, np.random.default_rng(7 + s))
            for s in range(4)
        ]
        regret = np.mean(curves, axis=0)
        assert regret[-1] <= exp3_bound(len(ARMS), t * MEANS.max()), (t, regret[-1])
        if t == 6000:  # O(sqrt T): quadrupling T at most ~doubles the regret
            assert regret[-1] < 2.5 * regret[1499]


def test_exp3_survives_an_adaptive_adversary():
    """The adversary zeroes the reward of the arm the learner is most likely to pull. Against deterministic UCB1 it
    knows the pull exactly, and UCB1 earns nothing; EXP3 stays within its weak-regret bound."""
    k, horizon = 3, 3000

    def exp3_guess(p):
        return int(np.argmax(p.distribution()))

    def ucb_guess(p):
        return p.act(None)  # UCB1 is deterministic: act() is side-effect free and predicts the pull

    for seed in range(3):
        got, best = run_adaptive_adversary(EXP3(ARMS[:k], horizon=horizon, seed=seed), k, horizon, exp3_guess)
        assert best - got <= exp3_bound(k, best), (seed, got, best)
    got, best = run_adaptive_adversary(UCB1(ARMS[:k]), k, horizon, ucb_guess)
    assert got == 0.0 and best >= horizon * (k - 1) / k - 1


def switching_means(t: int) -> np.ndarray:
    """Arm 0 is far ahead for the first half, then falls just below arm 1 (the drift a generation sees when its
    text changes character). Plain UCB1 has sampled arm 0 so often that its mean takes thousands of pulls to
    fall: linear regret after the switch."""
    return np.array([0.9, 0.1]) if t < T // 2 else np.array([0.5, 0.6])


@pytest.mark.parametrize(
    "make",
    [
        lambda s: UCB1(ARMS[:2], discount=0.995, c=0.5, seed=s),
        lambda s: UCB1(ARMS[:2], window=500, c=0.5, seed=s),
        lambda s: ThompsonSampling(ARMS[:2], discount=0.995, scale=0.5, seed=s),
    ],
    ids=["discounted-ucb", "sliding-window-ucb", "discounted-thompson"],
)
def test_drift_variants_track_a_switch(make):
    plain = mean_curve(lambda s: UCB1(ARMS[:2], seed=s), seeds=range(3), means=switching_means)[-1]
    tracked = mean_curve(make, seeds=range(3), means=switching_means)[-1]
    assert tracked < 0.6 * plain, (tracked, plain)


def test_linucb_regret_is_sublinear_and_beats_the_best_fixed_arm():
    thetas = np.eye(4, 5)  # arm a's mean is x_a, x uniform in [0, 1]^5: the best arm depends on x
    regrets = [
        run_linear(LinUCB(ARMS, 5, alpha=0.5), thetas, 4000, np.random.default_rng(s)) for s in range(3)
    ]
    regret = np.mean(regrets, axis=0)
    assert regret[3999] < 2.5 * regret[999]  # quadrupling T less than ~doubles it (O(sqrt T) or better)
    xs = np.random.default_rng(0).random((20000, 5))
    best_fixed = (xs @ thetas.T).max(axis=1).mean() - (xs @ thetas.T).mean(axis=0).max()  # per-step regret
    assert regret[-1] < 0.5 * best_fixed * 4000, (regret[-1], best_fixed * 4000)


@pytest.mark.parametrize("cls", [UCB1, ThompsonSampling])
def test_a_windowed_bandit_saves_and_loads_after_an_arm_leaves_its_window(cls, tmp_path):
    """An arm whose every pull left the window kept a rounding residue of its squared rewards (0.1, 0.2, 0.5 in,
    out again: sq = -2.8e-17), which the loader refuses as negative: a policy that saved would not load."""
    from policies import load_policy

    p = cls(["a", "b"], window=3)
    for r in (0.1, 0.2, 0.5):
        p.update(None, 0, r, {})
    for r in (1.0, 1.0, 1.0):
        p.update(None, 1, r, {})
    st = p.stats
    assert st.counts[0] == st.sums[0] == st.sq[0] == 0.0
    p.save(tmp_path / "b.zip")
    back = load_policy(tmp_path / "b.zip")
    assert back.stats.counts.tolist() == st.counts.tolist()


@pytest.mark.parametrize("discount", [1.0, 0.9])
def test_linucb_keeps_its_inverses_and_scores_as_the_solves_do(discount):
    """LinUCB scores from ``A^-1`` kept up to date (the pulled arm's inverted again after each update; all after a
    discount or a restore) instead of two solves a step: the same scores as solving, and the same arm."""
    from policies.linucb import LinUCB

    def solved(p, obs):
        x = np.append(obs, 1.0)
        theta = np.linalg.solve(p.A, p.b[..., None])[..., 0]
        ax = np.linalg.solve(p.A, np.broadcast_to(x, (p.num_arms, p.dim))[..., None])[..., 0]
        return theta @ x + p.alpha * np.sqrt(np.maximum(np.einsum("kd,d->k", ax, x), 0.0))

    rng = np.random.default_rng(1)
    p = LinUCB(["none", "ngram-d1", "ngram-d3"], 12, alpha=0.7, discount=discount)
    for t in range(400):
        x = rng.uniform(0, 1, 12).astype(np.float32)
        s = p.scores(x)
        assert np.allclose(s, solved(p, x), rtol=1e-9, atol=1e-12) and np.argmax(s) == np.argmax(solved(p, x))
        p.update(x, int(np.argmax(s)), float(rng.normal()), {})
        if t == 200:  # a restored state: its own inverses, not the ones kept before
            q = LinUCB(p.arm_names, 12, alpha=0.7, discount=discount)
            q.scores(x)
            q.restore(p.state())
            assert np.allclose(q.scores(x), solved(p, x), rtol=1e-9)


def test_a_window_keeps_exactly_its_last_pulls():
    p = UCB1(["a", "b"], window=5)
    for i in range(8):
        p.update(None, i % 2, 1.0)
    # pulls 3..7 are left: a twice, b three times
    assert p.stats.counts.tolist() == [2.0, 3.0] and len(p.stats.recent) == 5


def test_linucb_learns_from_rewards_divided_by_its_scale():
    """Rewards ``scale`` times as large with that scale give the same scores."""
    x = np.array([0.2, 0.5, 0.9])
    scores = []
    for scale in (1.0, 4.0):
        p = LinUCB(["a", "b", "c"], 3, alpha=0.5, scale=scale)
        r = np.random.default_rng(1)
        for _ in range(300):
            z = r.random(3)
            a = p.act(z)
            p.update(z, a, float(z[a]) * scale, {})
        scores.append(p.scores(x))
    np.testing.assert_allclose(scores[0], scores[1], rtol=1e-9)


def test_discounted_linucb_keeps_its_regularizer():
    """D-LinUCB: A <- g A + x x^T + (1 - g) lam I; from A = lam I the (1 - g) lam I term keeps A's smallest
    eigenvalue at least lam (an A that forgets it becomes near singular along directions the contexts leave)."""
    p = LinUCB(["a", "b", "c"], 3, alpha=0.5, discount=0.9)
    r = np.random.default_rng(1)
    for _ in range(300):
        x = r.random(3)
        a = p.act(x)
        p.update(x, a, float(x[a]), {})
    assert min(float(np.linalg.eigvalsh(A).min()) for A in p.A) >= p.lam * (1 - 1e-9)
