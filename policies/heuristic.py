"""Hand-written schedules for the draft length.

- ``HFSchedulePolicy``: the Hugging Face assisted-generation heuristic schedule: the draft length grows by 2 after a
  step whose drafts were all accepted and shrinks by 1 otherwise, starting again from its initial length every
  sequence — transformers' ``num_assistant_tokens_schedule = "heuristic_transient"`` (``"heuristic"`` keeps the
  length across ``generate`` calls).
- ``ConfidencePolicy``: a confidence-threshold stop in the style of DISCO (arXiv 2405.04304) and transformers'
  ``assistant_confidence_threshold``: keep drafting while the estimated probability that the next draft token is
  accepted stays above a threshold (default 0.4, the transformers default); the threshold is re-fitted online
  from (estimated probability, accepted?) pairs at the ROC point minimising ``fpr + 3 * fnr`` (DISCO's rule).

Both map their draft length onto the arm menu: the chain arm of the policy's drafter with the largest depth not
above it (the shallowest arm when none is), and the "none" arm for length 0.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from policies.archive import json_bytes
from policies.base import BasePolicy, PolicyError, real


def chain_arms(arm_names: Sequence[str], drafter: str | None = None) -> tuple[str, dict[int, int]]:
    """The drafter (the one with most chain arms unless given) and its chain arms: depth -> arm index.

    Depth 0 is the "none" arm when the menu has one."""
    from env.engine import parse_arm

    arms = [parse_arm(a) for a in arm_names]
    chains: dict[str, dict[int, int]] = {}
    for i, a in enumerate(arms):
        if a.drafter is not None and a.shape.topk == 1:
            chains.setdefault(a.drafter, {})[a.shape.depth] = i
    if drafter is None:
        if not chains:
            raise PolicyError(f"the arm menu {list(arm_names)} has no chain arm (DRAFTER-dN) to schedule")
        drafter = max(chains, key=lambda d: len(chains[d]))
    if drafter not in chains:
        raise PolicyError(f"the arm menu {list(arm_names)} has no chain arm of drafter {drafter!r}")
    by_depth = dict(chains[drafter])
    for i, a in enumerate(arms):
        if a.drafter is None:
            by_depth[0] = i
    return drafter, by_depth


def arm_for_length(by_depth: dict[int, int], length: float) -> int:
    """The arm with the largest depth <= length (the shallowest drafting arm when none is)."""
    fit = [d for d in by_depth if d <= length and (d > 0 or length < 1)]
    if fit:
        return by_depth[max(fit)]
    return by_depth[min(d for d in by_depth if d > 0)]


def _accepted(info: dict[str, Any], who: str) -> tuple[int | None, int | None]:
    """(accepted, drafted) from a step's info (the env's keys, or the decoder's StepResult under "step"): counts
    >= 0 or None (absent); anything else is a ``PolicyError`` (a NaN counted as a rejection)."""
    from numbers import Integral

    if not isinstance(info, dict):
        raise PolicyError(f"{who}: update's info must be a dict, got {type(info).__name__}")
    step = info.get("step")
    out = []
    for key in ("accepted", "drafted"):
        v = info.get(key, getattr(step, key, None))
        if v is not None and (isinstance(v, (bool, np.bool_)) or not isinstance(v, Integral) or v < 0):
            raise PolicyError(f"{who}: update's info {key} must be a count >= 0, got {repr(v)[:40]}")
        out.append(None if v is None else int(v))
    return out[0], out[1]


class HFSchedulePolicy(BasePolicy):
    """Draft length +2 when every draft token was accepted, -1 otherwise (never below ``min_depth``)."""

    type_name = "hf_schedule"
    kind = "heuristic"
    warm_start = False  # its update only moves the current episode's length: nothing to learn ahead of time

    def __init__(
        self,
        arms: Sequence[str],
        obs_size: int = 0,
        features: Sequence[str] | None = None,
        *,
        drafter: str | None = None,
        initial: int | None = None,
    ) -> None:
        super().__init__(arms, obs_size, features)
        self.drafter, self.by_depth = chain_arms(self.arm_names, drafter)
        depths = sorted(d for d in self.by_depth if d > 0)
        self.min_depth, self.max_depth = depths[0], depths[-1]
        if initial is not None and (isinstance(initial, bool) or initial not in depths):
            raise PolicyError(
                f"hf-schedule initial depth must be one of the menu's depths {depths}, got {initial!r}"
            )
        self.initial = int(initial) if initial is not None else depths[len(depths) // 2]
        self.depth = self.initial
        self.depth_of = {i: d for d, i in self.by_depth.items()}

    @property
    def name(self) -> str:
        return "hf-schedule"

    def params(self) -> dict[str, Any]:
        return {"drafter": self.drafter, "initial": self.initial}

    def reset(self) -> None:
        self.depth = self.initial

    def act(self, obs: np.ndarray | None) -> int:
        return arm_for_length(self.by_depth, self.depth)

    def update(self, obs: np.ndarray | None, action: int, reward: float, info: dict[str, Any]) -> None:
        action, _ = self._check_update(action, reward)
        accepted, drafted = _accepted(info, self.name)
        arm_depth = self.depth_of.get(int(action), 0)
        if accepted is None or arm_depth == 0 or drafted == 0:
            return  # nothing was drafted: nothing to learn about the length
        if accepted >= arm_depth:
            self.depth = min(self.depth + 2, self.max_depth)
        else:
            self.depth = max(self.depth - 1, self.min_depth)


MAX_WINDOW = 1 << 20  # the confidence policy's (probability, accepted) pairs kept at most


def roc_threshold(probs: np.ndarray, accepted: np.ndarray, fn_weight: float = 3.0) -> float | None:
    """The threshold t minimising ``fpr + fn_weight * fnr`` for the rule "predict accepted iff p >= t"."""
    pos, neg = int(accepted.sum()), int((~accepted).sum())
    if pos == 0 or neg == 0:
        return None
    cands = np.unique(probs)
    best, best_t = np.inf, None
    for t in cands:
        pred = probs >= t
        fpr = (pred & ~accepted).sum() / neg
        fnr = (~pred & accepted).sum() / pos
        cost = fpr + fn_weight * fnr
        if cost < best:
            best, best_t = cost, float(t)
    return best_t


class ConfidencePolicy(BasePolicy):
    """Draft while the estimated acceptance probability of the next draft token stays >= ``threshold``.

    The per-token acceptance estimate ``a`` is an observation feature (``feature``; by default the target's top-1
    probability at the root, the analogue of the draft confidence that DISCO and transformers threshold). The probability that the i-th draft
    token is accepted is then ``a**i`` (i.i.d. acceptance), and the draft length is the largest i with
    ``a**i >= threshold`` (0, i.e. no draft, when even the first token is below it). With ``refit``, each step adds
    the pairs (``a**i``, token i accepted?) for its drafted positions, and every ``refit_every`` steps the
    threshold moves to the ROC point minimising ``fpr + 3 * fnr`` over the last ``window`` pairs.
    """

    type_name = "confidence"
    kind = "heuristic"

    def __init__(
        self,
        arms: Sequence[str],
        obs_size: int = 0,
        features: Sequence[str] | None = None,
        *,
        feature: str | None = None,
        threshold: float = 0.4,
        drafter: str | None = None,
        refit: bool = True,
        refit_every: int = 32,
        window: int = 2048,
    ) -> None:
        super().__init__(arms, obs_size, features)
        if self.features is None:
            raise PolicyError("the confidence policy needs named observation features")
        self.feature = feature or default_confidence_feature(self.features)
        if self.feature not in self.features:
            raise PolicyError(f"feature {self.feature!r} is not in the observation: {list(self.features)}")
        self.col = self.features.index(self.feature)
        real("confidence threshold", threshold, lo=0.0, lo_open=True, hi=1.0)
        if not 0 < threshold < 1:
            raise PolicyError(f"confidence threshold must be in (0, 1), got {threshold}")
        self.threshold0 = float(threshold)
        self.threshold = float(threshold)
        self.drafter, self.by_depth = chain_arms(self.arm_names, drafter)
        self.max_depth = max(self.by_depth)
        real("confidence refit_every", refit_every, lo=1, integer=True)
        real("confidence window", window, lo=1, hi=MAX_WINDOW, integer=True)
        if not isinstance(refit, (bool, np.bool_)):  # a string or a number is not read as a yes
            raise PolicyError(f"confidence refit must be true or false, got {repr(refit)[:60]}")
        self.refit, self.refit_every, self.window = bool(refit), int(refit_every), int(window)
        self.pairs: deque[tuple[float, bool]] = deque(maxlen=self.window)
        self.steps = 0
        self.depth_of = {i: d for d, i in self.by_depth.items()}
        self._last_a = 0.0

    @property
    def name(self) -> str:
        return "confidence"

    def params(self) -> dict[str, Any]:
        return {
            "feature": self.feature,
            "threshold": self.threshold0,
            "drafter": self.drafter,
            "refit": self.refit,
            "refit_every": self.refit_every,
            "window": self.window,
        }

    def length(self, a: float) -> int:
        a = float(np.clip(a, 0.0, 1.0))
        if a >= 1.0:
            return self.max_depth
        if a <= 0.0:
            return 0
        return int(min(self.max_depth, np.floor(np.log(self.threshold) / np.log(a) + 1e-9)))

    def act(self, obs: np.ndarray | None) -> int:
        x = self._check_obs(obs)
        self._last_a = float(x[self.col])
        return arm_for_length(self.by_depth, self.length(self._last_a))

    def update(self, obs: np.ndarray | None, action: int, reward: float, info: dict[str, Any]) -> None:
        action, _ = self._check_update(action, reward)
        if not self.refit:
            return
        accepted, drafted = _accepted(info, self.name)
        depth = self.depth_of.get(int(action), 0)
        if accepted is None or depth == 0 or drafted == 0:
            return
        a = float(np.clip(self._last_a, 1e-6, 1.0))
        for i in range(1, min(depth, drafted if drafted is not None else depth) + 1):
            self.pairs.append((a**i, accepted >= i))
        self.steps += 1
        if self.steps % self.refit_every == 0 and len(self.pairs) >= 64:
            p = np.array([q for q, _ in self.pairs])
            y = np.array([b for _, b in self.pairs])
            t = roc_threshold(p, y)
            if t is not None:
                self.threshold = float(np.clip(t, 0.05, 0.95))

    def state(self) -> dict[str, bytes]:
        return {
            "state.json": json_bytes(
                {"threshold": self.threshold, "pairs": list(self.pairs), "steps": self.steps}
            )
        }

    def restore(self, files: dict[str, bytes]) -> None:
        import json

        if "state.json" in files:
            try:
                s = json.loads(files["state.json"])
                threshold = real("threshold", s["threshold"], lo=0.0, hi=1.0, lo_open=True)
                if threshold == 1.0:
                    raise ValueError("threshold must be below 1")
                pairs = [(real("pair", p, lo=0.0, hi=1.0), bool(b)) for p, b in s["pairs"]]
                steps = int(real("steps", s.get("steps", 0), lo=0, integer=True))  # (saved before it: 0)
            except (KeyError, TypeError, ValueError, RecursionError) as err:
                raise PolicyError(f"confidence policy state is corrupted ({err})") from None
            self.threshold = threshold
            self.pairs.extend(pairs)
            self.steps = steps  # the refits fall on the steps they would have without the restart


def default_confidence_feature(features: Sequence[str]) -> str:
    """The first feature that estimates per-token acceptance, in order of preference."""
    for name in CONFIDENCE_FEATURES:
        if name in features:
            return name
    raise PolicyError(
        f"no confidence feature in the observation (looked for {list(CONFIDENCE_FEATURES)}); pass feature=NAME"
    )


# The target's confidence at the root first: the running acceptance rate is 0 before the first draft, which would
# keep a threshold rule from ever drafting.
CONFIDENCE_FEATURES = ("top1_prob", "accept_rate_recent")
