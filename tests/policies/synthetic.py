"""Synthetic bandit problems with known answers: Bernoulli arms with known means (stationary, or switching),
an adaptive adversary, and a linear contextual problem. Every run takes an explicit np.random.Generator."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def run_stochastic(
    policy, means: np.ndarray | Callable[[int], np.ndarray], horizon: int, rng: np.random.Generator
) -> np.ndarray:
    """Pseudo-regret curve ``R[t] = sum_{s<=t} (max_i mu_i(s) - mu_{a_s}(s))`` of ``policy`` on Bernoulli arms."""
    regret = np.empty(horizon)
    total = 0.0
    for t in range(horizon):
        mu = means(t) if callable(means) else means
        a = policy.act(None)
        r = float(rng.random() < mu[a])
        policy.update(None, a, r, {})
        total += float(mu.max() - mu[a])
        regret[t] = total
    return regret


def auer_ucb1_bound(means: np.ndarray, horizon: int) -> float:
    """Auer, Cesa-Bianchi & Fischer (2002), Theorem 1: ``8 sum ln T / Delta_i + (1 + pi^2/3) sum Delta_i``."""
    gaps = means.max() - means
    gaps = gaps[gaps > 0]
    return float(8 * np.sum(np.log(horizon) / gaps) + (1 + np.pi**2 / 3) * gaps.sum())


def exp3_bound(k: int, gain_max: float) -> float:
    """Auer et al. (2002b), Corollary 3.2: weak regret ``<= 2 sqrt(e - 1) sqrt(g K ln K)``."""
    return float(2 * np.sqrt(np.e - 1) * np.sqrt(gain_max * k * np.log(k)))


def run_adaptive_adversary(policy, k: int, horizon: int, target: Callable[[object], int]) -> tuple[float, float]:
    """Each round the adversary sets reward 0 on the arm ``target(policy)`` (its guess of the learner's pull) and
    1 on every other arm, before the learner pulls. Returns (learner's total reward, best fixed arm's total)."""
    per_arm = np.zeros(k)
    got = 0.0
    for _ in range(horizon):
        x = np.ones(k)
        x[target(policy)] = 0.0
        a = policy.act(None)
        got += x[a]
        per_arm += x
        policy.update(None, a, float(x[a]), {})
    return got, float(per_arm.max())


def run_linear(policy, thetas: np.ndarray, horizon: int, rng: np.random.Generator, noise: float = 0.1) -> np.ndarray:
    """Contextual regret curve on ``r = theta_a . x + noise`` with x uniform on [0, 1]^d."""
    d = thetas.shape[1]
    regret = np.empty(horizon)
    total = 0.0
    for t in range(horizon):
        x = rng.random(d)
        mu = thetas @ x
        a = policy.act(x)
        policy.update(x, a, float(mu[a] + noise * rng.standard_normal()), {})
        total += float(mu.max() - mu[a])
        regret[t] = total
    return regret
