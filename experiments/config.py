"""Run configs: frozen dataclasses loaded from TOML through one strict loader.

Every field carries a docstring (cleanrl style); every example config explains its deviations in comments
(nanoGPT style). Unknown keys and wrong types fail with the key's dotted name and the file and line that set it
(or the ``--set`` that did). Precedence is explicit and fixed: **file < sweep trial < command line**
(``load_config(path, trial=..., sets=...)``).

A method (one entry of ``methods``) is one of: ``ar`` (our autoregressive loop), ``hf_greedy`` / ``hf_pld``
(Hugging Face ``generate``), an arm name (``ngram-d8``, ``ngram-d12-k4-b24``), or ``policy:NAME`` for the
policy described by the table ``[policies.NAME]``.
"""

from __future__ import annotations

import difflib
import inspect
import re
import sys
import types
import typing
from dataclasses import MISSING, dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

Scalar = int | float | str | bool
HF_METHODS = ("hf_greedy", "hf_pld")


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key and where it was set."""


def _f(default: Any, **meta: Any) -> Any:
    """A dataclass field with validation metadata: ``choices``, ``min``, ``max``."""
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ModelConfig:
    name: str = "smollm2-135m-instruct"
    """The embedded SmolLM2-135M-Instruct, or a local Hugging Face model folder."""
    dtype: str = _f("auto", choices=("auto", "bf16", "fp32"))
    """auto: bf16 on CUDA and on CPUs with native bf16, else fp32. Exactness tests use fp32."""
    device: str = "auto"
    """auto, cpu, cuda, cuda:N."""


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
    max_new_tokens: int = _f(128, min=1)
    """Tokens to generate per prompt at most."""
    temperature: float = _f(0.0, min=0.0)
    """0: greedy (the output equals greedy autoregressive decoding)."""
    top_k: int = _f(0, min=0)
    top_p: float = _f(1.0, min=0.0, max=1.0)
    warmup: bool = True
    """Run every method once on a short prompt first, untimed (lazy initialisation)."""


@dataclass(frozen=True)
class TrainConfig:
    backend: str = _f("replay", choices=("replay", "live"))
    """Where a learning policy trains: the replay env (recorded traces, fast) or the live env."""
    trace: str = ""
    """Replay trace file (empty: the bundled trace)."""
    total_timesteps: int = _f(10_000, min=0)
    """Training budget in env steps."""
    n_envs: int = _f(8, min=1)
    """Parallel envs (the vectorized replay env, or SubprocVecEnv for live)."""
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
    n_trials: int = _f(20, min=1)
    """Finished (complete + pruned) trials the study aims at, over all workers together."""
    method: str = ""
    """The entry of ``methods`` to tune: an arm (its tree shape) or ``policy:NAME`` (its hyper-parameters).
    Empty: the last method that is an arm or a policy."""
    drafters: tuple[str, ...] = ("ngram",)
    """Tree sweeps: the drafters to choose from (each gets its own depth/topk/budget)."""
    max_depth: int = _f(16, min=1)
    max_topk: int = _f(4, min=1)
    objective: str = _f("speedup", choices=("speedup", "tokens_per_s", "tau"))
    """Per prompt: speedup over ``ar`` (measured by the same worker, same prompt), tokens/s, or tau."""
    backend: str = _f("live", choices=("live", "replay", "analytic"))
    """live: decode with the model; replay: the replay env (traces); analytic: the closed-form chain model."""
    sampler: str = _f("tpe", choices=("tpe", "random"))
    pruner: str = _f("wilcoxon", choices=("wilcoxon", "median", "none"))
    """Pruning per prompt: Wilcoxon signed-rank against the best trial, or the median rule."""
    seed: int = 0
    """Sampler seed; local worker i uses seed + i."""
    study_name: str = ""
    """Empty: the config's name."""
    heartbeat_s: int = _f(10, min=1)
    """Workers write a heartbeat this often; a RUNNING trial silent for ``grace_s`` is failed (killed worker)."""
    grace_s: int = _f(60, min=1)
    trace: str = ""
    """replay backend: the trace file (empty: the trace shipped with the package)."""
    cost_model: str = ""
    """replay backend: a cost model JSON from ``draftgym calibrate`` (empty: the shipped one)."""
    analytic_alpha: float = _f(0.8, min=0.0, max=0.999)
    """analytic backend: mean i.i.d. acceptance of a draft token (prompts spread +-0.1 around it)."""
    analytic_node_cost: float = _f(0.05, min=0.0)
    """analytic backend: cost of one draft node in units of one autoregressive step."""
    analytic_prompt_s: float = _f(0.0, min=0.0)
    """analytic backend: simulated seconds per prompt (exercises workers, pruning and kill/resume cheaply)."""


@dataclass(frozen=True)
class Config:
    name: str = "run"
    """Run name; default run directory runs/<name> (sweeps: runs/sweep-<name>)."""
    seed: int = 0
    """Seed of sampled decoding and of policies."""
    methods: tuple[str, ...] = ("ar", "ngram-d8")
    """Methods run on every prompt, interleaved: ar, hf_greedy, hf_pld, arm names, policy:NAME."""
    model: ModelConfig = ModelConfig()
    workload: WorkloadConfig = WorkloadConfig()
    decode: DecodeConfig = DecodeConfig()
    drafters: dict[str, dict[str, Scalar]] = _f({})
    """Constructor options per drafter, e.g. ``[drafters.ngram] max_ngram = 3``."""
    policies: dict[str, PolicyConfig] = _f({})
    """Policies that ``policy:NAME`` methods refer to."""
    sweep: SweepConfig = SweepConfig()


# ---------------------------------------------------------------------------------------------- where keys live


class _Origin:
    """Says where a dotted key was set: ``file:line``, ``--set key`` or ``sweep trial``."""

    def __init__(self, file: str | None, text: str, overridden: dict[tuple[str, ...], str]) -> None:
        self.file = file or "<config>"
        self.overridden = overridden
        self.lines = _key_lines(text)

    def __call__(self, path: tuple[str, ...]) -> str:
        path = tuple(re.sub(r"\[\d+\]$", "", p) for p in path)  # methods[2] was set on the line of methods
        for n in range(len(path), 0, -1):
            if path[:n] in self.overridden:
                return self.overridden[path[:n]]
        for n in range(len(path), 0, -1):
            if path[:n] in self.lines:
                return f"{self.file}:{self.lines[path[:n]]}"
        return self.file


def _key_lines(text: str) -> dict[tuple[str, ...], int]:
    """Best-effort line of each key and table header of a TOML text (first occurrence)."""
    out: dict[tuple[str, ...], int] = {}
    table: tuple[str, ...] = ()
    key_re = re.compile(r"^\s*([A-Za-z0-9_\-\"'. ]+?)\s*=")
    for i, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if s.startswith("["):
            inner = s.strip("[]").split("#")[0].strip()
            table = tuple(p.strip().strip("\"'") for p in inner.split("."))
            out.setdefault(table, i)
            continue
        m = key_re.match(line)
        if m and not s.startswith("#"):
            key = tuple(p.strip().strip("\"'") for p in m.group(1).split("."))
            for n in range(1, len(key) + 1):
                out.setdefault(table + key[:n], i)
    return out


def _dotted(path: tuple[str, ...]) -> str:
    return ".".join(path).replace(".[", "[")


# ---------------------------------------------------------------------------------------------- typed building


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false"}.get(
            tp.__name__, f"a table [{tp.__name__}]"
        )
    origin = typing.get_origin(tp)
    if origin is tuple:
        return f"a list of {_type_name(typing.get_args(tp)[0]).removeprefix('a ').removeprefix('an ')}s"
    if origin is dict:
        return "a table"
    return " or ".join(_type_name(a) for a in typing.get_args(tp))


def _coerce(tp: Any, value: Any, path: tuple[str, ...], where: _Origin) -> Any:
    def bad() -> ConfigError:
        got = "a table" if isinstance(value, dict) else f"{value!r}"
        return ConfigError(f"{where(path)}: {_dotted(path)} must be {_type_name(tp)}, got {got}")

    if is_dataclass(tp):
        if not isinstance(value, dict):
            raise bad()
        return _build(tp, value, path, where)
    origin = typing.get_origin(tp)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise bad()
        (elem, _) = typing.get_args(tp)
        return tuple(_coerce(elem, v, (*path[:-1], f"{path[-1]}[{i}]"), where) for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise bad()
        _, val_tp = typing.get_args(tp)
        return {str(k): _coerce(val_tp, v, (*path, str(k)), where) for k, v in value.items()}
    if origin in (typing.Union, types.UnionType):
        for member in typing.get_args(tp):
            try:
                return _coerce(member, value, path, where)
            except ConfigError:
                continue
        raise bad()
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp in (int, str, bool) and type(value) is tp:
        return value
    raise bad()


def _build(cls: type, raw: dict[str, Any], path: tuple[str, ...], where: _Origin) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in fields(cls)]
    for key in raw:
        if key not in names:
            near = difflib.get_close_matches(key, names, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            table = f"[{_dotted(path)}]" if path else "the top level"
            raise ConfigError(
                f"{where((*path, key))}: unknown key {_dotted((*path, key))!r} in {table}{hint} "
                f"(valid: {', '.join(names)})"
            )
    kwargs = {}
    for f in fields(cls):
        if f.name not in raw:
            continue
        val = _coerce(hints[f.name], raw[f.name], (*path, f.name), where)
        meta = f.metadata
        loc = f"{where((*path, f.name))}: {_dotted((*path, f.name))}"
        if "choices" in meta and val not in meta["choices"]:
            raise ConfigError(f"{loc} is {val!r}; valid: {', '.join(meta['choices'])}")
        if "min" in meta and val < meta["min"]:
            raise ConfigError(f"{loc} must be >= {meta['min']}, got {val}")
        if "max" in meta and val > meta["max"]:
            raise ConfigError(f"{loc} must be <= {meta['max']}, got {val}")
        kwargs[f.name] = val
    return cls(**kwargs)


# ---------------------------------------------------------------------------------------------- overrides


def parse_set(item: str) -> tuple[tuple[str, ...], Any]:
    """``a.b=v`` -> (("a", "b"), v); v is read as a TOML value (``3e-4``, ``true``, ``["ar"]``), else a string."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not p for p in key.split(".")):
        raise ConfigError(
            f"--set {item!r}: expected KEY=VALUE with a dotted key, e.g. --set decode.max_new_tokens=16"
        )
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return tuple(key.split(".")), value


def _apply(raw: dict[str, Any], path: tuple[str, ...], value: Any, origin: str) -> None:
    node = raw
    for i, part in enumerate(path[:-1]):
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(
                f"{origin}: {_dotted(path[: i + 1])} is not a table, cannot set {_dotted(path)}"
            )
        node = nxt
    node[path[-1]] = value


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
            if not p.is_file():
                raise ConfigError(f"config file {p} does not exist")
            text = p.read_text(encoding="utf-8")
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{file or '<config>'}: not valid TOML: {err}") from err
    overridden: dict[tuple[str, ...], str] = {}
    for key, value in (trial or {}).items():
        keys = tuple(key.split("."))
        _apply(raw, keys, value, f"sweep trial {key}")
        overridden[keys] = f"sweep trial ({key})"
    for item in sets:
        keys, value = parse_set(item)
        _apply(raw, keys, value, f"--set {item}")
        overridden[keys] = f"--set {item}"
    where = _Origin(file, text, overridden)
    cfg = _build(Config, raw, (), where)
    validate(cfg, where)
    return cfg


def validate(cfg: Config, where: _Origin | None = None) -> None:
    """Checks across fields: method names, arm menus, drafter options, the swept method."""
    from drafters import DRAFTERS

    where = where or _Origin(None, "", {})

    def fail(path: tuple[str, ...], msg: str) -> None:
        raise ConfigError(f"{where(path)}: {_dotted(path)} {msg}")

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
        elif m in HF_METHODS:
            if cfg.decode.temperature > 0:
                fail(key, f"is {m!r}, which only runs greedy; set decode.temperature = 0 or drop it")
        else:
            _check_arm(m, key, fail, DRAFTERS)
    for name, p in cfg.policies.items():
        if not p.arms:
            fail(("policies", name, "arms"), "is empty")
        for j, a in enumerate(p.arms):
            _check_arm(a, ("policies", name, f"arms[{j}]"), fail, DRAFTERS)
        _check_policy(name, p, fail)
    for name, opts in cfg.drafters.items():
        if name not in DRAFTERS:
            fail(("drafters", name), f"is not a drafter; known: {', '.join(sorted(DRAFTERS))}")
        valid = keywords_of(DRAFTERS[name])
        for opt in opts:
            if opt not in valid:
                fail(("drafters", name, opt), f"is not an option of {name}; valid: {', '.join(valid)}")
    if cfg.sweep.method and cfg.sweep.method not in cfg.methods:
        fail(("sweep", "method"), f"is {cfg.sweep.method!r}, not one of methods {list(cfg.methods)}")
    for j, d in enumerate(cfg.sweep.drafters):
        if d not in DRAFTERS:
            fail(("sweep", f"drafters[{j}]"), f"is {d!r}; known drafters: {', '.join(sorted(DRAFTERS))}")


def keywords_of(cls: Any) -> list[str]:
    """Keyword arguments a class accepts, following ``**kwargs`` up the base classes."""
    names: list[str] = []
    for klass in getattr(cls, "__mro__", (cls,)):
        init = getattr(klass, "__init__", None)
        if init is None or init is object.__init__:
            break
        params = inspect.signature(init).parameters.values()
        names += [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return [n for n in dict.fromkeys(names) if n not in ("self", "arms", "obs_size", "features")]


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


def _check_policy(name: str, p: PolicyConfig, fail: Any) -> None:
    types_ = policy_types()
    if types_ is None:
        return  # nothing to check against yet
    key = ("policies", name)
    if p.kind not in types_:
        fail((*key, "kind"), f"is {p.kind!r}; known policy types: {', '.join(sorted(types_))}")
    try:
        valid = keywords_of(policy_class(p.kind))
    except ImportError:
        return  # the policy's optional dependencies are missing; it fails when built
    for opt in p.params:
        if opt not in valid:
            fail((*key, "params", opt), f"is not a parameter of {p.kind}; valid: {', '.join(valid)}")


def _check_arm(name: str, key: tuple[str, ...], fail: Any, registry: dict[str, Any]) -> None:
    from drafters import DrafterError
    from env.engine import parse_arm

    try:
        arm = parse_arm(name)
    except DrafterError as err:
        fail(key, f"is not a method: {err}")
        return
    if arm.drafter is not None and arm.drafter not in registry:
        fail(key, f"is {name!r}: unknown drafter {arm.drafter!r}; known: {', '.join(sorted(registry))}")


def diff_configs(a: Config, b: Config, ignore: tuple[str, ...] = ()) -> list[str]:
    """Dotted keys whose values differ between two configs, except those starting with an ``ignore`` prefix."""
    from dataclasses import asdict

    fa, fb = _flat(asdict(a)), _flat(asdict(b))
    keys = fa.keys() | fb.keys()
    return sorted(k for k in keys if not k.startswith(ignore) and fa.get(k) != fb.get(k))


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
    return out


# ---------------------------------------------------------------------------------------------- writing


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML")


def to_toml(cfg: Any, header: str = "") -> str:
    """The config as TOML (every field, resolved); ``load_config(text=to_toml(cfg)) == cfg``."""
    lines = [f"# {line}" for line in header.splitlines()]

    def table(obj: Any, path: tuple[str, ...]) -> None:
        scalars, subs = [], []
        for f in fields(obj):
            v = getattr(obj, f.name)
            if is_dataclass(v):
                subs.append((f.name, v))
            elif isinstance(v, dict):
                for k, sub in v.items():
                    subs.append((f"{f.name}.{k}", sub))
            else:
                scalars.append(f"{f.name} = {_toml_value(v)}")
        if path and (scalars or not subs):
            lines.extend(["", f"[{'.'.join(path)}]"])
        lines.extend(scalars)
        for name, sub in subs:
            if isinstance(sub, dict):
                lines.extend(["", f"[{'.'.join((*path, name))}]"])
                lines.extend(f"{k} = {_toml_value(x)}" for k, x in sub.items())
            else:
                table(sub, (*path, name))

    table(cfg, ())
    return "\n".join(lines).lstrip("\n") + "\n"


def defaults_of(cls: type) -> dict[str, Any]:
    """Field name -> default, for docs and tests."""
    out = {}
    for f in fields(cls):
        out[f.name] = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
    return out


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
