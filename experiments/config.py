"""Run configs: frozen dataclasses loaded from TOML through one strict loader.

Every field carries a docstring (cleanrl style); every example config explains its deviations in comments
(nanoGPT style). Unknown keys and wrong types fail with the key's dotted name and the file and line that set it
(or the ``--set`` that did). Precedence is explicit and fixed: **file < sweep trial < command line**
(``load_config(path, trial=..., sets=...)``).

A method (one entry of ``methods``) is one of: ``ar`` (our autoregressive loop), ``hf_greedy`` / ``hf_pld`` /
``hf_static`` / ``hf_compile`` (Hugging Face ``generate``: ``experiments.hf_baselines``), ``llama_cpp``
(llama-cpp-python on the embedded model's GGUF), an arm name (``ngram-d8``, ``ngram-d12-k4-b24``), or
``policy:NAME`` for the policy described by the table ``[policies.NAME]``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from env.cli import SEED_MAX
from env.file_checks import not_a_file
from experiments.args import MAX_TOP_K, MIN_TEMPERATURE
from experiments.errors import one_line
from experiments.strict_toml import (
    ConfigError,
    Origin,
    apply_override,
    build,
    diff,
    dotted,
    parse_set,
    to_toml,
    tomllib,
)
from experiments.strict_toml import opt as _f

MAX_TIMESTEPS = (
    1 << 40
)  # env steps a policy trains for: replay runs ~10^6-10^8 a second; past this, never ending
MAX_ENVS = 4096  # replay envs a policy trains on at once: each holds its episode's arrays

Scalar = int | float | str | bool
DrafterOption = int | float | str | bool | dict[str, dict[str, Scalar]]  # a table: a hybrid's parts' options
# The baselines that are not arms of ours, run by ``experiments.bench.run_method``, greedy only: Hugging Face
# ``generate`` (greedy, prompt lookup) and llama-cpp-python on the embedded GGUF (``experiments.llama_cpp``).
EXTERNAL_METHODS = ("hf_greedy", "hf_pld", "hf_static", "hf_compile", "llama_cpp")
DEVICE_PREFIX = "device:"  # device:ARM, the device-resident loop (env.device_loop), greedy


def is_device_method(method: str) -> bool:
    """``device:ARM``: the device-resident loop (``env.device_loop``), ARM ``none`` or ``lookup-dD``."""
    return method.startswith(DEVICE_PREFIX)


def device_depth(method: str) -> int:
    """The chain depth of a ``device:ARM`` method (a ``DrafterError`` for an ARM the loop does not run)."""
    from env.device_loop import parse_device_arm

    return parse_device_arm(method[len(DEVICE_PREFIX) :])


@dataclass(frozen=True)
class ModelConfig:
    name: str = "smollm2-135m-instruct"
    """The embedded SmolLM2-135M-Instruct, or a local Hugging Face model folder."""
    dtype: str = _f("auto", choices=("auto", "bf16", "fp32"))
    """auto: bf16 on CUDA and on CPUs with native bf16, else fp32. Exactness tests use fp32."""
    device: str = "auto"
    """auto, cpu, cuda, cuda:N."""
    weights: str = _f("dense", choices=("dense", "bf16", "fp32", "int8", "int4", "auto"))
    """The target's weight format (the lean forward): dense (in ``dtype``), int8, int4; auto: int4 on a CPU with
    bf16 activations."""


@dataclass(frozen=True)
class WorkloadConfig:
    path: str = "builtin"
    """A Spec-Bench JSONL file (relative to the working directory), or ``builtin``."""
    per_category: int = _f(0, min=0)
    """Keep the first N prompts of each category (0: all)."""
    categories: tuple[str, ...] = ()
    """Keep only these categories (empty: all)."""
    limit: int = _f(0, min=0)
    """Keep the first N prompts in all (0: all); for smoke runs."""


@dataclass(frozen=True)
class DecodeConfig:
    max_new_tokens: int = _f(128, min=1, max=1 << 20)
    """Tokens to generate per prompt at most (2**20 at most, as ``--max-new-tokens``; the context bounds it
    further, checked against the model)."""
    temperature: float = _f(0.0, min=0.0, max=1e4)
    """0: greedy (the output equals greedy autoregressive decoding); at most 1e4, as ``--temperature``."""
    top_k: int = _f(0, min=0, max=MAX_TOP_K)
    """Top-k filter (0: off; a value at or above the vocabulary size keeps every token, as 0 does); at most
    2**31 - 1, far above any vocabulary, as ``--top-k`` and ``env.engine.Sampling``."""
    top_p: float = _f(1.0, min=0.0, min_open=True, max=1.0)
    """Nucleus sampling: in (0, 1], as ``--top-p`` (1: off)."""
    warmup: bool = True
    """Run every method once on a short prompt first, untimed (lazy initialisation)."""


@dataclass(frozen=True)
class TrainConfig:
    backend: str = _f("replay", choices=("replay",))
    """Where a learning policy trains: the replay env (a recorded trace, ``draftgym record``). Training on the
    live env is not offered: a trace of the same prompts replays greedy decoding exactly and a million times
    faster; ``draftgym evaluate`` checks a trained policy live."""
    trace: str = ""
    """Replay trace file (empty: the bundled trace)."""
    total_timesteps: int = _f(10_000, min=0, max=MAX_TIMESTEPS)
    """Training budget in env steps."""
    n_envs: int = _f(8, min=1, max=MAX_ENVS)
    """Parallel episodes of the vectorized replay env (one process; ``env.vector_env.make_sb3_vec_env``)."""
    eval_freq: int = _f(20_000, min=1)
    """Env steps between evaluations of the deterministic policy on validation prompts."""
    checkpoint_freq: int = _f(20_000, min=1)
    """Env steps between checkpoints (a killed training resumes from the latest)."""
    test_per_category: int = _f(5, min=0)
    """Prompts of each category held out from training (split by prompt, seeded by ``seed``); ``draftgym
    evaluate`` scores the policy on them."""
    cost_model: str = ""
    """Cost model JSON for the replay rewards (empty: the shipped one)."""
    draft_features: bool = False
    """Observation: add the drafters' largest proposal shape at the root (``env.features``, draft/<d>/...); the
    decoder then probes each drafter once per step."""
    out: str = ""
    """Where the trained policy is saved (empty: <run dir>/policies/<name>.zip)."""


@dataclass(frozen=True)
class PolicyConfig:
    kind: str = "ucb1"
    """A policy type of ``policies`` (static, hf_schedule, ucb1, thompson, exp3, linucb, sb3, ...)."""
    path: str = ""
    """A saved policy file to load (``policies.load_policy``); empty: build ``kind`` from ``params``."""
    arms: tuple[str, ...] = ("none", "ngram-d4", "ngram-d8")
    """The arm menu, in action order: the action space is Discrete(len(arms))."""
    params: dict[str, Scalar] = _f({})
    """Constructor keywords of the policy type (checked against its signature), e.g. ``{ c = 0.5 }``."""
    train: TrainConfig = TrainConfig()
    """For policies that learn offline (sb3, predictor): how ``draftgym train`` trains them."""


@dataclass(frozen=True)
class SweepConfig:
    n_trials: int = _f(20, min=1, max=1_000_000)
    """Finished (complete + pruned) trials the study aims at, over all workers together."""
    method: str = ""
    """The entry of ``methods`` to tune: an arm (its tree shape) or ``policy:NAME`` (its hyper-parameters).
    Empty: the last method that is an arm or a policy."""
    drafters: tuple[str, ...] = ("ngram",)
    """Tree sweeps: the drafters to choose from (each gets its own depth/topk/budget)."""
    max_depth: int = _f(16, min=1, max=256)
    max_topk: int = _f(4, min=1, max=64)
    objective: str = _f("speedup", choices=("speedup", "tokens_per_s", "tau"))
    """Per prompt: speedup over ``ar`` (measured by the same worker, same prompt), tokens/s, or tau."""
    ar_every_trial: bool = True
    """live speedup: time ar on each prompt right before the method, in every trial (cancels the drift of a
    shared machine, at twice the cost); false: once per worker and prompt."""
    backend: str = _f("live", choices=("live", "replay", "analytic"))
    """live: decode with the model; replay: the replay env (traces); analytic: the closed-form chain model."""
    sampler: str = _f("tpe", choices=("tpe", "random"))
    pruner: str = _f("wilcoxon", choices=("wilcoxon", "median", "none"))
    """Pruning per prompt: Wilcoxon signed-rank against the best trial, or the median rule."""
    seed: int = _f(0, min=0, max=SEED_MAX - 64)
    """Sampler seed; local worker i seeds its sampler with (seed, i): machines given different seeds never draw
    alike."""
    study_name: str = ""
    """Empty: the config's name."""
    heartbeat_s: int = _f(10, min=1, max=3600)
    """Workers write a heartbeat this often (at most hourly); a RUNNING trial silent for ``grace_s`` is failed
    (killed worker)."""
    grace_s: int = _f(60, min=2, max=86400)
    """At least twice ``heartbeat_s`` (a live worker's trial must not look dead between two heartbeats, timed to
    the second), at most a day."""
    trace: str = ""
    """replay backend: the trace file (empty: the trace shipped with the package)."""
    cost_model: str = ""
    """replay backend: a cost model JSON from ``draftgym calibrate`` (empty: the shipped one)."""
    analytic_alpha: float = _f(0.8, min=0.0, max=0.999)
    """analytic backend: mean i.i.d. acceptance of a draft token (prompts spread +-0.1 around it)."""
    analytic_node_cost: float = _f(0.05, min=0.0)
    """analytic backend: cost of one draft node in units of one autoregressive step."""
    analytic_prompt_s: float = _f(0.0, min=0.0, max=3600.0)
    """analytic backend: simulated seconds per prompt (exercises workers, pruning and kill/resume cheaply); at most
    an hour."""


@dataclass(frozen=True)
class Config:
    name: str = "run"
    """Run name; default run directory runs/<name> (sweeps: runs/sweep-<name>)."""
    seed: int = _f(0, min=0, max=SEED_MAX)
    """Seed of sampled decoding and of policies."""
    methods: tuple[str, ...] = ("ar", "ngram-d8")
    """Methods run on every prompt, interleaved: ar, hf_greedy, hf_pld, llama_cpp, arm names, policy:NAME."""
    model: ModelConfig = ModelConfig()
    workload: WorkloadConfig = WorkloadConfig()
    decode: DecodeConfig = DecodeConfig()
    drafters: dict[str, dict[str, DrafterOption]] = _f({})
    """Constructor options per drafter, e.g. ``[drafters.ngram] max_ngram = 3``; a hybrid's parts take theirs as
    tables of its ``options``: ``[drafters.hybrid.options.eagle3] vocab = 8192``."""
    policies: dict[str, PolicyConfig] = _f({})
    """Policies that ``policy:NAME`` methods refer to."""
    sweep: SweepConfig = SweepConfig()


# ---------------------------------------------------------------------------------------------- loading


def load_config(
    path: str | Path | None,
    *,
    trial: dict[str, Any] | None = None,
    sets: list[str] | tuple[str, ...] = (),
    text: str | None = None,
) -> Config:
    """Read ``path`` (or ``text``), then apply the sweep trial's dotted overrides, then ``--set`` items."""
    file = None if path is None else str(path)
    if text is None:
        if path is None:
            text = ""
        else:
            p = Path(path)
            if p.is_dir():
                raise ConfigError(f"config {p} is a directory, not a TOML file")
            if not p.is_file():
                raise ConfigError(f"config file {p} {not_a_file(p)}")
            try:
                text = p.read_text(encoding="utf-8")
            except UnicodeDecodeError as err:
                raise ConfigError(f"config file {p} is not UTF-8 text (byte {err.start})") from err
            except OSError as err:
                raise ConfigError(f"cannot read config file {p}: {err.strerror or err}") from err
    try:
        raw = tomllib.loads(text)
    except (ValueError, RecursionError) as err:  # TOMLDecodeError is a ValueError; so is an over-long integer
        raise ConfigError(
            f"{file or '<config>'}: not valid TOML: {' '.join(str(err).split())[:200]}"
        ) from None
    overridden: dict[tuple[str, ...], str] = {}
    for key, value in (trial or {}).items():
        keys = tuple(key.split("."))
        apply_override(raw, keys, value, f"sweep trial {key}")
        overridden[keys] = f"sweep trial ({key})"
    for item in sets:
        keys, value = parse_set(item)
        shown = item if item.isprintable() else repr(item)  # one line, whatever the item holds
        apply_override(raw, keys, value, f"--set {shown}")
        overridden[keys] = f"--set {shown}"
    where = Origin(file, text, overridden)
    cfg = build(Config, raw, (), where)
    validate(cfg, where)
    return cfg


def validate(cfg: Config, where: Origin | None = None) -> None:
    """Checks across fields: method names, arm menus, drafter options, the swept method."""
    from drafters import DRAFTERS

    where = where or Origin(None, "", {})

    def fail(path: tuple[str, ...], msg: str) -> None:
        raise ConfigError(f"{where(path)}: {dotted(path)} {msg}")

    if (
        cfg.name in ("", ".", "..") or any(c in cfg.name for c in "/\\\x00") or not cfg.name.isprintable()
    ):  # runs/<name> stays in runs/, and is a name a shell and a table show (no line break)
        fail(("name",), f"is {cfg.name!r}; it names a folder under runs/: one non-empty name, no / or \\ or NUL, "
                        "no line break or other unprintable character, not . or ..")  # fmt: skip
    if 0 < cfg.decode.temperature < MIN_TEMPERATURE:
        fail(
            ("decode", "temperature"),
            f"is {cfg.decode.temperature}; use 0 for greedy or >= {MIN_TEMPERATURE}",
        )
    if not cfg.methods:
        fail(("methods",), 'is empty; list at least one method (e.g. ["ar", "ngram-d8"])')
    if len(set(cfg.methods)) != len(cfg.methods):
        fail(("methods",), f"lists a method twice: {list(cfg.methods)}")
    for i, m in enumerate(cfg.methods):
        key = (f"methods[{i}]",)
        if m.startswith("policy:"):
            if m[7:] not in cfg.policies:
                known = ", ".join(sorted(cfg.policies)) or "none defined"
                fail(key, f"is {m!r} but there is no [policies.{m[7:]}] table (defined: {known})")
        elif m in EXTERNAL_METHODS:
            if cfg.decode.temperature > 0:
                fail(key, f"is {m!r}, which only runs greedy; set decode.temperature = 0 or drop it")
            problem = _device_problem(m, cfg.model.device)
            if problem:
                fail(key, f"is {m!r}: {problem}")
            if m == "llama_cpp" and cfg.model.name not in ("", ModelConfig.name):
                fail(
                    key,
                    "is 'llama_cpp', which a config runs on the embedded model's GGUF only (model.name is a "
                    "folder); for another model use draftgym bench --llama-cpp-gguf PATH",
                )
        elif is_device_method(m):
            from drafters import DrafterError

            try:
                device_depth(m)
            except DrafterError as err:
                fail(key, f"is not a method: {err}")
            if cfg.decode.temperature > 0:
                fail(key, f"is {m!r}, which only runs greedy; set decode.temperature = 0 or drop it")
        else:
            _check_arm(m, key, fail, DRAFTERS)
    sw = cfg.sweep
    if sw.grace_s < 2 * sw.heartbeat_s:
        fail(
            ("sweep", "grace_s"),
            f"is {sw.grace_s}; it must be at least twice sweep.heartbeat_s ({sw.heartbeat_s})",
        )
    for name, p in cfg.policies.items():
        if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
            fail(
                ("policies",),
                f"has a table named {name!r}: a policy name is letters, digits, '_' and '-' only",
            )
        if not p.arms:
            fail(("policies", name, "arms"), "is empty")
        for j, a in enumerate(p.arms):
            _check_arm(a, ("policies", name, f"arms[{j}]"), fail, DRAFTERS, policy_arm=True)
        _check_policy(name, p, fail, cfg.seed)
    for name, opts in cfg.drafters.items():
        if name not in DRAFTERS:
            fail(("drafters", name), f"is not a drafter; known: {', '.join(sorted(DRAFTERS))}")
        valid = keywords_of(DRAFTERS[name])
        for opt in opts:
            if opt not in valid:
                fail(("drafters", name, opt), f"is not an option of {name}; valid: {', '.join(valid)}")
        _check_drafter(name, opts, fail)
    if cfg.sweep.method and cfg.sweep.method not in cfg.methods:
        fail(("sweep", "method"), f"is {cfg.sweep.method!r}, not one of methods {list(cfg.methods)}")
    for j, d in enumerate(cfg.sweep.drafters):
        if d not in DRAFTERS:
            fail(("sweep", f"drafters[{j}]"), f"is {d!r}; known drafters: {', '.join(sorted(DRAFTERS))}")


def _device_problem(method: str, device: str) -> str | None:
    """Why a Hugging Face baseline cannot run where ``model.device`` resolves on this machine, or None."""
    from env.model import ModelError, resolve_device
    from experiments.hf_baselines import device_problem

    try:
        return device_problem(method, resolve_device(device).type)
    except ModelError:  # a bad device is reported by its own check
        return None


def keywords_of(cls: Any) -> list[str]:
    """Keyword arguments a drafter or policy class accepts as options (a policy's arms and feature sizes come
    from the run, not the config)."""
    from drafters.base import keyword_options

    return [n for n in keyword_options(cls) if n not in ("arms", "obs_size", "features")]


def policy_types() -> dict[str, str] | None:
    """The policy registry (type -> "module:Class"), or None while the policies package has none."""
    try:
        from policies.base import POLICY_TYPES
    except ImportError:
        return None
    return dict(POLICY_TYPES)


def policy_class(kind: str) -> Any:
    import importlib

    module, _, cls = (policy_types() or {})[kind].partition(":")
    return getattr(importlib.import_module(module), cls)


def _named_option(err: BaseException, options: Any) -> str | None:
    """The option (of ``options``) an error message names, to point at the line or ``--set`` that set it."""
    text = str(err)
    for opt in options:
        if re.search(rf"(?<![\w.]){re.escape(str(opt))}(?!\w)", text):
            return str(opt)
    return None


def _check_drafter(name: str, opts: dict[str, DrafterOption], fail: Any) -> None:
    """Build drafter ``name`` once with its ``[drafters.NAME]`` options (as ``--drafter-option`` does): a value it
    refuses fails here, in one line, not after the model loaded. Constructors only check and store (heads load
    at the first sequence), so this is cheap."""
    from drafters import DrafterError, make_drafter

    try:
        make_drafter(name, **opts)
    except (DrafterError, TypeError, ValueError, ArithmeticError) as err:
        opt = _named_option(err, opts)
        fail(("drafters", name) if opt is None else ("drafters", name, opt), f"is refused: {one_line(err)}")


def _check_policy(name: str, p: PolicyConfig, fail: Any, seed: int = 0) -> None:
    types_ = policy_types()
    if types_ is None:
        return  # nothing to check against yet
    key = ("policies", name)
    if p.kind not in types_:
        fail((*key, "kind"), f"is {p.kind!r}; known policy types: {', '.join(sorted(types_))}")
    try:
        cls = policy_class(p.kind)
        valid = keywords_of(cls)
    except ImportError:
        return  # the policy's optional dependencies are missing; it fails when built
    for opt in p.params:
        if opt not in valid:
            fail((*key, "params", opt), f"is not a parameter of {p.kind}; valid: {', '.join(valid)}")
    _try_policy(name, p, cls, fail, seed)


def _try_policy(name: str, p: PolicyConfig, cls: Any, fail: Any, seed: int) -> None:
    """Build the policy once with its ``params`` over its arm menu and the observation ``draftgym run`` gives it
    (``experiments.methods.build_policy`` does the same), so that a parameter of the wrong type or out of range
    fails in one line before any model loads (the trained kinds too, ``sb3`` and ``predictor``: building one
    checks its hyper-parameters and trains nothing). Not for one that is loaded from ``path``, a static policy
    whose arm training chooses, or a confidence policy reading a named ``feature`` (the training trace's
    observation may differ)."""
    from drafters import DrafterError
    from env.engine import parse_arm, split_weights
    from env.features import FeatureSpec, feature_names

    if p.path or "feature" in p.params:
        return
    if p.kind == "static" and "arm" not in p.params:
        return
    try:
        arms = [parse_arm(split_weights(a)[0]) for a in p.arms]
    except DrafterError:
        return  # reported by the arm checks
    depths = [0 if a.drafter is None else a.shape.depth for a in arms]
    spec = FeatureSpec(draft_features=p.train.draft_features)
    names = feature_names(spec, [a.name for a in arms], depths)
    params: dict[str, Any] = dict(p.params)
    if "seed" in keywords_of(cls) and "seed" not in params:
        params["seed"] = seed
    try:
        cls(list(p.arms), len(names), features=names, **params)
    except (TypeError, ValueError, ArithmeticError) as err:
        opt = _named_option(err, p.params)
        path = ("policies", name, "params") if opt is None else ("policies", name, "params", opt)
        fail(path, f"is refused by {p.kind}: {one_line(err)}")


def diff_configs(a: Config, b: Config, ignore: tuple[str, ...] = ()) -> list[str]:
    """Dotted keys whose values differ between two configs, except those starting with an ``ignore`` prefix."""
    return diff(a, b, ignore)


def _check_arm(name: str, key: tuple[str, ...], fail: Any, registry: dict[str, Any],
               policy_arm: bool = False) -> None:  # fmt: skip
    """A method (``ARM[@VARIANT]``), or with ``policy_arm`` an arm of a policy's menu: no ``@VARIANT`` (the
    target's weights are the run's, not an arm's) and written as the engine names it (``Arm.name``), since a
    policy's arms are matched to the decoder's by name."""
    from drafters import DrafterError
    from env.engine import parse_arm, split_weights

    try:
        arm = parse_arm(name if policy_arm else split_weights(name)[0])
    except DrafterError as err:
        fail(key, f"is not {'an arm' if policy_arm else 'a method'}: {err}")
        return
    if arm.drafter is not None and arm.drafter not in registry:
        fail(key, f"is {name!r}: unknown drafter {arm.drafter!r}; known: {', '.join(sorted(registry))}")
    elif policy_arm and arm.name != name:
        fail(key, f"is {name!r}: write it as {arm.name!r}, the name the decoder gives this arm")


__all__ = [
    "Config",
    "ConfigError",
    "DecodeConfig",
    "ModelConfig",
    "PolicyConfig",
    "SweepConfig",
    "WorkloadConfig",
    "diff_configs",
    "load_config",
    "parse_set",
    "replace",
    "to_toml",
    "validate",
]
