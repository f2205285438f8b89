"""Checks of the files draftgym reads back, field by field: a trace's header and arrays (``env.trace``) and a cost
model's JSON (``env.cost``). Each check raises ``Bad(field, problem)``; the loader names the file and raises its own
error class, in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from drafters.base import shown

MAX_COUNT = 2**31 - 1  # node counts, context lengths and vocabularies past this are damage, not measurements
MAX_NEW_TOKENS = 2**20  # a trace header's figures past these are damage, not a recording
MAX_SHAPE = (
    1 << 20
)  # a recorded drafter shape's depth, topk and budget (an n-gram drafter's topk reaches 65,536)


class Bad(Exception):
    """(field, what is wrong): a part of a file that fails its check; the loader names the file."""


INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1  # TOML's integers; ``tomllib`` reads any size


def int64_problem(value: Any) -> str | None:
    """Why ``value`` (or an integer inside a list or table of it) is outside TOML's 64-bit integers, or None. A
    larger one would overflow where it is made a float (``float``, ``math.isfinite``) or a tensor."""
    if type(value) is int and not INT64_MIN <= value <= INT64_MAX:
        digits = str(abs(value))
        got = f"{'-' if value < 0 else ''}{digits[:6]}... ({len(digits)} digits)"
        return f"is an integer outside TOML's 64-bit range (-2**63 .. 2**63-1): {got}"
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return next((why for why in map(int64_problem, items) if why), None)


def not_a_file(path: Path) -> str:
    """Why ``path``, which is no regular file, cannot be read as one: what a message says after its name (a FIFO
    was reported as missing)."""
    if not path.exists():
        return (
            "is a symbolic link to nothing (a loop, or its target is gone)"
            if path.is_symlink()
            else "does not exist"
        )
    if path.is_dir():
        return "is a directory, not a file"
    return "is not a regular file (a FIFO, a device or a socket)"


def one_line(text: str) -> str:
    return " ".join(text.split())


# ---- a trace (env.trace.load_trace) ----


def get(
    d: dict[str, Any],
    path: str | tuple[str, ...],
    kind: type = object,
    need: str = "",
    optional: bool = False,
) -> Any:
    """The value at ``path`` (dotted, or the keys) of the JSON object ``d``, each step an object, an instance of
    ``kind`` (a bool is no int); ``optional``: None where the last key is absent."""
    cur: Any = d
    keys = path.split(".") if isinstance(path, str) else list(path)
    for i, key in enumerate(keys):
        if not isinstance(cur, dict):
            raise Bad(".".join(keys[:i]), f"must be a JSON object, got {shown(cur)}")
        if key not in cur:
            if optional and i == len(keys) - 1:
                return None
            raise Bad(".".join(keys[: i + 1]), "is missing")
        cur = cur[key]
    if not isinstance(cur, kind) or (isinstance(cur, bool) and kind is int):
        raise Bad(".".join(keys), f"must be {need}, got {shown(cur)}")
    return cur


def count(d: dict[str, Any], path: str, lo: int, hi: int, optional: bool = False) -> Any:
    v = get(d, path, int, f"an integer in {lo}..{hi}", optional)
    if v is not None and not lo <= v <= hi:
        raise Bad(path, f"must be an integer in {lo}..{hi}, got {v}")
    return v


def strings(d: dict[str, Any], path: str) -> list[str]:
    v = get(d, path, list, "a JSON list of strings")
    if not all(isinstance(x, str) for x in v):
        raise Bad(path, "must be a JSON list of strings")
    return v


def check_trace_header(h: dict[str, Any]) -> None:
    """Every header field replay and the commands read, with its type and range (``Bad`` or
    ``FeatureSpecError``): the model fingerprint, max_new_tokens, the feature spec and its names, the drafters
    and the prompts."""
    for key in ("model_id", "tokenizer_sha256", "dtype"):
        get(h, f"model.{key}", str, "a string")
    vocab = count(h, "model.vocab_size", 1, MAX_COUNT)
    count(h, "model.hidden_size", 1, MAX_COUNT, optional=True)
    eos = get(h, "model.eos_ids", list, "a JSON list of token ids")
    if not all(isinstance(e, int) and not isinstance(e, bool) and 0 <= e < vocab for e in eos):
        raise Bad("model.eos_ids", f"must be token ids in 0..{vocab - 1}, got {shown(eos)}")
    count(h, "max_new_tokens", 2, MAX_NEW_TOKENS)
    for key in ("sampling", "workload", "created"):
        get(h, key, str, "a string", optional=True)
    from env.features import FeatureSpec, position_feature_names

    spec = FeatureSpec.from_dict(get(h, "features.spec", dict, "a JSON object"), "features.spec")
    names = get(h, "features.names", list, "a JSON list of feature names", optional=True)
    if names is not None and names != position_feature_names(spec):
        raise Bad("features.names", f"do not match features.spec {spec.as_dict()}")
    drafters = get(h, "drafters", dict, "a JSON object of drafter name to its recording")
    for name in drafters:
        if not name or "/" in name or any(c.isspace() or not c.isprintable() for c in name):
            raise Bad("drafters", f"names a drafter {name!r} (a name is non-empty, without spaces or '/')")
        get(h, ("drafters", name, "exact"), bool, "true or false")
        shape = get(h, ("drafters", name, "shape"), list, "[depth, topk, budget]")
        ok = len(shape) == 3 and all(isinstance(x, int) and not isinstance(x, bool) for x in shape)
        if not ok or not (
            0 <= shape[0] <= MAX_SHAPE and 1 <= shape[1] <= MAX_SHAPE and 0 <= shape[2] <= MAX_SHAPE
        ):
            raise Bad(
                f"drafters.{name}.shape",
                f"must be [depth, topk, budget] within 0..{MAX_SHAPE} (topk >= 1), got {shown(shape)}",
            )
        get(h, ("drafters", name, "options"), dict, "a JSON object", optional=True)
    ids = strings(h, "prompts.ids")
    strings(h, "prompts.categories")
    if len(set(ids)) != len(ids):
        raise Bad("prompts.ids", "repeat a prompt id")


def check_trace_arrays(t: Any) -> None:
    """Each array's rank and kind of number, the feature columns the spec names, as many prompt ids as prompts."""
    from env.features import position_feature_names

    ints = [("prompt_tokens", t.prompt_tokens), ("prompt_off", t.prompt_off), ("traj", t.traj),
            ("traj_off", t.traj_off)]  # fmt: skip
    for n, a in t.trees.items():
        ints += [(f"tree/{n}/off", a.off), (f"tree/{n}/tokens", a.tokens), (f"tree/{n}/parents", a.parents)]
    for name, a in ints:  # signed: an unsigned offset's differences wrap around instead of going negative
        if a.ndim != 1 or not np.issubdtype(a.dtype, np.signedinteger):
            raise Bad(name, f"must be a 1-D signed integer array, got {a.dtype} of shape {a.shape}")
    cols = len(position_feature_names(t.spec))
    if t.feat.ndim != 2 or not np.issubdtype(t.feat.dtype, np.floating):
        raise Bad(
            "feat",
            f"must be a 2-D float array [positions, {cols}], got {t.feat.dtype} of shape {t.feat.shape}",
        )
    if t.feat.shape[1] != cols:
        raise Bad("feat", f"has {t.feat.shape[1]} columns, the feature spec names {cols}")
    prompts = t.traj_off.shape[0] - 1
    if prompts < 1:
        raise Bad("traj_off", "holds no prompt")
    if t.traj.size == 0:
        raise Bad("traj", "holds no position (no step to replay)")
    for key in ("ids", "categories"):
        if len(t.header["prompts"][key]) != prompts:
            raise Bad(
                f"header prompts.{key}",
                f"name {len(t.header['prompts'][key])} prompts, the arrays hold {prompts}",
            )


def check_trace_values(t: Any) -> None:
    """Token ids in the vocabulary, no empty prompt, trajectories no longer than max_new_tokens, features finite and
    within their bounds (``env.features``: [0, 1], the hidden projection [-1, 1])."""
    from env.features import POSITION_HEAD

    vocab = t.header["model"]["vocab_size"]
    for name, a in (("prompt_tokens", t.prompt_tokens), ("traj", t.traj)):
        if a.size and (a.min() < 0 or a.max() >= vocab):
            raise Bad(name, f"holds a token id outside the vocabulary [0, {vocab})")
    if (np.diff(t.prompt_off) < 1).any():  # a recorded prompt is a chat template's tokens at least
        raise Bad("prompt_off", "holds an empty prompt")
    longest = int(np.diff(t.traj_off).max())
    if longest > t.max_new_tokens:
        raise Bad("traj", f"holds a trajectory of {longest} tokens, past max_new_tokens {t.max_new_tokens}")
    f = t.feat
    if not np.isfinite(f).all():
        raise Bad("feat", "holds a value that is not finite")
    head = len(POSITION_HEAD)
    if f.size and (f[:, :head].min() < 0 or f[:, :head].max() > 1 or np.abs(f[:, head:]).max(initial=0) > 1):
        raise Bad("feat", "holds a value out of its bounds ([0, 1]; hidden_*: [-1, 1])")


# ---- a cost model (env.cost.FittedCostModel.from_json) ----


def text(d: dict[str, Any], path: str) -> str:
    v = get(d, path)
    if not isinstance(v, str) or not v:
        raise Bad(path, f"must be a non-empty string, got {shown(v)}")
    return v


def drafter_name(v: Any) -> str:
    if not v:
        raise Bad("drafters", "names a drafter with an empty name")
    return str(v)


def integer(v: Any, path: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise Bad(path, f"must be an integer in {lo}..{hi}, got {shown(v)}")
    return v


MAX_SECONDS = 1e6  # per step or token: far past any machine, and finite in the float32 tables replay keeps


def finite_seconds(v: Any, path: str, positive: bool = False) -> float:
    """A finite number of seconds, >= 0 (``positive``: > 0), at most ``MAX_SECONDS``."""
    ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    try:
        x = float(v) if ok else np.nan
    except OverflowError:
        x = np.inf
    if not (np.isfinite(x) and (x > 0 if positive else x >= 0) and x <= MAX_SECONDS):
        raise Bad(
            path,
            f"must be a finite number {'> 0' if positive else '>= 0'} and <= {MAX_SECONDS:g}, got {shown(v)}",
        )
    return x


def curve_points(d: dict[str, Any], path: str) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Node counts (increasing integers from 1: the one-node step is what an AR token costs, which the curve holds
    flat below its first node) and their seconds (> 0, as many); the last segment, which the curve extends past its
    last node, must not fall (else a large tree would cost less than nothing)."""
    nodes, seconds = get(d, f"{path}.nodes"), get(d, f"{path}.seconds")
    for key, v in (("nodes", nodes), ("seconds", seconds)):
        if not isinstance(v, list) or not v:
            raise Bad(f"{path}.{key}", f"must be a non-empty JSON list, got {shown(v)}")
    if len(nodes) != len(seconds):
        raise Bad(path, f"has {len(nodes)} nodes but {len(seconds)} seconds")
    ns = tuple(integer(n, f"{path}.nodes[{i}]", 1, MAX_COUNT) for i, n in enumerate(nodes))
    ss = tuple(finite_seconds(s, f"{path}.seconds[{i}]", positive=True) for i, s in enumerate(seconds))
    if any(b <= a for a, b in zip(ns, ns[1:])):
        raise Bad(f"{path}.nodes", f"must increase, got {shown(list(ns))}")
    if ns[0] != 1:
        raise Bad(f"{path}.nodes", f"must start at 1 (one node: an AR step), got {shown(list(ns))}")
    if len(ss) > 1 and ss[-1] < ss[-2]:
        raise Bad(f"{path}.seconds", "must not fall over the last two nodes (the curve extends that slope)")
    return ns, ss


def drafter_entry(entry: Any, path: str) -> dict[str, Any]:
    """One drafter's calibration: ``shapes`` (arm name -> seconds), ``base_s`` and ``per_node_s`` (>= 0)."""
    if not isinstance(entry, dict):
        raise Bad(path, f"must be a JSON object with shapes, base_s and per_node_s, got {shown(entry)}")
    shapes = entry.get("shapes")
    if not isinstance(shapes, dict):
        raise Bad(
            f"{path}.shapes",
            "is missing" if shapes is None else f"must be a JSON object, got {shown(shapes)}",
        )
    out = dict(entry)
    out["shapes"] = {str(k): finite_seconds(v, f"{path}.shapes.{k}") for k, v in shapes.items()}
    for key in ("base_s", "per_node_s"):
        if key not in entry:
            raise Bad(f"{path}.{key}", "is missing")
        out[key] = finite_seconds(entry[key], f"{path}.{key}")
    if not isinstance(entry.get("options", {}), dict):
        raise Bad(f"{path}.options", f"must be a JSON object, got {shown(entry['options'])}")
    return out
