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


def run_adaptive_adversary(
    policy, k: int, horizon: int, target: Callable[[object], int]
) -> tuple[float, float]:
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


def run_linear(
    policy, thetas: np.ndarray, horizon: int, rng: np.random.Generator, noise: float = 0.1
) -> np.ndarray:
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


# ---- a synthetic replay trace with a known structure ---------------------------------------------------------------


def synthetic_trace(num_prompts: int = 24, length: int = 96, seed: int = 0, vocab: int = 1000):
    """A trace whose n-gram drafter is right for exactly ``m`` tokens at each position, where ``m`` follows a
    regime (long matches in "copy" stretches, none elsewhere) that the ``match_len`` feature reveals with noise.
    Categories alternate between "copy" (mostly copy stretches) and "free" (mostly none)."""
    from env.features import FeatureSpec, position_feature_names
    from env.trace import Trace, TreeArrays

    rng = np.random.default_rng(seed)
    spec = FeatureSpec()
    depth = 16
    ids, cats, prompts, trajs, feats, offs, toks, pars = [], [], [], [], [], [0], [], []
    for p in range(num_prompts):
        cat = "copy" if p % 2 == 0 else "free"
        n = int(length - rng.integers(0, length // 4))
        traj = rng.integers(3, vocab, size=n)
        p_copy = 0.8 if cat == "copy" else 0.15
        regime = np.repeat(rng.random(n // 8 + 1) < p_copy, 8)[:n]  # stretches of 8 positions
        m = np.where(regime, rng.integers(4, depth + 1, size=n), rng.integers(0, 2, size=n))
        feat = np.zeros((n, 4 + spec.proj_dim), dtype=np.float32)
        feat[:, :3] = rng.random((n, 3))
        feat[:, 3] = np.clip(m / depth + rng.normal(0, 0.08, size=n), 0, 1)  # match_len, noisy
        feat[:, 4:] = np.tanh(rng.normal(size=(n, spec.proj_dim)))
        for g in range(n):
            cont = traj[g + 1 : g + 1 + depth]
            chain = [
                int(cont[d]) if d < m[g] else int(cont[d] % (vocab - 3) + 3) ^ 1 for d in range(len(cont))
            ]
            if m[g] == 0 and rng.random() < 0.5:
                chain = []  # no match at all: the drafter proposes nothing
            toks.append(np.array([traj[g], *chain], dtype=np.int32))
            pars.append(np.arange(-1, len(chain), dtype=np.int16))
            offs.append(offs[-1] + len(chain) + 1)
        ids.append(str(p))
        cats.append(cat)
        prompts.append(rng.integers(3, vocab, size=20).astype(np.int32))
        trajs.append(traj.astype(np.int32))
        feats.append(feat)

    def cat_off(arrays):
        return np.concatenate(arrays), np.concatenate([[0], np.cumsum([len(a) for a in arrays])]).astype(
            np.int64
        )

    prompt_tokens, prompt_off = cat_off(prompts)
    traj, traj_off = cat_off(trajs)
    header = {
        "format": "draftgym-trace",
        "version": 1,
        "model": {
            "model_id": "synthetic",
            "vocab_size": vocab,
            "tokenizer_sha256": "0",
            "eos_ids": [2],
            "dtype": "float32",
            "hidden_size": 16,
        },  # fmt: skip
        "sampling": "greedy",
        "max_new_tokens": length,
        "features": {"spec": spec.as_dict(), "names": position_feature_names(spec)},
        "drafters": {"ngram": {"exact": True, "shape": [depth, 1, 0], "options": {}}},
        "workload": "synthetic",
        "prompts": {"ids": ids, "categories": cats},
    }
    trees = {
        "ngram": TreeArrays(np.asarray(offs, dtype=np.int64), np.concatenate(toks), np.concatenate(pars))
    }
    return Trace(header, prompt_tokens, prompt_off, traj, traj_off, np.concatenate(feats), trees)


def synthetic_cost_model(per_node: float = 0.03):
    """Verify cost ``1 + per_node * (N - 1)`` autoregressive steps for N tree nodes; drafting nearly free."""
    from env.cost import Curve, FittedCostModel

    nodes = (1, 2, 4, 8, 16, 32, 64, 128)
    secs = tuple(0.02 * (1 + per_node * (n - 1)) for n in nodes)
    return FittedCostModel(
        model_id="synthetic", dtype="float32", device="cpu", chain=Curve(nodes, secs), tree=Curve(nodes, secs),
        context_ref=128, per_context=0.0, per_node_context=0.0,
        drafters={"ngram": {"shapes": {}, "base_s": 1e-5, "per_node_s": 1e-6}},
    )  # fmt: skip


SYNTH_ARMS = ["none", "ngram-d2", "ngram-d4", "ngram-d8", "ngram-d16"]


def synthetic_env(**kwargs):
    from env.spec_env import SpecDecodeEnv

    kw = {"trace": synthetic_trace(), "arms": SYNTH_ARMS, "cost_model": synthetic_cost_model(), **kwargs}
    return SpecDecodeEnv(backend="replay", **kw)
