"""From a config's method names to runnable decoders.

A method is ``ar``, ``hf_greedy``/``hf_pld`` (run by ``experiments.bench.run_method``), an arm name (a static
decoder) or ``policy:NAME`` (a ``SpeculativeDecoder`` whose ``policy`` picks an arm of ``[policies.NAME].arms``
every step). Decoders are built once per run and cached in the dict that ``run_method`` reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from env.decoder import SpeculativeDecoder
from env.engine import Sampling, parse_arm, split_weights
from env.model import LoadedModel, with_weights
from experiments.config import (
    EXTERNAL_METHODS,
    Config,
    PolicyConfig,
    device_depth,
    is_device_method,
    keywords_of,
    policy_class,
    policy_types,
)


class MethodError(ValueError):
    """A method that cannot be built (e.g. a policy that must be trained first); meant for the user."""


def is_policy(method: str) -> bool:
    return method.startswith("policy:")


def sampling_of(cfg: Config) -> Sampling:
    d = cfg.decode
    return Sampling(temperature=d.temperature, top_k=d.top_k, top_p=d.top_p)


def _say_unapplied(name: str, p: PolicyConfig, loaded: Any) -> None:
    """A note on stderr for each ``params`` entry beside ``path`` that the saved policy does not have (a saved
    policy keeps its own; they were dropped without a word). ``draftgym train`` reads them: they are no error."""
    import sys

    saved = loaded.params() if hasattr(loaded, "params") else {}
    for k, v in p.params.items():
        if saved.get(k, object()) != v:
            print(f"note: policies.{name}.params.{k} = {str(v)[:40]} is not applied: {p.path} is a saved policy, "
                  f"whose {k} is {str(saved.get(k, 'not a parameter'))[:40]}", file=sys.stderr)  # fmt: skip


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

    # A saved policy is checked against the arm menu here, and against the observation (its feature spec comes
    # from its training trace) when the decoder is built.
    if state is not None and state.is_file():
        return load_policy(state, arms=p.arms)
    if p.path:
        loaded = load_policy(p.path, arms=p.arms)
        _say_unapplied(name, p, loaded)
        return loaded
    cls = policy_class(p.kind)
    if getattr(cls, "kind", "") in ("rl", "predictor"):
        raise MethodError(
            f"policy:{name} is a {p.kind} policy without a path: train it first with draftgym train CONFIG "
            f"(it saves <run dir>/policies/{name}.zip, which draftgym run in that directory uses), or set "
            f"policies.{name}.path"
        )
    params = dict(p.params)
    if "seed" in keywords_of(cls) and "seed" not in params:
        params["seed"] = seed
    return cls(list(p.arms), obs_size, features=features, **params)


def device_loop(loaded: LoadedModel, method: str, context: int | None = None) -> Any:
    """The device loop of a ``device:ARM`` method over ``loaded``'s lean forward, one row, for prompts plus new
    tokens of up to ``context`` positions (default: the model's context); on CUDA its steps run as CUDA graphs,
    captured here (not within a timed generation)."""
    from env.device_loop import DeviceLoop
    from env.lean import lean_of
    from env.target import eos_ids

    net = lean_of(loaded)
    if net is None:
        raise MethodError(f"{method} needs a Llama-family target on the lean forward (not --forward hf)")
    ctx = loaded.max_context if context is None else min(context, loaded.max_context)
    loop = DeviceLoop(net, 1, device_depth(method), ctx, eos_ids(loaded), graph=loaded.device.type == "cuda")
    loop.capture()
    return loop


def make_decoders(
    cfg: Config, loaded: LoadedModel, state_dir: Path | None = None, context: int | None = None
) -> dict[str, Any]:
    """One decoder per method of ``cfg`` (HF baselines are built lazily by ``run_method``); device loops for
    prompts plus new tokens of up to ``context`` positions."""
    options = {name: dict(opts) for name, opts in cfg.drafters.items()}
    decoders: dict[str, Any] = {}
    for m in cfg.methods:
        if m in EXTERNAL_METHODS:
            continue
        if is_device_method(m):
            decoders[m] = device_loop(loaded, m, context)
            continue
        if is_policy(m):
            name = m.removeprefix("policy:")
            p = cfg.policies[name]
            state = None if state_dir is None else state_dir / f"{name}.zip"
            arms = [parse_arm(a) for a in p.arms]
            names = observation_names(arms)
            policy = build_policy(name, p, seed=cfg.seed, state=state, obs_size=len(names), features=names)
            decoders[m] = policy_decoder(loaded, policy, arms, options)
        else:
            decoders[m] = arm_decoder(loaded, m, options)
    return decoders


def arm_decoder(
    loaded: LoadedModel, method: str, options: dict[str, dict[str, Any]] | None = None
) -> SpeculativeDecoder:
    """The decoder of an arm method (``ngram-d4``, ``eagle3-d4-k8-b16@int4``): its arm on the target variant its
    weight format names, its drafters built with ``options``."""
    arm, fmt = split_weights(method)
    return SpeculativeDecoder(with_weights(loaded, fmt), [parse_arm(arm)], drafter_options=options)


def prepare_decoders(decoders: Any) -> None:
    """Load the files the drafters of ``decoders`` read (trained heads), for the target each decodes with
    (``drafters.base.prepare_drafter``), so that a bad head file is one line before a run folder holds anything;
    decoders without drafters (device loops, baselines) have nothing to load."""
    from drafters.base import prepare_drafter

    for dec in decoders:
        target = getattr(getattr(dec, "engine", None), "target", None)
        for d in (getattr(dec, "drafters", None) or {}).values():
            prepare_drafter(d, target)


def prepare_arm_drafters(loaded: LoadedModel, arms: list[Any], options: dict[str, dict[str, Any]]) -> None:
    """``prepare_decoders`` for a command that builds its drafters per engine later (``serve-bench``): each drafter
    ``arms`` name, made with its ``options`` and loaded for the target now (it failed after the folder's settings
    were written)."""
    from drafters import make_drafter
    from drafters.base import prepare_drafter
    from env.batch import BatchEngine

    names = sorted({a.drafter for a in arms if a.drafter is not None})
    if names:
        target = BatchEngine(loaded, max_rows=1).target
        for name in names:
            prepare_drafter(make_drafter(name, **options.get(name, {})), target)


def policy_decoder(loaded: LoadedModel, policy: Any, arms: list[Any], options: dict[str, Any]) -> Any:
    """A decoder driven by ``policy``; through ``experiments.policy_commands.policy_decoder`` when present (it
    gives the policy the observation of its training feature spec and checks the two agree)."""
    try:
        from experiments.policy_commands import policy_decoder as build
    except ImportError:
        return SpeculativeDecoder(loaded, arms, policy=policy, drafter_options=options)
    return build(loaded, policy, options)


def observation_names(arms: list[Any]) -> list[str]:
    """The observation features the decoder gives a policy over this arm menu (as ``SpecDecodeEnv`` does)."""
    from env.features import FeatureSpec, feature_names

    depths = [0 if a.drafter is None else a.shape.depth for a in arms]
    return list(feature_names(FeatureSpec(), [a.name for a in arms], depths))


def save_policy_states(decoders: dict[str, Any], state_dir: Path, method: str) -> None:
    """After a prompt of a policy method: save the policy's state, so that a restarted run resumes it."""
    if not is_policy(method):
        return
    policy = getattr(decoders.get(method), "policy", None)
    if policy is not None and hasattr(policy, "update") and hasattr(policy, "save"):  # online learners only
        state_dir.mkdir(parents=True, exist_ok=True)
        policy.save(state_dir / f"{method.removeprefix('policy:')}.zip")
