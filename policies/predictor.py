"""Accept-length predictors (AdaEAGLE, arXiv 2412.18910; dynamic depth decoding, arXiv 2409.00142): a
scikit-learn regressor, trained from recorded traces, predicts from the observation how many draft tokens each arm
would get accepted and what its step would cost (in autoregressive steps); the policy picks the arm with the most
predicted tokens per unit cost, ``(accept_k + 1) / cost_k`` (``objective="ratio"``), or by default the arm whose
tokens most exceed what its cost buys at the policy's own speedup ``rate``, ``accept_k + 1 - rate * cost_k``
(``"margin"``: maximizing a ratio of sums step by step, Dinkelbach 1967; the ratio rule is myopic, preferring a
cheap one-token step to a long draft that pays more in total).

Training data comes from replay (``env.replay``): at every visited (prompt, position) the trace gives the true
accepted length and cost of *every* arm (full information), so one visited state labels all K outputs. The states
are visited by a uniformly random behaviour first, then by the learned policy itself (DAgger-style rounds), so that
the history features the policy sees at test time are covered.

Models: ``mlp`` (``MLPRegressor``) or ``ridge``, both fitted on standardized inputs and outputs. The fitted weights
are saved as plain arrays (no pickle) and the forward pass runs in numpy, tens of microseconds per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from env.replay import ReplayTables
from policies.base import BasePolicy, PolicyError, real
from policies.net_arrays import MODELS, SCALE_FLOOR, NetArrays, check_net_params
from policies.oracle import rollout_actions

OBJECTIVES = ("margin", "ratio")
__all__ = ["MODELS", "OBJECTIVES", "SCALE_FLOOR", "PredictorPolicy", "train_predictor", "fit_rate"]


class PredictorPolicy(NetArrays, BasePolicy):
    type_name = "predictor"
    kind = "predictor"

    def __init__(
        self,
        arms: Sequence[str],
        obs_size: int = 0,
        features: Sequence[str] | None = None,
        *,
        model: str = "mlp",
        hidden: int = 64,
        layers: int = 2,
        alpha: float = 1e-4,
        max_iter: int = 300,
        objective: str = "margin",
        rate: float = 1.0,
        seed: int = 0,
    ) -> None:
        super().__init__(arms, obs_size, features)
        if objective not in OBJECTIVES:
            raise PolicyError(f"unknown predictor objective {objective!r}; valid: {', '.join(OBJECTIVES)}")
        self.objective, self.rate = objective, float(real("predictor rate", rate, lo=0.0, hi=1e6))
        if model not in MODELS:  # (checked in this order since the first predictor)
            raise PolicyError(f"unknown predictor model {model!r}; valid: {', '.join(MODELS)}")
        if self.obs_size < 1:
            raise PolicyError("the predictor needs an observation (obs_size >= 1)")
        check_net_params(model, hidden, layers, alpha, max_iter, None, "predictor")
        real("seed", seed, lo=0, hi=2**32 - 1, integer=True)  # scikit-learn's random_state range
        self.model, self.hidden, self.layers = model, int(hidden), int(layers)
        self.alpha, self.max_iter, self.seed = float(alpha), int(max_iter), int(seed)
        self.init_net(self.obs_size, 2 * self.num_arms)

    def params(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "hidden": self.hidden,
            "layers": self.layers,
            "alpha": self.alpha,
            "max_iter": self.max_iter,
            "objective": self.objective,
            "rate": self.rate,
            "seed": self.seed,
        }

    # ---- fitting (scikit-learn) and prediction (numpy) ----
    def fit(self, x: np.ndarray, accept: np.ndarray, rel_cost: np.ndarray) -> PredictorPolicy:
        """x: [N, F] observations; accept, rel_cost: [N, K] every arm's accepted length and cost / AR cost."""
        accept, rel_cost = np.asarray(accept), np.asarray(rel_cost)
        for what, a in (("accept", accept), ("rel_cost", rel_cost)):
            if a.ndim != 2 or a.shape[1] != self.num_arms:
                raise PolicyError(
                    f"the predictor's {what} must be [N, {self.num_arms}] (one per arm), got {a.shape}"
                )
        y = np.concatenate([accept, rel_cost], axis=1)
        self.fit_net(x, y, model=self.model, hidden=self.hidden, layers=self.layers, alpha=self.alpha,
                     max_iter=self.max_iter, seed=self.seed)  # fmt: skip
        return self

    def predict(self, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(accepted length, cost in AR steps) of every arm: [K] each, or [B, K] for a batch of observations."""
        if not self.fitted:
            raise PolicyError("the predictor is not trained (draftgym train, or PredictorPolicy.fit)")
        y = self.forward(obs)
        k = self.num_arms
        return y[..., :k], y[..., k:]

    def scores(self, obs: np.ndarray) -> np.ndarray:
        """Every arm's score: predicted tokens per unit cost (``ratio``), or tokens beyond what the step's cost
        buys at the policy's own rate (``margin``: ``tokens - rate * cost``). Tokens: the predicted accepted drafts
        (none where the prediction is negative) + 1, the bonus token; cost in AR steps, floored at 0.05."""
        acc, cost = self.predict(obs)
        tokens, cost = np.maximum(acc, 0.0) + 1.0, np.maximum(cost, 0.05)
        return tokens / cost if self.objective == "ratio" else tokens - self.rate * cost

    def act(self, obs: np.ndarray | None) -> int:
        return int(np.argmax(self._finite(self.scores(self._check_obs(obs)))))

    def act_batch(self, obs: np.ndarray) -> np.ndarray:
        return np.argmax(self._finite(self.scores(self._check_batch(obs))), axis=-1)

    @staticmethod
    def _finite(scores: np.ndarray) -> np.ndarray:
        """``scores``, refused when one overflowed (argmax would pick arm 0 whatever they said)."""
        if not np.isfinite(scores).all():
            raise PolicyError("the predictor's scores overflow at this observation (corrupted weights?)")
        return scores

    # ---- saving ----
    def state(self) -> dict[str, bytes]:
        return self.net_state()

    def restore(self, files: dict[str, bytes]) -> None:
        self.restore_net(files, f"{self.obs_size} features and {self.num_arms} arms", probe=self.scores)


# ---- training data from replay -------------------------------------------------------------------------------------


def collect(
    tb: ReplayTables, prompts: np.ndarray, behavior, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Replay every prompt once under ``behavior(obs [B, F], rng) -> actions [B]``; returns the observations it
    saw [N, F] and their global positions [N]."""
    xs, gs = [], []

    def choose(obs: np.ndarray, p: np.ndarray, pos: np.ndarray) -> np.ndarray:
        xs.append(obs)
        gs.append(tb.offset[p] + pos)
        return behavior(obs, rng)

    rollout_actions(tb, prompts, choose)
    return np.concatenate(xs), np.concatenate(gs)


def labels(tb: ReplayTables, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every arm's accepted length and cost in AR steps at global positions g: [N, K] each."""
    accept = tb.accept[:, g].T.astype(np.float64)
    rel_cost = (tb.cost[:, g] / tb.ar_cost[g][None, :]).T.astype(np.float64)
    return accept, rel_cost


def train_predictor(
    env: Any, *, rounds: int = 3, passes: int = 4, epsilon: float = 0.2, seed: int = 0, **params: Any
) -> PredictorPolicy:
    """Fit a predictor on the replay env ``env`` (a ``SpecDecodeEnv``; its trace holds the training prompts only).

    Round 0 visits states with a uniformly random arm each step; each later round adds ``passes`` replays of every
    prompt under the current predictor (with ``epsilon`` random steps) and refits on everything. The ``margin``
    objective's ``rate`` is fitted after every round (``fit_rate``) unless ``params`` gives one."""
    tb: ReplayTables = env.tables
    prompts = np.asarray(tb.startable, dtype=np.int64)
    rng = np.random.default_rng(seed)
    k = len(env.arm_names)
    policy = PredictorPolicy(env.arm_names, len(env.feature_names), env.feature_names, seed=seed, **params)

    def random_arms(obs: np.ndarray, r: np.random.Generator) -> np.ndarray:
        return r.integers(k, size=obs.shape[0])

    def learned(obs: np.ndarray, r: np.random.Generator) -> np.ndarray:
        acts = policy.act_batch(obs)
        explore = r.random(obs.shape[0]) < epsilon
        return np.where(explore, r.integers(k, size=obs.shape[0]), acts)

    xs, gs = [], []
    for rnd in range(max(rounds, 1)):
        behavior = random_arms if rnd == 0 else learned
        for _ in range(passes):
            x, g = collect(tb, prompts, behavior, rng)
            xs.append(x)
            gs.append(g)
        x_all, g_all = np.concatenate(xs), np.concatenate(gs)
        policy.fit(x_all.astype(np.float64), *labels(tb, g_all))
        if policy.objective == "margin" and "rate" not in params:  # a rate given is kept as given
            fit_rate(policy, tb, prompts)
    return policy


def fit_rate(policy: PredictorPolicy, tb: ReplayTables, prompts: np.ndarray, iters: int = 4) -> float:
    """Dinkelbach's iteration for the ``margin`` objective: the best rate is the speedup of the policy that
    maximizes ``tokens - rate * cost`` at each step. Start from the ratio rule's speedup, replay the training
    prompts with each new rate, keep the rate whose policy was fastest."""

    def speedup() -> float:
        ar_s, cost_s, *_ = rollout_actions(tb, prompts, lambda obs, p, pos: policy.act_batch(obs))
        return float(ar_s.sum() / cost_s.sum())

    policy.objective = "ratio"
    rate = speedup()
    policy.objective = "margin"
    best = (-np.inf, rate)
    for _ in range(iters):
        policy.rate = rate
        got = speedup()
        best = max(best, (got, rate))
        if abs(got - rate) < 1e-3:
            break
        rate = got
    policy.rate = best[1]
    return policy.rate
