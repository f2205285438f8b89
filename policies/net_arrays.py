"""A regressor fitted by scikit-learn and kept as plain arrays: the accept-length predictors' network
(``policies.predictor`` for one sequence, ``policies.serve_predictor`` for the rows of a serving batch).

``NetArrays`` fits an ``MLPRegressor`` (relu) or a ``Ridge`` on standardized inputs and outputs, keeps the weights
and the standardizations as arrays, saves them as one npz (no pickle) and runs the forward in numpy, tens of
microseconds a call. A file's arrays are checked when it loads: shapes that chain from ``n_in`` inputs to ``n_out``
outputs, finite values, standardizations no smaller than fit makes them, and a forward that does not overflow
at the mean input.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from policies.archive import npz_bytes, read_npz
from policies.base import PolicyError, real

MODELS = ("mlp", "ridge")
SCALE_FLOOR = 1e-6  # the smallest standard deviation a standardization divides by


def check_net_params(
    model: str, hidden: Any, layers: Any, alpha: Any, max_iter: Any, seed: Any, what: str
) -> None:
    """The network's settings, each in range, else ``PolicyError`` naming it (``what``: the policy's name;
    ``seed`` None: not checked here)."""
    if model not in MODELS:
        raise PolicyError(f"unknown {what} model {model!r}; valid: {', '.join(MODELS)}")
    real(f"{what} hidden", hidden, lo=1, hi=1 << 12, integer=True)  # (65,536 asked for 32 GiB a layer)
    real(f"{what} layers", layers, lo=1, hi=64, integer=True)
    real(f"{what} alpha", alpha, lo=0.0, hi=1e6)
    real(f"{what} max_iter", max_iter, lo=1, hi=1 << 24, integer=True)
    if seed is not None:
        real("seed", seed, lo=0, hi=2**32 - 1, integer=True)  # scikit-learn's random_state range


class NetArrays:
    """Mixin: a fitted regressor from ``n_in`` inputs to ``n_out`` outputs as arrays. The class using it sets
    ``net_name`` (for messages), and calls ``init_net(n_in, n_out)`` before use."""

    net_name = "predictor"

    def init_net(self, n_in: int, n_out: int) -> None:
        self.n_in, self.n_out = int(n_in), int(n_out)
        self.weights: list[tuple[np.ndarray, np.ndarray]] = []
        self.x_mean, self.x_scale = np.zeros(self.n_in), np.ones(self.n_in)
        self.y_mean, self.y_scale = np.zeros(self.n_out), np.ones(self.n_out)

    @property
    def fitted(self) -> bool:
        return bool(self.weights)

    def fit_net(self, x: np.ndarray, y: np.ndarray, *, model: str, hidden: int, layers: int, alpha: float,
                max_iter: int, seed: int) -> None:  # fmt: skip
        """Fit on ``x`` [N, n_in] and ``y`` [N, n_out], both standardized (one BLAS thread: small matrices on a
        shared machine; ``max_iter`` is a budget, so no convergence warning)."""
        from sklearn.exceptions import ConvergenceWarning
        from sklearn.linear_model import Ridge
        from sklearn.neural_network import MLPRegressor
        from threadpoolctl import threadpool_limits

        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        if (
            x.ndim != 2
            or y.ndim != 2
            or x.shape[1] != self.n_in
            or y.shape[1] != self.n_out
            or len(x) != len(y)
        ):
            raise PolicyError(
                f"the {self.net_name} fits inputs [N, {self.n_in}] to outputs [N, {self.n_out}], got {x.shape} and "
                f"{y.shape}"
            )
        if not len(x) or not (np.isfinite(x).all() and np.isfinite(y).all()):
            raise PolicyError(f"the {self.net_name} fits on finite values of at least one row")
        self.x_mean, self.x_scale = x.mean(0), np.maximum(x.std(0), SCALE_FLOOR)
        self.y_mean, self.y_scale = y.mean(0), np.maximum(y.std(0), SCALE_FLOOR)
        xs, ys = (x - self.x_mean) / self.x_scale, (y - self.y_mean) / self.y_scale
        with threadpool_limits(1), warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            if model == "ridge":
                reg = Ridge(alpha=alpha).fit(xs, ys)
                self.weights = [(reg.coef_.T.copy(), np.atleast_1d(reg.intercept_).copy())]
            else:
                reg = MLPRegressor(hidden_layer_sizes=(hidden,) * layers, alpha=alpha, max_iter=max_iter,
                                   early_stopping=True, random_state=seed).fit(xs, ys)  # fmt: skip
                self.weights = [(w.copy(), b.copy()) for w, b in zip(reg.coefs_, reg.intercepts_)]

    def forward(self, x: np.ndarray) -> np.ndarray:
        """The outputs [..., n_out] at inputs [..., n_in]."""
        if not self.fitted:
            raise PolicyError(f"the {self.net_name} is not trained")
        h = (np.asarray(x, dtype=np.float64) - self.x_mean) / self.x_scale
        for i, (w, b) in enumerate(self.weights):
            h = h @ w + b
            if i < len(self.weights) - 1:
                h = np.maximum(h, 0.0)  # relu, MLPRegressor's default
        return h * self.y_scale + self.y_mean

    def net_state(self) -> dict[str, bytes]:
        if not self.fitted:  # its file would not load (the weights are what it holds)
            raise PolicyError(f"cannot save an untrained {self.net_name}")
        arrays = {
            "x_mean": self.x_mean,
            "x_scale": self.x_scale,
            "y_mean": self.y_mean,
            "y_scale": self.y_scale,
        }
        for i, (w, b) in enumerate(self.weights):
            arrays[f"w{i}"], arrays[f"b{i}"] = w, b
        return {"model.npz": npz_bytes(**arrays)}

    def restore_net(self, files: dict[str, bytes], what: str, probe: Any = None) -> None:
        """The arrays of ``files`` (``net_state``'s), every one checked; ``what``: the inputs and outputs the
        policy expects, for the message of a mismatch; ``probe``: what must be finite at the mean input and one
        standard deviation either side (default the forward; a policy passes its scores)."""
        name = self.net_name
        if "model.npz" not in files:
            raise PolicyError(f"{name} file has no model.npz")
        z = read_npz(files["model.npz"])
        missing = [k for k in ("x_mean", "x_scale", "y_mean", "y_scale") if k not in z]
        if missing:
            raise PolicyError(f"{name} file lacks {', '.join(missing)}")
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
            raise PolicyError(f"{name} file: layer {err} is missing") from None
        if not n or self.x_mean.shape != (self.n_in,) or self.weights[-1][0].ndim != 2 or (
            self.weights[-1][0].shape[1] != self.n_out
        ):  # fmt: skip
            raise PolicyError(f"{name} weights are not for {what} (x_mean {self.x_mean.shape}, {n} layers)")
        # every array as the forward uses it: real, finite, and each layer's shape chaining into the next
        named = {"x_scale": (self.x_scale, (self.n_in,)), "y_mean": (self.y_mean, (self.n_out,)),
                 "y_scale": (self.y_scale, (self.n_out,))}  # fmt: skip
        width = self.n_in
        for i, (w, b) in enumerate(self.weights):
            if w.ndim != 2 or w.shape[0] != width:
                raise PolicyError(f"{name} layer {i}: weight of shape {w.shape}, expected ({width}, N)")
            named[f"b{i}"] = (b, (w.shape[1],))
            width = w.shape[1]
        for key, (x, shape) in named.items():
            if x.shape != shape:
                raise PolicyError(f"{name} {key} has shape {x.shape}, expected {shape}")
        for key, x in [("x_mean", self.x_mean), *((k, v[0]) for k, v in named.items()),
                       *((f"w{i}", w) for i, (w, _) in enumerate(self.weights))]:  # fmt: skip
            if x.dtype.kind not in "fiu" or not np.isfinite(x).all():
                raise PolicyError(f"{name} {key} holds non-numeric or non-finite values")
        for key in ("x_scale", "y_scale"):  # divisors and multipliers of a standardization, floored by fit
            if (named[key][0] < SCALE_FLOOR).any():
                raise PolicyError(f"{name} {key} holds values below {SCALE_FLOOR} (fit floors them there)")
        # finite arrays can still overflow in the forward (a NaN score: the arm chosen would be arm 0, silently)
        with np.errstate(all="ignore"):  # (the policy refuses any other input where they overflow)
            at = np.stack([self.x_mean, self.x_mean + self.x_scale, self.x_mean - self.x_scale])
            out = (probe or self.forward)(at)
        if not np.isfinite(out).all():
            raise PolicyError(f"{name} weights overflow: its scores at the mean observation are not finite")
