"""Strict TOML <-> frozen dataclasses, the machinery under ``experiments.config``.

- ``build(cls, raw, origin)``: a dataclass from a parsed TOML dict, refusing unknown keys (with the closest valid
  one suggested), wrong types and non-finite numbers (TOML's ``nan`` and ``inf``: a NaN passes every bound check,
  and JSON cannot write either), integers past TOML's 64-bit range (``tomllib`` reads any size; a larger one
  overflows where it becomes a float), and checking field metadata (``choices``, ``min``, ``max``, ``min_open``; see
  ``opt``);
- ``Origin``: where a dotted key was set: ``file:line`` (found by scanning the text: ``tomllib`` keeps no
  positions), ``--set key=value`` or ``sweep trial (key)``;
- ``parse_set`` / ``apply_override``: ``a.b=v`` overrides, ``v`` read as a TOML value;
- ``to_toml``: every field written out, so that reading it back gives the same object;
- ``diff``: the dotted keys where two configs differ.
"""

from __future__ import annotations

import difflib
import math
import re
import sys
import types
import typing
from dataclasses import field, fields, is_dataclass
from typing import Any

from env.file_checks import int64_problem  # (the env layer checks trace headers too)

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key and where it was set."""


def opt(default: Any, **meta: Any) -> Any:
    """A dataclass field with validation metadata: ``choices``, ``min``, ``max``, ``min_open`` (true: the value must
    be above ``min``), ``nonfinite`` (true: ``nan``/``inf`` allowed, which no field is so far)."""
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


# ---------------------------------------------------------------------------------------------- where keys live


class Origin:
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


def dotted(path: tuple[str, ...]) -> str:
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


def _coerce(tp: Any, value: Any, path: tuple[str, ...], where: Origin, finite: bool = True) -> Any:
    def bad() -> ConfigError:
        got = "a table" if isinstance(value, dict) else f"{value!r}"
        return ConfigError(f"{where(path)}: {dotted(path)} must be {_type_name(tp)}, got {got}")

    if is_dataclass(tp):
        if not isinstance(value, dict):
            raise bad()
        return build(tp, value, path, where)
    origin = typing.get_origin(tp)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise bad()
        (elem, _) = typing.get_args(tp)
        return tuple(
            _coerce(elem, v, (*path[:-1], f"{path[-1]}[{i}]"), where, finite) for i, v in enumerate(value)
        )
    if origin is dict:
        if not isinstance(value, dict):
            raise bad()
        _, val_tp = typing.get_args(tp)
        return {str(k): _coerce(val_tp, v, (*path, str(k)), where, finite) for k, v in value.items()}
    if type(value) is int and (tp in (int, float) or origin in (typing.Union, types.UnionType)):
        why = int64_problem(value)
        if why:
            raise ConfigError(f"{where(path)}: {dotted(path)} {why}")
    if origin in (typing.Union, types.UnionType):
        if finite and isinstance(value, float) and not math.isfinite(value):
            raise _nonfinite(value, path, where)
        members = typing.get_args(tp)
        tables = [m for m in members if is_dataclass(m) or typing.get_origin(m) is dict]
        if isinstance(value, dict) and len(tables) == 1:  # a table can be one member only: its own error
            return _coerce(tables[0], value, path, where, finite)
        for member in members:
            try:
                return _coerce(member, value, path, where, finite)
            except ConfigError:
                continue
        raise bad()
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an integer too large for a float (refused above already, kept as a guard)
            raise _nonfinite(value, path, where) from None
        if finite and not math.isfinite(number):
            raise _nonfinite(value, path, where)
        return number
    if tp is str and type(value) is str and "\x00" in value:  # no path, name or option holds one
        raise ConfigError(f"{where(path)}: {dotted(path)} holds a NUL character (\\x00)")
    if tp in (int, str, bool) and type(value) is tp:
        return value
    raise bad()


def _nonfinite(value: float, path: tuple[str, ...], where: Origin) -> ConfigError:
    return ConfigError(f"{where(path)}: {dotted(path)} must be a finite number, got {value}")


def build(cls: type, raw: dict[str, Any], path: tuple[str, ...], where: Origin) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in fields(cls)]
    for key in raw:
        if key not in names:
            near = difflib.get_close_matches(key, names, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            table = f"[{dotted(path)}]" if path else "the top level"
            raise ConfigError(
                f"{where((*path, key))}: unknown key {dotted((*path, key))!r} in {table}{hint} "
                f"(valid: {', '.join(names)})"
            )
    kwargs = {}
    for f in fields(cls):
        if f.name not in raw:
            continue
        meta = f.metadata
        val = _coerce(hints[f.name], raw[f.name], (*path, f.name), where, not meta.get("nonfinite", False))
        loc = f"{where((*path, f.name))}: {dotted((*path, f.name))}"
        if "choices" in meta and val not in meta["choices"]:
            raise ConfigError(f"{loc} is {val!r}; valid: {', '.join(meta['choices'])}")
        if "min" in meta or "max" in meta:
            low, high = meta.get("min", -math.inf), meta.get("max", math.inf)
            above = meta.get("min_open", False)
            # written so that NaN (where a field allows it) fails too: every comparison with NaN is False
            low_ok, high_ok = (val > low if above else val >= low), val <= high
            if above and "max" in meta and not (low_ok and high_ok):
                raise ConfigError(f"{loc} must be in ({low:g}, {high:g}], got {val}")
            if not low_ok:
                raise ConfigError(f"{loc} must be {'>' if above else '>='} {low}, got {val}")
            if not high_ok:
                raise ConfigError(f"{loc} must be <= {high}, got {val}")
        kwargs[f.name] = val
    return cls(**kwargs)


# ---------------------------------------------------------------------------------------------- overrides


MAX_DEPTH = 64  # tables and arrays in one --set or --drafter-option value


def _depth(value: Any) -> int:
    """How deep tables and arrays nest in ``value`` (a scalar: 0), without recursion."""
    deepest, todo = 0, [(value, 0)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, dict):
            todo += [(x, d + 1) for x in v.values()]
        elif isinstance(v, list):
            todo += [(x, d + 1) for x in v]
        deepest = max(deepest, d)
    return deepest


def parse_set(item: str, flag: str = "--set") -> tuple[tuple[str, ...], Any]:
    """``a.b=v`` -> (("a", "b"), v); v is read as a TOML value (``3e-4``, ``true``, ``["ar"]``), else a string.
    ``flag`` names the option in messages."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not p for p in key.split(".")):
        raise ConfigError(
            f"--set {item!r}: expected KEY=VALUE with a dotted key, e.g. --set decode.max_new_tokens=16"
        )
    try:
        doc = tomllib.loads(f"v = {raw.strip()}")
    except tomllib.TOMLDecodeError:
        doc = {"v": raw.strip()}
    except RecursionError:  # tables or arrays nested deeper than the parser recurses
        raise ConfigError(f"{flag} {key[:80]}: the value nests too deep to read") from None
    if _depth(doc) > MAX_DEPTH:  # (whether the parser recursed that deep depends on the stack and its limit)
        raise ConfigError(
            f"{flag} {key[:80]}: the value nests too deep to read (more than {MAX_DEPTH} levels)"
        )
    if len(doc) != 1:  # "1\nmax_ngram=2": a second key past a line break would be dropped unread
        raise ConfigError(f"{flag} {key[:80]}: the value is more than one TOML value (a line break in it?)")
    return tuple(key.split(".")), doc["v"]


def apply_override(raw: dict[str, Any], path: tuple[str, ...], value: Any, origin: str) -> None:
    node = raw
    for i, part in enumerate(path[:-1]):
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"{origin}: {dotted(path[: i + 1])} is not a table, cannot set {dotted(path)}")
        node = nxt
    node[path[-1]] = value


def diff(a: Any, b: Any, ignore: tuple[str, ...] = ()) -> list[str]:
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


# Control characters (U+0000-001F, U+007F) may not stand raw in a TOML basic string: written as \uXXXX
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _basic_string(s: str) -> str:
    s = s.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + _CONTROL.sub(lambda m: f"\\u{ord(m.group()):04X}", s) + '"'


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return _basic_string(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):  # an inline table (a hybrid's parts' options within a drafter's table)
        return "{" + ", ".join(f"{_key(str(k))} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {v!r} as TOML")


def _key(k: str) -> str:
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else _toml_value(k)


def to_toml(cfg: Any, header: str = "") -> str:
    """The config as TOML (every field, resolved); ``load_config(text=to_toml(cfg)) == cfg``."""
    # a comment holds no control character but tab (a config path in the header may)
    lines = [f"# {_CONTROL.sub('?', line)}" for line in header.splitlines()]

    def table(obj: Any, path: tuple[str, ...]) -> None:
        scalars, subs = [], []
        for f in fields(obj):
            v = getattr(obj, f.name)
            if is_dataclass(v):
                subs.append((f.name, v))
            elif isinstance(v, dict) and all(is_dataclass(x) or isinstance(x, dict) for x in v.values()):
                subs += [(f"{f.name}.{_key(k)}", sub) for k, sub in v.items()]  # a table of tables
            elif isinstance(v, dict):
                subs.append((f.name, v))  # a table of values
            else:
                scalars.append(f"{f.name} = {_toml_value(v)}")
        if path and (scalars or not subs):
            lines.extend(["", f"[{'.'.join(path)}]"])
        lines.extend(scalars)
        for name, sub in subs:
            if isinstance(sub, dict):
                lines.extend(["", f"[{'.'.join((*path, name))}]"])
                lines.extend(f"{_key(k)} = {_toml_value(x)}" for k, x in sub.items())
            else:
                table(sub, (*path, name))

    table(cfg, ())
    return "\n".join(lines).lstrip("\n") + "\n"
