"""From a config's method names to runnable decoders.

A method is ``ar``, ``hf_greedy``/``hf_pld`` (run by ``experiments.bench.run_method``), an arm name (a static
decoder) or ``policy:NAME`` (a ``SpeculativeDecoder`` whose ``policy`` picks an arm of ``[policies.NAME].arms``
every step). Decoders are built once per run and cached in the dict that ``run_method`` reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from env.decoder import SpeculativeDecoder
from env.engine import Sampling, parse_arm
from env.model import LoadedModel
from experiments.config import HF_METHODS, Config, PolicyConfig, keywords_of, policy_class, policy_types


class MethodError(ValueError):
    """A method that cannot be built (e.g. a policy that must be trained first); meant for the user."""


def is_policy(method: str) -> bool:
    return method.startswith("policy:")


def sampling_of(cfg: Config) -> Sampling:
    d = cfg.decode
    return Sampling(temperature=d.temperature, top_k=d.top_k, top_p=d.top_p)


def build_policy(
    name: str,
    p: PolicyConfig,
    *,
    seed: int = 0,
    state: Path | None = None,
    obs_size: int = 0,
    features: Any = None,
) -> Any:
    """The policy of ``[policies.NAME]``: its saved state from an interrupted run (``state``), else the file in
    ``path``, else a fresh ``kind`` built from ``params`` (``seed`` added when the type takes one)."""
    if policy_types() is None:
        raise MethodError(f"policy:{name} needs the policies package, which this installation lacks")
    from policies.base import load_policy

    check = {"arms": p.arms, "obs_size": obs_size or None, "features": features}
    if state is not None and state.is_file():
        return load_policy(state, **check)
    if p.path:
        return load_policy(p.path, **check)
    cls = policy_class(p.kind)
    if getattr(cls, "kind", "") in ("rl", "predictor"):
        raise MethodError(
            f"policy:{name} is a {p.kind} policy without a path: train it first (draftgym train) and set "
            f"policies.{name}.path to the saved file"
        )
    params = dict(p.params)
    if "seed" in keywords_of(cls) and "seed" not in params:
        params["seed"] = seed
    return cls(list(p.arms), obs_size, features=features, **params)


def make_decoders(cfg: Config, loaded: LoadedModel, state_dir: Path | None = None) -> dict[str, Any]:
    """One decoder per method of ``cfg`` (HF baselines are built lazily by ``run_method``)."""
    options = {name: dict(opts) for name, opts in cfg.drafters.items()}
    decoders: dict[str, Any] = {}
    for m in cfg.methods:
        if m in HF_METHODS:
            continue
        if is_policy(m):
            name = m.removeprefix("policy:")
            p = cfg.policies[name]
            state = None if state_dir is None else state_dir / f"{name}.zip"
            policy = build_policy(name, p, seed=cfg.seed, state=state)
            arms = [parse_arm(a) for a in p.arms]
            decoders[m] = SpeculativeDecoder(loaded, arms, policy=policy, drafter_options=options)
        else:
            decoders[m] = SpeculativeDecoder(loaded, [parse_arm(m)], drafter_options=options)
    return decoders


def save_policy_states(decoders: dict[str, Any], state_dir: Path, method: str) -> None:
    """After a prompt of a policy method: save the policy's state, so that a restarted run resumes it."""
    if not is_policy(method):
        return
    policy = getattr(decoders.get(method), "policy", None)
    if policy is not None and hasattr(policy, "save"):
        state_dir.mkdir(parents=True, exist_ok=True)
        policy.save(state_dir / f"{method.removeprefix('policy:')}.zip")


def warmup_decoders(cfg: Config, loaded: LoadedModel) -> dict[str, Any]:
    """Static decoders for every arm any method uses (policies included), to pay lazy initialisation untimed
    without teaching an online policy anything."""
    options = {name: dict(opts) for name, opts in cfg.drafters.items()}
    arms: list[str] = []
    for m in cfg.methods:
        if is_policy(m):
            arms += list(cfg.policies[m.removeprefix("policy:")].arms)
        elif m not in HF_METHODS:
            arms.append(m)
    out: dict[str, Any] = {
        a: SpeculativeDecoder(loaded, [parse_arm(a)], drafter_options=options) for a in arms
    }
    return out
