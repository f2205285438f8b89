"""LinUCB: a contextual bandit on the observation vector (Li, Chu, Langford & Schapire, WWW 2010, "disjoint"
model), with the discounted variant D-LinUCB (Russac, Vernade & Cappe, NeurIPS 2019) for drift.

Per arm a: ``A_a = lam I + sum x x^T`` (d x d), ``b_a = sum r x``, ``theta_a = A_a^-1 b_a``; pull
``argmax_a theta_a . x + alpha * sqrt(x^T A_a^-1 x)``. ``x`` is the observation with a constant 1 appended (a
per-arm bias). With ``discount`` g < 1 every update first shrinks all statistics: ``A <- g A + (1 - g) lam I``,
``b <- g b``. Rewards are divided by ``scale`` so that ``alpha`` is in reward-range units.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from policies.archive import npz_bytes, read_npz
from policies.base import MAX_PARAM, BasePolicy, PolicyError, real

MAX_FLOATS = 1 << 27  # the matrices of all arms: 1 GiB of float64


class LinUCB(BasePolicy):
    type_name = "linucb"
    kind = "bandit"

    def __init__(
        self,
        arms: Sequence[str],
        obs_size: int = 0,
        features: Sequence[str] | None = None,
        *,
        alpha: float = 1.0,
        lam: float = 1.0,
        scale: float = 1.0,
        discount: float = 1.0,
    ) -> None:
        super().__init__(arms, obs_size, features)
        if self.obs_size < 1:
            raise PolicyError("LinUCB needs an observation (obs_size >= 1)")
        if self.num_arms * (self.obs_size + 1) ** 2 > MAX_FLOATS:  # its matrices, one per arm
            raise PolicyError(
                f"LinUCB keeps arms x (obs_size + 1)^2 = {self.num_arms * (self.obs_size + 1) ** 2:,} floats; "
                f"at most {MAX_FLOATS:,} (fewer arms or observation entries)"
            )
        real("LinUCB alpha", alpha, lo=0, hi=MAX_PARAM)
        real("LinUCB lam", lam, lo=0, lo_open=True, hi=MAX_PARAM)
        real("LinUCB scale", scale, lo=0, lo_open=True, hi=MAX_PARAM)
        real("discount", discount, lo=0, hi=1, lo_open=True)
        self.alpha, self.lam, self.scale, self.discount = (
            float(alpha),
            float(lam),
            float(scale),
            float(discount),
        )
        self.dim = self.obs_size + 1
        self.forget()

    @property
    def name(self) -> str:
        return "linucb" + (f"-g{self.discount:g}" if self.discount < 1 else "")

    def params(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "lam": self.lam, "scale": self.scale, "discount": self.discount}

    def forget(self) -> None:
        k, d = self.num_arms, self.dim
        self.A = np.tile(np.eye(d) * self.lam, (k, 1, 1))  # [K, d, d]
        self.b = np.zeros((k, d))  # [K, d]
        self.pulls = np.zeros(k)
        self._inv: np.ndarray | None = None  # A^-1, made when first needed, then kept up to date (``_ainv``)

    def _ainv(self) -> np.ndarray:
        """``A^-1`` of every arm (without discount): inverted once, then after an update only the pulled arm's again
        (Sherman-Morrison would drift), all of them after a restore. A step's act is then two matrix-vector products
        per arm instead of two solves (~1 ms a step, a live server's to pay). With a discount every update moves
        every arm, and ``scores`` solves instead (one solve for both right-hand sides)."""
        if self._inv is None:
            self._inv = np.linalg.inv(self.A)
        return self._inv

    def _x(self, obs: np.ndarray | None) -> np.ndarray:
        return np.append(self._check_obs(obs), 1.0)

    def scores(self, obs: np.ndarray | None) -> np.ndarray:
        """The upper confidence bound of every arm at this observation (in reward units / scale)."""
        x = self._x(obs)
        if (
            self.discount < 1
        ):  # every update moves every arm: one solve for both right-hand sides, nothing kept
            both = np.linalg.solve(self.A, np.stack([self.b, np.broadcast_to(x, self.b.shape)], -1))
            theta, ainv_x = both[..., 0], both[..., 1]
            width = np.sqrt(np.maximum(np.einsum("kd,d->k", ainv_x, x), 0.0))
            return theta @ x + self.alpha * width
        inv = self._ainv()
        ainv_x = np.einsum("kij,j->ki", inv, x)  # [K, d]; A symmetric: theta . x = b . A^-1 x
        width = np.sqrt(np.maximum(np.einsum("kd,d->k", ainv_x, x), 0.0))
        return np.einsum("kd,kd->k", self.b, ainv_x) + self.alpha * width

    def act(self, obs: np.ndarray | None) -> int:
        return int(np.argmax(self.scores(obs)))

    def update(
        self, obs: np.ndarray | None, action: int, reward: float, info: dict[str, Any] | None = None
    ) -> None:
        action, reward = self._check_update(action, reward)
        x = self._x(obs)
        if self.discount < 1:
            g = self.discount
            self.A = g * self.A + (1 - g) * self.lam * np.eye(self.dim)
            self.b *= g
        self.A[action] += np.outer(x, x)
        self.b[action] += (reward / self.scale) * x
        self.pulls[action] += 1
        if self.discount < 1 or self._inv is None:
            self._inv = None
        else:
            self._inv[action] = np.linalg.inv(self.A[action])

    def state(self) -> dict[str, bytes]:
        return {"state.npz": npz_bytes(A=self.A, b=self.b, pulls=self.pulls)}

    def restore(self, files: dict[str, bytes]) -> None:
        if "state.npz" not in files:
            raise PolicyError("LinUCB file has no state.npz")
        s = read_npz(files["state.npz"])
        k, d = self.num_arms, self.dim
        got: dict[str, np.ndarray] = {}
        for name, shape in (("A", (k, d, d)), ("b", (k, d)), ("pulls", (k,))):
            if name not in s:
                raise PolicyError(f"LinUCB state has no {name}")
            x = s[name]
            if x.shape != shape:
                raise PolicyError(f"LinUCB state {name} has shape {x.shape}, expected {shape}")
            if x.dtype.kind not in "fiu":  # not complex, bool or object: every array is updated in float64
                raise PolicyError(f"LinUCB state {name} must hold real numbers, not {x.dtype}")
            with np.errstate(over="ignore"):  # a long double beyond float64's range: inf, refused below
                x = x.astype(np.float64)
            if not np.isfinite(x).all() or (name == "pulls" and (x < 0).any()):
                raise PolicyError(f"LinUCB state {name} holds non-finite or negative values")
            got[name] = x
        A = got["A"]
        try:  # lam I plus outer products: symmetric positive definite, else its solves fail mid-run
            if not np.allclose(A, A.transpose(0, 2, 1)):
                raise np.linalg.LinAlgError
            np.linalg.cholesky(A)
        except np.linalg.LinAlgError:
            raise PolicyError("LinUCB state A is not symmetric positive definite") from None
        self.A, self.b, self.pulls = A, got["b"], got["pulls"]
        self._inv = None

    @classmethod
    def from_header(cls, header: Any, files: dict[str, bytes]) -> LinUCB:
        """The payload's ``A`` checked against the header's arms and observation size before the policy is built:
        building it allocates arms x (obs_size + 1)^2 floats, which a header alone must not make it do."""
        s = read_npz(files["state.npz"]) if "state.npz" in files else {}
        d = int(header.obs_size or 0) + 1
        want = (len(header.arms), d, d)
        got = getattr(s.get("A"), "shape", None)
        if got != want:
            raise PolicyError(
                f"LinUCB state A has shape {got}, expected {want} (arms, obs_size + 1, obs_size + 1)"
            )
        return super().from_header(header, files)  # type: ignore[return-value]
