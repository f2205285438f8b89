"""Multi-armed bandits over the arm menu, learned online inside the decoder (BanditSpec, arXiv 2505.15141;
MetaSD). The reward of a pull is the step's instantaneous speedup (tokens committed / step cost, in units of one
autoregressive token).

- ``UCB1`` (Auer, Cesa-Bianchi & Fischer 2002): index ``mean_i + scale * sqrt(2 ln n / n_i)``; expected regret
  ``<= 8 sum_i ln T / Delta_i + (1 + pi^2 / 3) sum_i Delta_i`` for rewards in [0, scale].
- ``ThompsonSampling`` (Agrawal & Goyal 2013, Gaussian priors): with ``n_i`` pulls of arm i summing to ``S_i``,
  draw ``theta_i ~ N(S_i / (n_i + 1), scale^2 / (n_i + 1))`` (the posterior of a N(0, scale^2) prior under
  N(mu_i, scale^2) rewards) and pull the argmax.
- ``EXP3`` (Auer et al. 2002b) for adversarial rewards: exponential weights on importance-weighted rewards mixed
  with ``gamma`` uniform exploration; weak regret ``<= (e - 1) gamma G + K ln K / gamma`` against the best fixed
  arm. With ``share > 0`` it is EXP3.S, which tracks an arm that changes (regret against switching sequences).

Drift within a generation: ``discount`` (< 1) forgets old pulls geometrically (discounted UCB, Garivier &
Moulines 2011) and ``window`` (> 0) keeps only the last ``window`` pulls (sliding-window UCB); both apply to UCB1
and Thompson sampling. Statistics persist across ``reset()`` (episodes), so a saved bandit warm-starts the next
run; ``forget()`` clears them.
"""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from policies.archive import json_bytes
from policies.base import MAX_PARAM, MAX_STEPS, BasePolicy, PolicyError, real


class ArmStats:
    """Pull counts and reward sums per arm, optionally discounted or windowed."""

    def __init__(self, k: int, discount: float = 1.0, window: int = 0) -> None:
        if not 0 < discount <= 1:
            raise PolicyError(f"discount must be in (0, 1], got {discount}")
        if window < 0:
            raise PolicyError(f"window must be >= 0, got {window}")
        if window and discount < 1:
            raise PolicyError("a bandit forgets by discount or by window, not both")
        self.k, self.discount, self.window = k, float(discount), int(window)
        self.counts = np.zeros(k)
        self.sums = np.zeros(k)
        self.sq = np.zeros(k)
        self.total_pulls = 0
        self.recent: deque[tuple[int, float]] = deque()

    def add(self, arm: int, reward: float) -> None:
        if self.discount < 1:
            for a in (self.counts, self.sums, self.sq):
                a *= self.discount
        self.counts[arm] += 1
        self.sums[arm] += reward
        self.sq[arm] += reward * reward
        self.total_pulls += 1
        if self.window:
            self.recent.append((arm, reward))
            if len(self.recent) > self.window:
                old, r = self.recent.popleft()
                self.counts[old] -= 1
                self.sums[old] -= r
                self.sq[old] -= r * r
                self.counts[old] = max(self.counts[old], 0.0)
                self.sq[old] = max(
                    self.sq[old], 0.0
                )  # a sum of squares: its rounding residue may dip below 0
                if (
                    self.counts[old] < 1e-9
                ):  # every pull of the arm left: no rounding residue (sq < 0 would not load)
                    self.counts[old] = self.sums[old] = self.sq[old] = 0.0

    def means(self, prior: float = 0.0) -> np.ndarray:
        return np.where(self.counts > 1e-12, self.sums / np.maximum(self.counts, 1e-12), prior)

    def to_json(self) -> dict[str, Any]:
        return {
            "counts": self.counts.tolist(),
            "sums": self.sums.tolist(),
            "sq": self.sq.tolist(),
            "total_pulls": self.total_pulls,
            "recent": list(self.recent),
        }

    def load_json(self, s: dict[str, Any]) -> None:
        try:
            for name in ("counts", "sums", "sq"):
                v = np.asarray(s[name], dtype=np.float64)
                if v.shape != (self.k,):
                    raise PolicyError(f"bandit state has {v.shape} for {name}, expected ({self.k},)")
                if not np.isfinite(v).all() or (name != "sums" and (v < 0).any()):
                    raise PolicyError(f"bandit state {name} holds non-finite or negative values")
                setattr(self, name, v)
            total = s["total_pulls"]
            if isinstance(total, bool) or not isinstance(total, int) or total < 0:
                raise PolicyError(f"bandit state total_pulls is {total!r}, not a count")
            self.total_pulls = total
            recent = [(int(a), float(r)) for a, r in s.get("recent", [])]
        except (KeyError, TypeError, ValueError) as err:
            raise PolicyError(f"bandit state is malformed ({err})") from None
        if any(not 0 <= a < self.k or not np.isfinite(r) for a, r in recent):
            raise PolicyError(
                f"bandit state recent pulls name arms outside 0..{self.k - 1} or non-finite rewards"
            )
        self.recent = deque(recent)


class Bandit(BasePolicy):
    """Shared state of the bandits: arm statistics, a seeded RNG, JSON save/restore."""

    kind = "bandit"

    def __init__(
        self,
        arms: Sequence[str],
        obs_size: int = 0,
        features: Sequence[str] | None = None,
        *,
        scale: float = 1.0,
        discount: float = 1.0,
        window: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__(arms, obs_size, features)
        real("reward scale", scale, lo=0, lo_open=True, hi=MAX_PARAM)
        real("discount", discount, lo=0, hi=1, lo_open=True)
        real("window", window, lo=0, hi=MAX_STEPS, integer=True)
        real("seed", seed, lo=0, hi=2**63 - 1, integer=True)
        self.scale, self.seed = float(scale), int(seed)
        self.stats = ArmStats(self.num_arms, discount, window)
        self.rng = np.random.default_rng(seed)

    @property
    def name(self) -> str:
        tail = f"-g{self.stats.discount:g}" if self.stats.discount < 1 else ""
        tail += f"-w{self.stats.window}" if self.stats.window else ""
        return self.type_name + tail

    def params(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "discount": self.stats.discount,
            "window": self.stats.window,
            "seed": self.seed,
        }

    def forget(self) -> None:
        """Drop everything learned (a cold start)."""
        self.stats = ArmStats(self.num_arms, self.stats.discount, self.stats.window)
        self.rng = np.random.default_rng(self.seed)

    def update(
        self, obs: np.ndarray | None, action: int, reward: float, info: dict[str, Any] | None = None
    ) -> None:
        self.stats.add(*self._check_update(action, reward))

    def extra_state(self) -> dict[str, Any]:
        return {}

    def load_extra(self, s: dict[str, Any]) -> None:
        pass

    def state(self) -> dict[str, bytes]:
        s = {"stats": self.stats.to_json(), "rng": self.rng.bit_generator.state, **self.extra_state()}
        return {"state.json": json_bytes(s)}

    def restore(self, files: dict[str, bytes]) -> None:
        if "state.json" not in files:
            raise PolicyError("bandit file has no state.json")
        s = json.loads(files["state.json"])
        self.stats.load_json(s["stats"])
        self.rng.bit_generator.state = s["rng"]
        self.load_extra(s)

    def _untried(self) -> int | None:
        """Round-robin warm-up: an arm never pulled (in the current window) is pulled first."""
        untried = np.flatnonzero(self.stats.counts < 1e-9)
        return int(untried[0]) if untried.size else None


class UCB1(Bandit):
    """Upper confidence bound; ``scale`` is the reward range (rewards are assumed in [0, scale])."""

    type_name = "ucb1"

    def __init__(self, *args: Any, c: float = 1.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.c = float(real("ucb1 c", c, lo=0, hi=MAX_PARAM))

    def params(self) -> dict[str, Any]:
        return {**super().params(), "c": self.c}

    def act(self, obs: np.ndarray | None) -> int:
        first = self._untried()
        if first is not None:
            return first
        n = self.stats.counts
        bonus = self.c * self.scale * np.sqrt(2.0 * math.log(max(n.sum(), 1.0 + 1e-9)) / n)
        return int(np.argmax(self.stats.means() + bonus))


class ThompsonSampling(Bandit):
    """Gaussian Thompson sampling (Agrawal & Goyal 2013, Algorithm 2): posterior ``N(S_i / (n_i + 1), scale^2 /
    (n_i + 1))`` per arm, ``S_i`` the sum of its rewards over ``n_i`` pulls (discounted or windowed, where set)."""

    type_name = "thompson"

    def act(self, obs: np.ndarray | None) -> int:
        n, s = self.stats.counts, self.stats.sums
        # mu_hat_i = S_i / (n_i + 1), not S_i / n_i: the prior's pseudo-pull at 0
        theta = self.rng.normal(s / (n + 1.0), self.scale / np.sqrt(n + 1.0))
        return int(np.argmax(theta))


class EXP3(Bandit):
    """Exponential weights for exploration and exploitation (rewards clipped to [0, scale], then scaled to [0, 1]).

    ``gamma``: uniform exploration rate; None tunes it for ``horizon`` pulls,
    ``min(1, sqrt(K ln K / ((e - 1) horizon)))`` (Auer et al. 2002b, Corollary 3.2). ``share``: EXP3.S weight
    sharing, which lets the weights follow an arm that becomes the best."""

    type_name = "exp3"

    def __init__(
        self, *args: Any, gamma: float | None = None, horizon: int = 10_000, share: float = 0.0, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        k = self.num_arms
        real("exp3 horizon", horizon, lo=1, hi=MAX_STEPS, integer=True)
        real("exp3 share", share, lo=0, hi=1)
        if gamma is not None:
            real("exp3 gamma", gamma, lo=0, hi=1, lo_open=True)
        if gamma is None:
            gamma = min(1.0, math.sqrt(k * math.log(max(k, 2)) / ((math.e - 1) * max(horizon, 1))))
        if not 0 < gamma <= 1:
            raise PolicyError(f"exp3 gamma must be in (0, 1], got {gamma}")
        if share < 0:
            raise PolicyError(f"exp3 share must be >= 0, got {share}")
        self.gamma, self.horizon, self.share = float(gamma), int(horizon), float(share)
        self.log_w = np.zeros(k)
        self.probs = np.full(k, 1.0 / k)

    @property
    def name(self) -> str:
        return "exp3.s" if self.share > 0 else "exp3"

    def params(self) -> dict[str, Any]:
        return {**super().params(), "gamma": self.gamma, "horizon": self.horizon, "share": self.share}

    def forget(self) -> None:
        super().forget()
        self.log_w = np.zeros(self.num_arms)

    def distribution(self) -> np.ndarray:
        w = np.exp(self.log_w - self.log_w.max())
        return (1 - self.gamma) * w / w.sum() + self.gamma / self.num_arms

    def act(self, obs: np.ndarray | None) -> int:
        self.probs = self.distribution()
        return int(self.rng.choice(self.num_arms, p=self.probs))

    def update(
        self, obs: np.ndarray | None, action: int, reward: float, info: dict[str, Any] | None = None
    ) -> None:
        super().update(obs, action, reward, info)
        action, reward = int(action), float(reward)
        k = self.num_arms
        x = float(np.clip(reward / self.scale, 0.0, 1.0))
        xhat = x / max(self.probs[action], 1e-12)  # importance-weighted reward; 0 for the arms not pulled
        gain = np.zeros(k)
        gain[action] = self.gamma * xhat / k
        if self.share > 0:
            # EXP3.S (Auer et al. 2002b): w_i(t+1) = w_i(t) exp(gamma xhat_i / K) + (e alpha / K) sum_j w_j(t),
            # the shared mass taken from the weights before this update; in logs, for range
            shared = math.log(math.e * self.share / k) + np.logaddexp.reduce(self.log_w)
            self.log_w = np.logaddexp(self.log_w + gain, shared)
        else:
            self.log_w = self.log_w + gain
        self.log_w -= self.log_w.max()  # keep the weights in range; probabilities are unchanged

    def extra_state(self) -> dict[str, Any]:
        return {"log_w": self.log_w.tolist()}

    def load_extra(self, s: dict[str, Any]) -> None:
        try:
            log_w = np.asarray(s["log_w"], dtype=np.float64)
        except (TypeError, ValueError):
            raise PolicyError("exp3 state log_w is not a list of numbers") from None
        if log_w.shape != (self.num_arms,):
            raise PolicyError(f"exp3 state has weights of shape {log_w.shape}, expected ({self.num_arms},)")
        if not np.isfinite(log_w).all():  # NaN weights act on nothing: refused here, not found mid-run
            raise PolicyError("exp3 state log_w holds non-finite values")
        self.log_w = log_w
        self.probs = self.distribution()


BANDITS: dict[str, type[Bandit]] = {"ucb1": UCB1, "thompson": ThompsonSampling, "exp3": EXP3}
