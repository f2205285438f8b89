"""The sweep's search space: ``sample(trial) -> params`` in well-conditioned coordinates, and the one converter
``to_overrides(cfg, params)`` from those parameters to dotted config overrides (applied between the file and the
command line: file < sweep trial < --set).

What is tuned is one entry of ``methods`` (``sweep.method``):

- an arm (``ngram-d8``): its drafter (when ``sweep.drafters`` lists several) and, per drafter, the tree depth
  (log scale), the branching ``topk`` and the node budget as a fraction of ``depth * topk`` (so every sample is
  a valid tree; ``budget_frac = 1`` means no extra limit);
- a policy (``policy:NAME``) built from its ``params``: the hyper-parameters of its type, on log scales
  (``POLICY_SPACES``; bandits only: a trained policy, or one loaded from ``path``, is refused).

``default_params(cfg)`` gives the coordinates of the config as written; the sweep enqueues them as trial 0, so a
config outside the space (a smaller node budget, a parameter off the range) is refused rather than moved into it.
Following the Optuna examples and rl-baselines3-zoo (``sample_ppo_params``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from drafters import TreeShape
from drafters.base import MAX_BUDGET, DrafterError
from env.engine import Arm, parse_arm
from experiments.config import EXTERNAL_METHODS, Config, ConfigError, is_device_method, policy_class


@dataclass(frozen=True)
class Dim:
    """One policy hyper-parameter: the Optuna parameter ``name`` on [low, high] (log scale unless ``log`` is false)
    sets the constructor keyword ``key``."""

    name: str
    key: str
    low: float
    high: float
    log: bool = True


# Policy type -> its dimensions. Bandit rewards are instantaneous speedups, O(1) to O(10). The trained kinds
# (sb3, predictor) have none: a trial would have to train one (``draftgym train``), which a sweep does not do.
POLICY_SPACES: dict[str, tuple[Dim, ...]] = {
    "ucb1": (Dim("c", "c", 0.05, 5.0),),
    "thompson": (Dim("scale", "scale", 0.25, 16.0),),  # rewards reach depth + 1 (13 for a 12-deep arm)
    "exp3": (Dim("gamma", "gamma", 0.005, 0.5),),
    "linucb": (Dim("alpha", "alpha", 0.05, 5.0),),
}
BUDGET_FRAC = (0.25, 1.0)  # a tree's node budget as a fraction of depth * topk


def tuned_method(cfg: Config) -> str:
    """``sweep.method``, else the last method that is an arm or a policy. Only a policy or a plain arm
    (``DRAFTER-dD[-kK][-bB]``) is tuned: other methods ``run`` takes (``device:lookup-d4``, ``ngram-d4@int8``,
    the baselines) are passed over."""
    if cfg.sweep.method:
        if not _tunable(cfg.sweep.method):
            raise ConfigError(
                f"sweep.method {cfg.sweep.method!r} is not a method a sweep tunes: it tunes a policy "
                "(policy:NAME) or an arm DRAFTER-dDEPTH[-kTOPK][-bBUDGET] (no device: prefix, no @weights)"
            )
        return cfg.sweep.method
    for m in reversed(cfg.methods):
        if _tunable(m):
            return m
    raise ConfigError("nothing to sweep: methods has no arm or policy; set methods and sweep.method")


def _tunable(method: str) -> bool:
    """A policy, or an arm with a drafter that ``parse_arm`` reads as it is."""
    if method.startswith("policy:"):
        return True
    if method in EXTERNAL_METHODS or is_device_method(method):
        return False
    try:
        return parse_arm(method).drafter is not None
    except DrafterError:
        return False


def swept_keys(cfg: Config) -> tuple[str, ...]:
    """The dotted config keys each trial sets (``to_overrides``'s keys): a ``--set`` of one of them (or of a table
    above one) would override every trial."""
    method = tuned_method(cfg)
    if method.startswith("policy:"):
        name = method.removeprefix("policy:")
        return tuple(f"policies.{name}.params.{d.key}" for d in _policy_dims(cfg, method))
    return ("methods", "sweep.method") if cfg.sweep.method else ("methods",)


# ---------------------------------------------------------------------------------------------- sampling


def sample(trial: Any, cfg: Config) -> dict[str, Any]:
    """Suggest one point of the space (Optuna records the coordinates as the trial's params)."""
    method = tuned_method(cfg)
    if method.startswith("policy:"):
        for dim in _policy_dims(cfg, method):
            trial.suggest_float(dim.name, dim.low, dim.high, log=dim.log)
        return dict(trial.params)
    sw = cfg.sweep
    drafter = sw.drafters[0]
    if len(sw.drafters) > 1:
        drafter = trial.suggest_categorical("drafter", list(sw.drafters))
    trial.suggest_int(f"{drafter}.depth", 1, sw.max_depth, log=True)
    topk = trial.suggest_int(f"{drafter}.topk", 1, sw.max_topk) if sw.max_topk > 1 else 1
    if topk > 1:
        trial.suggest_float(f"{drafter}.budget_frac", *BUDGET_FRAC)
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
        return {f"policies.{name}.params.{d.key}": float(params[d.name]) for d in _policy_dims(cfg, method)}
    new = arm_of(cfg, params).name
    methods = [new if m == method else m for m in cfg.methods]
    out: dict[str, Any] = {"methods": list(dict.fromkeys(methods))}
    if cfg.sweep.method:  # keep naming the tuned method (when empty, it is found again as the last arm)
        out["sweep.method"] = new
    return out


def default_params(cfg: Config) -> dict[str, Any]:
    """The coordinates of the config as written (the tuned arm's shape, or the policy's parameters), which the
    sweep runs as trial 0; a config that lies outside the space is refused in one line (its trial 0 would run
    another config under the label "config as written")."""
    method = tuned_method(cfg)
    if method.startswith("policy:"):
        return _policy_default(cfg, method)
    sw = cfg.sweep
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
    # (a sampled fraction is rounded to a whole budget: an arm the sweep samples may hold a little under the
    # fraction's floor, and is in the space all the same — it is what arm_of gives at the floor)
    frac = max(min(1.0, s.budget / (s.depth * s.topk)) if s.budget else 1.0, BUDGET_FRAC[0])
    if s.topk > 1:
        out[f"{arm.drafter}.budget_frac"] = frac
    runs = arm_of(cfg, out).name
    if runs != arm.name:
        if s.topk == 1:
            why = f"its chains have no node budget (-b{s.budget}); drop it, or sweep a tree (-k2 or more)"
        else:
            least = max(s.depth, round(BUDGET_FRAC[0] * s.depth * s.topk))  # as arm_of rounds
            why = (
                f"its trees of depth {s.depth} and topk {s.topk} have budgets of at least {least} "
                f"(max(depth, {BUDGET_FRAC[0]} x depth x topk)), not {s.budget}"
            )
        raise ConfigError(
            f"sweep.method {method!r} lies outside the sweep space: {why}; trial 0 would run {runs!r}, "
            "not the config as written"
        )
    return out


def _policy_default(cfg: Config, method: str) -> dict[str, Any]:
    name = method.removeprefix("policy:")
    p = cfg.policies[name]
    out = {}
    for d in _policy_dims(cfg, method):
        key = f"policies.{name}.params.{d.key}"
        v = p.params.get(d.key, _class_default(p.kind, d.key))
        space = f"[{d.low:g}, {d.high:g}]{' (log scale)' if d.log else ''}"
        if v is None:
            raise ConfigError(
                f"{key} is unset ({p.kind} chooses it itself); a sweep starts from the config as written: "
                f"set it in the sweep space {space}"
            )
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not d.low <= v <= d.high:
            shown = "the default of " + p.kind if d.key not in p.params else "written"
            raise ConfigError(
                f"{key} = {v!r} ({shown}) lies outside the sweep space {space} of {p.kind}; trial 0 runs "
                "the config as written: set it inside the space"
            )
        out[d.name] = float(v)
    return out


def _policy_dims(cfg: Config, method: str) -> tuple[Dim, ...]:
    name = method.removeprefix("policy:")
    p = cfg.policies[name]
    if p.path:
        raise ConfigError(
            f"policies.{name}.path is set: every trial would load the same saved policy; a sweep tunes a "
            f"policy built from params (drop path, or sweep another method)"
        )
    try:
        trained = getattr(policy_class(p.kind), "kind", "") in ("rl", "predictor")
    except (ImportError, KeyError):
        trained = False
    if trained:
        raise ConfigError(
            f"policies.{name} is a {p.kind} policy, trained offline (draftgym train): a sweep does not train "
            f"one per trial; sweep a bandit ({', '.join(sorted(POLICY_SPACES))}) or a tree shape"
        )
    if p.kind not in POLICY_SPACES:
        raise ConfigError(
            f"no sweep space for policy type {p.kind!r} (policies.{name}.kind); "
            f"spaces exist for {', '.join(sorted(POLICY_SPACES))}"
        )
    return POLICY_SPACES[p.kind]


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
