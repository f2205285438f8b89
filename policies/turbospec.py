"""``TurboSpecPolicy``: SmartSpec's rule (``policies.serving.SmartSpecPolicy``) with its cost model corrected online
by the step times it serves — the closed loop of TurboSpec (Liu et al., 2024), which profiles the running system
rather than trusting an offline curve.

A calibration is a snapshot: on our CPUs a step ran 1.1–1.5× the calibration's time an hour later, and not by the
same factor for plain steps and wide trees at sixteen rows, where the choice between drafting and not hinges on a
few percent. SmartSpec prices each arm ``t_k`` with the cost model. Only the arms' prices relative to each other
decide a choice, so this policy learns how the measured curve bends away from the priced one: per batch-size
bucket, a line through the steps it served, ``log(measured / priced) = a + b * x`` with ``x = log(t_k / t_none)``
(the arm's price over a plain step's at that step) — a measured curve ``∝ priced^(1 + b)`` — fitted by least
squares over about the last ``window`` steps of that bucket, ``b`` shrunk toward 0 by a ridge of ``prior`` (in
units of ``x²``) and kept in [-0.9, 3]. Each arm is then priced ``t_k * (t_k / t_none)^b``. A machine slower
everywhere changes no choice (``a`` absorbs it); one slower for wide trees than for plain steps (``b > 0``) moves
the choice toward shallower trees, also for arms not served yet in that bucket; with steps of one price only,
``b`` is 0 and the choice is SmartSpec's. It explores nothing on its own.

The measured time comes from the live server (``env.serving.serve`` passes ``info["step_s"]``: the engine's step,
drafting, forward, verification and commit); replay passes none, so in replay this policy is SmartSpec exactly
(the times it would measure there are the cost model's own). The fit's sums are the policy's state
(``state.npz``): a saved policy starts from the cost model, and each live stream of ``evaluate --serve`` from the
saved state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from policies.archive import npz_bytes, read_npz
from policies.base import PolicyError, real
from policies.serving import SmartSpecPolicy

LOG_CLIP = (
    3.0  # |log(measured / priced)| at most: a step 20x its price (a stall, a page fault) is one outlier
)
SLOPE = (-0.9, 3.0)  # the bend b of the measured curve against the priced one: measured ~ priced^(1 + b)
SUMS = ("n", "x", "y", "xx", "xy")  # a bucket's weighted sums of 1, x, y, x^2, x*y


class TurboSpecPolicy(SmartSpecPolicy):
    """SmartSpec with its cost model's prices bent online to the step times it measures (module doc)."""

    type_name = "turbospec"
    kind = "heuristic"

    def __init__(self, arms: Sequence[str], obs_size: int = 0, features: Sequence[str] | None = None, *,
                 cost: dict[str, Any], prior: float = 0.5, window: int = 256) -> None:  # fmt: skip
        super().__init__(arms, obs_size, features, cost=cost)
        if "none" not in self.arm_names:
            raise PolicyError("TurboSpec prices arms against a plain step: its menu must hold none")
        self.prior = real("prior", prior, lo=1e-6, hi=1e6)  # (a ridge: some, or rounding decides the slope)
        self.window = int(real("window", window, lo=1, hi=1e9, integer=True))
        from env.serve_loads import levels_upto

        self.buckets = np.asarray(levels_upto(self.max_batch), np.int64)  # upper bounds of rows: 1, 2, 4, ...
        self.sums = np.zeros((len(self.buckets), len(SUMS)))
        self._plain = self.arm_names.index("none")
        self._priced: tuple[int, int, float, float] | None = None  # (bucket, arm, seconds, x) of the last act

    @property
    def name(self) -> str:
        return "turbospec"

    def params(self) -> dict[str, Any]:
        return {**super().params(), "prior": self.prior, "window": self.window}

    def bucket(self, rows: int) -> int:
        return min(int(np.searchsorted(self.buckets, max(rows, 1))), len(self.buckets) - 1)

    def slope(self, b: int) -> float:
        """The bend ``b`` fitted in bucket ``b``: ridge least squares of y on x, within ``SLOPE``."""
        n, sx, sy, sxx, sxy = self.sums[b]
        if n <= 0:
            return 0.0
        cov, var = sxy - sx * sy / n, sxx - sx * sx / n
        b = cov / (max(var, 0.0) + self.prior)
        return float(np.clip(b, *SLOPE)) if np.isfinite(b) else 0.0

    def _priced_x(self, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, np.ndarray]:
        tokens, seconds, rows = self.estimate(obs)
        x = np.log(np.maximum(seconds, 1e-12) / max(float(seconds[self._plain]), 1e-12))
        return tokens, seconds, rows, x

    def scores(self, obs: np.ndarray) -> np.ndarray:
        tokens, seconds, rows, x = self._priced_x(obs)
        return tokens / (seconds * np.exp(self.slope(self.bucket(rows)) * x))

    def act(self, obs: np.ndarray | None) -> int:
        tokens, seconds, rows, x = self._priced_x(self._check_obs(obs))
        k = int(np.argmax(tokens / (seconds * np.exp(self.slope(self.bucket(rows)) * x))))
        self._priced = (self.bucket(rows), k, float(seconds[k]), float(x[k]))
        return k

    def update(
        self, obs: np.ndarray | None, action: int, reward: float, info: dict[str, Any] | None = None
    ) -> None:
        """Learn from the step just served: ``info["step_s"]``, its measured seconds, against what the cost model
        priced for the arm chosen. Without a measurement (replay) or after another policy's act, nothing."""
        action, _ = self._check_update(action, reward)
        step_s = (info or {}).get("step_s")
        priced, self._priced = self._priced, None
        if (
            priced is None
            or priced[1] != action
            or isinstance(step_s, bool)
            or not isinstance(step_s, (int, float))
        ):
            return
        if not np.isfinite(step_s) or step_s <= 0 or priced[2] <= 0:
            return
        b, _, seconds, x = priced
        y = float(np.clip(np.log(step_s / seconds), -LOG_CLIP, LOG_CLIP))
        self.sums[b] *= 1.0 - 1.0 / self.window  # about the last ``window`` steps weigh
        self.sums[b] += (1.0, x, y, x * x, x * y)

    def reset(self) -> None:
        self._priced = None

    def state(self) -> dict[str, bytes]:
        return {"state.npz": npz_bytes(sums=self.sums)}

    def restore(self, files: dict[str, bytes]) -> None:
        if "state.npz" not in files:
            raise PolicyError("turbospec file has no state.npz")
        x = read_npz(files["state.npz"]).get("sums")
        shape = (len(self.buckets), len(SUMS))
        if x is None:
            raise PolicyError("turbospec state has no sums")
        if x.shape != shape or x.dtype.kind not in "fiu":
            raise PolicyError(f"turbospec state sums must be real numbers of shape {shape}")
        with np.errstate(over="ignore"):
            sums = x.astype(np.float64)
        if not np.isfinite(sums).all() or (sums[:, 0] < 0).any() or (sums[:, 0] > self.window).any():
            raise PolicyError(f"turbospec state sums must be finite, with step weights in [0, {self.window}]")
        n, sx, sy, sxx, sxy = sums.T
        # what the updates can make: |x| and |y| bounded, x^2 >= 0, and a variance that is not negative
        xmax = float(np.log(1e12))  # x: the log of a price over a plain step's (each clamped at 1e-12 s)
        ok = (
            (np.abs(sx) <= xmax * n * (1 + 1e-9)).all()
            and (np.abs(sy) <= LOG_CLIP * n * (1 + 1e-9)).all()
            and (sxx >= 0).all()
            and (sxx <= xmax * xmax * n * (1 + 1e-9)).all()
            and (np.abs(sxy) <= xmax * LOG_CLIP * n * (1 + 1e-9)).all()
            and (n * sxx - sx * sx >= -1e-6 * np.maximum(n * sxx, 1.0)).all()
        )
        if not ok:
            raise PolicyError(
                "turbospec state sums are not sums of its updates (moments out of their bounds)"
            )
        self.sums = sums


__all__ = ["TurboSpecPolicy"]
