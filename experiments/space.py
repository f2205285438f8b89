"""The sweep's search space: ``sample(trial) -> params`` in well-conditioned coordinates, and the one converter
``to_overrides(cfg, params)`` from those parameters to dotted config overrides (applied between the file and the
command line: file < sweep trial < --set).

What is tuned is one entry of ``methods`` (``sweep.method``):

- an arm (``ngram-d8``): its drafter (when ``sweep.drafters`` lists several) and, per drafter, the tree depth
  (log scale), the branching ``topk`` and the node budget as a fraction of ``depth * topk`` (so every sample is
  a valid tree; ``budget_frac = 1`` means no extra limit);
- a policy (``policy:NAME``): the hyper-parameters of its type, on log scales (``POLICY_SPACES``).

``default_params(cfg)`` gives the coordinates of the config as written; the sweep enqueues them as trial 0.
Following the Optuna examples and rl-baselines3-zoo (``sample_ppo_params``).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from drafters import TreeShape
from drafters.base import MAX_BUDGET
from env.engine import Arm, parse_arm
from experiments.config import EXTERNAL_METHODS, Config, ConfigError, policy_class


@dataclass(frozen=True)
class Dim:
    """One policy hyper-parameter: the Optuna parameter ``name`` on [low, high] sets the constructor keyword
    ``key`` to ``to_value(x)``; ``from_value`` is the inverse (for the default trial)."""

    name: str
    key: str
    low: float
    high: float
    log: bool = True
    integer: bool = False
    to_value: Callable[[float], Any] = lambda x: x
    from_value: Callable[[Any], float] = lambda v: v


# Policy type -> its dimensions. Bandit rewards are instantaneous speedups, O(1) to O(10).
POLICY_SPACES: dict[str, tuple[Dim, ...]] = {
    "ucb1": (Dim("c", "c", 0.05, 5.0),),
    "thompson": (Dim("scale", "scale", 0.25, 8.0),),
    "exp3": (Dim("gamma", "gamma", 0.005, 0.5),),
    "linucb": (Dim("alpha", "alpha", 0.05, 5.0),),
    "sb3": (
        Dim("learning_rate", "learning_rate", 1e-5, 3e-3),
        Dim("one_minus_gamma", "gamma", 1e-3, 0.1, to_value=lambda x: 1 - x, from_value=lambda v: 1 - v),
        Dim("ent_coef", "ent_coef", 1e-5, 0.1),
        Dim(
            "log2_n_steps",
            "n_steps",
            5,
            11,
            log=False,
            integer=True,
            to_value=lambda x: 2 ** int(x),
            from_value=lambda v: math.log2(v),
        ),  # fmt: skip
    ),
}


def tuned_method(cfg: Config) -> str:
    """``sweep.method``, else the last method that is an arm or a policy."""
    if cfg.sweep.method:
        return cfg.sweep.method
    for m in reversed(cfg.methods):
        if m.startswith("policy:") or (m not in EXTERNAL_METHODS and parse_arm(m).drafter is not None):
            return m
    raise ConfigError("nothing to sweep: methods has no arm or policy; set methods and sweep.method")


# ---------------------------------------------------------------------------------------------- sampling


def sample(trial: Any, cfg: Config) -> dict[str, Any]:
    """Suggest one point of the space (Optuna records the coordinates as the trial's params)."""
    method = tuned_method(cfg)
    if method.startswith("policy:"):
        for dim in _policy_dims(cfg, method):
            if dim.integer:
                trial.suggest_int(dim.name, int(dim.low), int(dim.high), log=dim.log)
            else:
                trial.suggest_float(dim.name, dim.low, dim.high, log=dim.log)
        return dict(trial.params)
    sw = cfg.sweep
    drafter = sw.drafters[0]
    if len(sw.drafters) > 1:
        drafter = trial.suggest_categorical("drafter", list(sw.drafters))
    trial.suggest_int(f"{drafter}.depth", 1, sw.max_depth, log=True)
    topk = trial.suggest_int(f"{drafter}.topk", 1, sw.max_topk) if sw.max_topk > 1 else 1
    if topk > 1:
        trial.suggest_float(f"{drafter}.budget_frac", 0.25, 1.0)
    return dict(trial.params)


def arm_of(cfg: Config, params: dict[str, Any]) -> Arm:
    """The tree-shape coordinates as an arm."""
    drafter = params.get("drafter", cfg.sweep.drafters[0])
    depth = int(params[f"{drafter}.depth"])
    topk = int(params.get(f"{drafter}.topk", 1))
    budget = 0
    if topk > 1:
        frac = float(params.get(f"{drafter}.budget_frac", 1.0))
        budget = max(depth, round(frac * depth * topk))
        budget = 0 if budget >= depth * topk else budget
        if (
            budget or depth * topk
        ) > MAX_BUDGET:  # a wide corner of the space: the most nodes an arm may have
            budget = MAX_BUDGET
    return Arm(drafter, TreeShape(depth=depth, topk=topk, budget=budget))


def to_overrides(cfg: Config, params: dict[str, Any]) -> dict[str, Any]:
    """The one converter: trial params -> dotted config overrides."""
    method = tuned_method(cfg)
    if method.startswith("policy:"):
        name = method.removeprefix("policy:")
        return {
            f"policies.{name}.params.{d.key}": _value(d, params[d.name]) for d in _policy_dims(cfg, method)
        }
    new = arm_of(cfg, params).name
    methods = [new if m == method else m for m in cfg.methods]
    out: dict[str, Any] = {"methods": list(dict.fromkeys(methods))}
    if cfg.sweep.method:  # keep naming the tuned method (when empty, it is found again as the last arm)
        out["sweep.method"] = new
    return out


def _value(dim: Dim, x: float) -> Any:
    v = dim.to_value(x)
    return int(v) if dim.integer else float(v)


def default_params(cfg: Config) -> dict[str, Any]:
    """The coordinates of the config as written (the tuned arm's shape, or the policy's parameters)."""
    method = tuned_method(cfg)
    sw = cfg.sweep
    if method.startswith("policy:"):
        p = cfg.policies[method.removeprefix("policy:")]
        out = {}
        for d in _policy_dims(cfg, method):
            v = p.params.get(d.key, _class_default(p.kind, d.key))
            x = (
                d.from_value(v)
                if v is not None
                else math.sqrt(d.low * d.high)
                if d.log
                else (d.low + d.high) / 2
            )
            x = min(max(x, d.low), d.high)
            out[d.name] = int(round(x)) if d.integer else float(x)
        return out
    arm = parse_arm(method)
    if arm.drafter not in sw.drafters:
        raise ConfigError(
            f"sweep.method {method!r} uses drafter {arm.drafter!r}, not in sweep.drafters {list(sw.drafters)}"
        )
    s = arm.shape
    if s.depth > sw.max_depth or s.topk > sw.max_topk:
        raise ConfigError(
            f"sweep.method {method!r} lies outside the space (sweep.max_depth = {sw.max_depth}, "
            f"sweep.max_topk = {sw.max_topk}); widen the space"
        )
    out: dict[str, Any] = {}
    if len(sw.drafters) > 1:
        out["drafter"] = arm.drafter
    out[f"{arm.drafter}.depth"] = s.depth
    if sw.max_topk > 1:
        out[f"{arm.drafter}.topk"] = s.topk
    if s.topk > 1:
        out[f"{arm.drafter}.budget_frac"] = (
            min(1.0, max(0.25, s.budget / (s.depth * s.topk))) if s.budget else 1.0
        )
    return out


def _policy_dims(cfg: Config, method: str) -> tuple[Dim, ...]:
    kind = cfg.policies[method.removeprefix("policy:")].kind
    if kind not in POLICY_SPACES:
        raise ConfigError(
            f"no sweep space for policy type {kind!r} (policies.{method[7:]}.kind); "
            f"spaces exist for {', '.join(sorted(POLICY_SPACES))}"
        )
    return POLICY_SPACES[kind]


def _class_default(kind: str, key: str) -> Any:
    try:
        cls = policy_class(kind)
    except (ImportError, KeyError):
        return None
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        p = inspect.signature(init).parameters.get(key)
        if p is not None and p.default is not inspect.Parameter.empty:
            return p.default
    return None
