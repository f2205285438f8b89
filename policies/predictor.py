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

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from env.replay import ReplayTables
from policies.base import BasePolicy, PolicyError, npz_bytes, read_npz, real
from policies.oracle import rollout_actions

MODELS = ("mlp", "ridge")
OBJECTIVES = ("margin", "ratio")
SCALE_FLOOR = 1e-6  # the smallest standard deviation a standardization divides by


class PredictorPolicy(BasePolicy):
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
        self.objective, self.rate = objective, float(rate)
        if model not in MODELS:
            raise PolicyError(f"unknown predictor model {model!r}; valid: {', '.join(MODELS)}")
        if self.obs_size < 1:
            raise PolicyError("the predictor needs an observation (obs_size >= 1)")
        real("predictor hidden", hidden, lo=1, hi=1 << 16, integer=True)
        real("predictor layers", layers, lo=1, hi=64, integer=True)
        real("predictor alpha", alpha, lo=0.0, hi=1e6)
        real("predictor max_iter", max_iter, lo=1, hi=1 << 24, integer=True)
        real("predictor rate", rate, lo=0.0, hi=1e6)
        real("seed", seed, lo=0, hi=2**32 - 1, integer=True)  # scikit-learn's random_state range
        self.model, self.hidden, self.layers = model, int(hidden), int(layers)
        self.alpha, self.max_iter, self.seed = float(alpha), int(max_iter), int(seed)
        self.weights: list[tuple[np.ndarray, np.ndarray]] = []
        self.x_mean = np.zeros(self.obs_size)
        self.x_scale = np.ones(self.obs_size)
        self.y_mean = np.zeros(2 * self.num_arms)
        self.y_scale = np.ones(2 * self.num_arms)

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

    @property
    def fitted(self) -> bool:
        return bool(self.weights)

    # ---- fitting (scikit-learn) and prediction (numpy) ----
    def fit(self, x: np.ndarray, accept: np.ndarray, rel_cost: np.ndarray) -> PredictorPolicy:
        """x: [N, F] observations; accept, rel_cost: [N, K] every arm's accepted length and cost / AR cost."""
        from sklearn.exceptions import ConvergenceWarning
        from sklearn.linear_model import Ridge
        from sklearn.neural_network import MLPRegressor
        from threadpoolctl import threadpool_limits

        y = np.concatenate([accept, rel_cost], axis=1).astype(np.float64)
        self.x_mean, self.x_scale = x.mean(0), np.maximum(x.std(0), SCALE_FLOOR)
        self.y_mean, self.y_scale = y.mean(0), np.maximum(y.std(0), SCALE_FLOOR)
        xs, ys = (x - self.x_mean) / self.x_scale, (y - self.y_mean) / self.y_scale
        # one BLAS thread (small matrices, a shared machine); max_iter is a budget, so no convergence warning
        with threadpool_limits(1), warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            if self.model == "ridge":
                reg = Ridge(alpha=self.alpha).fit(xs, ys)
                self.weights = [(reg.coef_.T.copy(), np.atleast_1d(reg.intercept_).copy())]
            else:
                reg = MLPRegressor(
                    hidden_layer_sizes=(self.hidden,) * self.layers,
                    alpha=self.alpha,
                    max_iter=self.max_iter,
                    early_stopping=True,
                    random_state=self.seed,
                ).fit(xs, ys)
                self.weights = [(w.copy(), b.copy()) for w, b in zip(reg.coefs_, reg.intercepts_)]
        return self

    def predict(self, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(accepted length, cost in AR steps) of every arm: [K] each, or [B, K] for a batch of observations."""
        if not self.fitted:
            raise PolicyError("the predictor is not trained (draftgym train, or PredictorPolicy.fit)")
        h = (np.asarray(obs, dtype=np.float64) - self.x_mean) / self.x_scale
        for i, (w, b) in enumerate(self.weights):
            h = h @ w + b
            if i < len(self.weights) - 1:
                h = np.maximum(h, 0.0)  # relu, MLPRegressor's default
        y = h * self.y_scale + self.y_mean
        k = self.num_arms
        return y[..., :k], y[..., k:]

    def scores(self, obs: np.ndarray) -> np.ndarray:
        """Every arm's score: predicted tokens per unit cost (``ratio``), or tokens beyond what the step's cost
        buys at the policy's own rate (``margin``: ``tokens - rate * cost``)."""
        acc, cost = self.predict(obs)
        tokens, cost = np.maximum(acc, 0.0) + 1.0, np.maximum(cost, 0.05)
        return tokens / cost if self.objective == "ratio" else tokens - self.rate * cost

    def act(self, obs: np.ndarray | None) -> int:
        return int(np.argmax(self._finite(self.scores(self._check_obs(obs)))))

    def act_batch(self, obs: np.ndarray) -> np.ndarray:
        return np.argmax(self._finite(self.scores(obs)), axis=-1)

    @staticmethod
    def _finite(scores: np.ndarray) -> np.ndarray:
        """``scores``, refused when one overflowed (argmax would pick arm 0 whatever they said)."""
        if not np.isfinite(scores).all():
            raise PolicyError("the predictor's scores overflow at this observation (corrupted weights?)")
        return scores

    # ---- saving ----
    def state(self) -> dict[str, bytes]:
        arrays = {
            "x_mean": self.x_mean,
            "x_scale": self.x_scale,
            "y_mean": self.y_mean,
            "y_scale": self.y_scale,
        }
        for i, (w, b) in enumerate(self.weights):
            arrays[f"w{i}"], arrays[f"b{i}"] = w, b
        return {"model.npz": npz_bytes(**arrays)}

    def restore(self, files: dict[str, bytes]) -> None:
        if "model.npz" not in files:
            raise PolicyError("predictor file has no model.npz")
        z = read_npz(files["model.npz"])
        missing = [k for k in ("x_mean", "x_scale", "y_mean", "y_scale") if k not in z]
        if missing:
            raise PolicyError(f"predictor file lacks {', '.join(missing)}")
        self.x_mean, self.x_scale, self.y_mean, self.y_scale = (
            z["x_mean"],
            z["x_scale"],
            z["y_mean"],
            z["y_scale"],
        )
        n = len([k for k in z if k.startswith("w")])
        try:
            self.weights = [(z[f"w{i}"], z[f"b{i}"]) for i in range(n)]
        except KeyError as err:
            raise PolicyError(f"predictor file: layer {err} is missing") from None
        if not n or self.x_mean.shape != (self.obs_size,) or self.weights[-1][0].ndim != 2 or (
            self.weights[-1][0].shape[1] != 2 * self.num_arms
        ):  # fmt: skip
            raise PolicyError(
                f"predictor weights are not for {self.obs_size} features and {self.num_arms} arms "
                f"(x_mean {self.x_mean.shape}, {n} layers)"
            )
        # every array as the forward uses it: real, finite, and each layer's shape chaining into the next
        named = {"x_scale": (self.x_scale, (self.obs_size,)), "y_mean": (self.y_mean, (2 * self.num_arms,)),
                 "y_scale": (self.y_scale, (2 * self.num_arms,))}  # fmt: skip
        width = self.obs_size
        for i, (w, b) in enumerate(self.weights):
            if w.ndim != 2 or w.shape[0] != width:
                raise PolicyError(f"predictor layer {i}: weight of shape {w.shape}, expected ({width}, N)")
            named[f"b{i}"] = (b, (w.shape[1],))
            width = w.shape[1]
        for name, (x, shape) in named.items():
            if x.shape != shape:
                raise PolicyError(f"predictor {name} has shape {x.shape}, expected {shape}")
        for name, x in [("x_mean", self.x_mean), *((k, v[0]) for k, v in named.items()),
                        *((f"w{i}", w) for i, (w, _) in enumerate(self.weights))]:  # fmt: skip
            if x.dtype.kind not in "fiu" or not np.isfinite(x).all():
                raise PolicyError(f"predictor {name} holds non-numeric or non-finite values")
        for name in ("x_scale", "y_scale"):  # divisors and multipliers of a standardization, floored by fit
            if (named[name][0] < SCALE_FLOOR).any():
                raise PolicyError(
                    f"predictor {name} holds values below {SCALE_FLOOR} (fit floors them there)"
                )
        # finite arrays can still overflow in the forward (scores NaN: the arm chosen would be arm 0, silently)
        with np.errstate(all="ignore"):  # (act refuses any other observation where they overflow)
            probe = self.scores(
                np.stack([self.x_mean, self.x_mean + self.x_scale, self.x_mean - self.x_scale])
            )
        if not np.isfinite(probe).all():
            raise PolicyError("predictor weights overflow: its scores at the mean observation are not finite")


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
