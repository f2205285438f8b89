"""The policy seam: what a policy is, how it is saved, and how any saved policy loads back.

A policy picks an arm index each step (``act(obs) -> int``) from a fixed arm menu; online learners also take
``update(obs, action, reward, info)`` after the step (reward = the step's instantaneous speedup, DESIGN.md "Arms,
observations, rewards"); ``reset()`` starts an episode (a new prompt). Every policy remembers the arm menu and the
observation size it was built for, so that a file trained for another menu or another feature set is refused at
load instead of silently choosing the wrong arms.

The saved file is a zip archive:

- ``header.json``: ``format`` ("draftgym-policy"), ``format_version``, ``type`` (the registry key below),
  ``kind`` (static | schedule | heuristic | bandit | rl | predictor | oracle), ``arms`` (arm names, in action order),
  ``obs_size``, ``features`` (observation feature names, when known), ``params`` (the constructor's JSON
  arguments), ``versions`` (library versions at save time), ``created`` and ``payload`` (sha256 of every other
  member, so a truncated or altered file fails at load with a clear message; a member it does not name is
  refused unread, and the whole file, the archives inside it included, unpacks to at most ``POLICY_BYTES``);
- payload members the policy type needs (``state.json`` / ``state.npz`` for bandits, ``model.npz`` for the
  scikit-learn predictors, ``network.json`` + ``policy.safetensors`` for stable-baselines3; files of earlier
  versions hold stable-baselines3's ``model.zip`` instead, read as data like a plain stable-baselines3 zip below).

A policy file is read as data, never unpickled: JSON, ``.npz`` arrays (``allow_pickle=False``) and safetensors, so
loading a file made by someone else cannot run code; a hostile or damaged file fails with a ``PolicyError``. The
checksums catch damage, not tampering: a file from an unknown source may still choose bad arms.

``load_policy`` also reads a plain stable-baselines3 zip (``model.save``) of an ``MlpPolicy`` trained on the env,
as data too: only its ``policy.pth`` (``torch.load(weights_only=True)``) and the plain JSON fields of ``data``
(``policies.sb3_files``); its arm names are the given menu, or the default env's.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import importlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from policies.archive import (
    ARCHIVE_MEMBERS,
    POLICY_BYTES,
    SB3_MEMBERS,
    is_sb3_zip,
    one_line,
    read_archive,
    write_archive,
)
from policies.errors import PolicyError

FORMAT = "draftgym-policy"
FORMAT_VERSION = 1
KINDS = ("static", "schedule", "heuristic", "bandit", "rl", "predictor", "oracle")

# type -> "module:Class". Lazy, so that loading a bandit does not import torch or stable-baselines3.
POLICY_TYPES: dict[str, str] = {
    "static": "policies.static:StaticPolicy",
    "hf_schedule": "policies.heuristic:HFSchedulePolicy",
    "confidence": "policies.heuristic:ConfidencePolicy",
    "ucb1": "policies.bandits:UCB1",
    "thompson": "policies.bandits:ThompsonSampling",
    "exp3": "policies.bandits:EXP3",
    "linucb": "policies.linucb:LinUCB",
    "sb3": "policies.rl:SB3Policy",
    "sb3_rows": "policies.rl_rows:SB3RowPolicy",
    "predictor": "policies.predictor:PredictorPolicy",
    "serve_table": "policies.serving:BatchTablePolicy",
    "smartspec": "policies.serving:SmartSpecPolicy",
    "turbospec": "policies.turbospec:TurboSpecPolicy",
    "bucket_ucb": "policies.serving:BucketUCB",
    "table_first": "policies.serve_rows:TableFirstPolicy",
    "serve_predictor": "policies.serve_predictor:ServePredictorPolicy",
}


def real(name: str, value: object, *, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
         integer: bool = False) -> float:  # fmt: skip
    """``value`` as a policy parameter: a finite real number (an integer where ``integer``; never a bool) within
    [``lo``, ``hi``] (``lo_open``: above ``lo``); else ``PolicyError`` naming ``name`` and the range."""
    import math

    kinds = (int,) if integer else (int, float)
    try:  # (an integer past float's range: OverflowError)
        ok = isinstance(value, kinds) and not isinstance(value, bool) and math.isfinite(value)
    except OverflowError:
        ok = False
    if ok and lo is not None:
        ok = value > lo if lo_open else value >= lo
    if ok and hi is not None:
        ok = value <= hi
    if not ok:
        span = f"{'(' if lo_open else '['}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"
        raise PolicyError(
            f"{name} must be {'an integer' if integer else 'a finite number'} in {span}, got {repr(value)[:60]}"
        )
    return value  # type: ignore[return-value]


@runtime_checkable
class Policy(Protocol):
    """Chooses an arm index each step. ``update`` is optional (online learners define it)."""

    kind: str
    arm_names: tuple[str, ...]
    obs_size: int

    def act(self, obs: np.ndarray | None) -> int: ...

    def reset(self) -> None: ...

    def save(self, path: str | Path) -> None: ...


@runtime_checkable
class OnlinePolicy(Policy, Protocol):
    def update(self, obs: np.ndarray | None, action: int, reward: float, info: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class Header:
    type: str
    kind: str
    arms: tuple[str, ...]
    obs_size: int
    params: dict[str, Any] = field(default_factory=dict)
    features: tuple[str, ...] | None = None
    versions: dict[str, str | None] = field(default_factory=dict)
    created: str = ""
    payload: dict[str, str] = field(default_factory=dict)  # member name -> sha256
    meta: dict[str, Any] = field(default_factory=dict)  # how it was trained: trace, split, feature spec, ...


class BasePolicy:
    """Shared plumbing: the arm menu, the observation size, ``reset``, and ``save`` through ``state()``.

    Subclasses set ``type_name`` and ``kind``, and implement ``act``; stateful ones override ``state()`` (extra
    payload members) and ``restore(files)``. ``params()`` returns the constructor's keyword arguments."""

    type_name = ""
    kind = ""

    def __init__(self, arms: Sequence[str], obs_size: int = 0, features: Sequence[str] | None = None) -> None:
        self.arm_names = _names(arms, "the arm menu")
        if not self.arm_names:
            raise PolicyError("a policy needs at least one arm")
        if len(set(self.arm_names)) != len(self.arm_names):
            raise PolicyError(f"the arm menu lists an arm twice: {list(self.arm_names)}")
        from numbers import Integral

        if isinstance(obs_size, Integral) and not isinstance(obs_size, (bool, np.bool_)):
            obs_size = int(obs_size)  # (a numpy integer)
        self.obs_size = int(real("obs_size", obs_size, lo=0, hi=MAX_OBS, integer=True))
        self.features = _names(features, "features") if features is not None else None
        if self.features is not None and len(self.features) != self.obs_size:
            raise PolicyError(
                f"features names {len(self.features)} observation entries; obs_size is {self.obs_size}"
            )
        self.meta: dict[str, Any] = {}  # training provenance, saved in the header (``meta``)
        self.source: str | None = None  # the file it was loaded from

    @property
    def num_arms(self) -> int:
        return len(self.arm_names)

    @property
    def name(self) -> str:
        return self.type_name

    def reset(self) -> None:
        """Start an episode; learned statistics are kept."""

    def params(self) -> dict[str, Any]:
        return {}

    def state(self) -> dict[str, bytes]:
        return {}

    def restore(self, files: dict[str, bytes]) -> None:
        """Restore what ``state()`` saved."""

    @classmethod
    def from_header(cls, header: Header, files: dict[str, bytes]) -> BasePolicy:
        policy = cls(header.arms, header.obs_size, features=header.features, **header.params)
        policy.restore(files)
        policy.meta = dict(header.meta)
        return policy

    def save(self, path: str | Path) -> None:
        header = Header(
            type=self.type_name,
            kind=self.kind,
            arms=self.arm_names,
            obs_size=self.obs_size,
            params=self.params(),
            features=self.features,
            meta=self.meta,
        )
        write_policy(path, header, self.state())

    def _check_update(self, action: object, reward: object) -> tuple[int, float]:
        """``update``'s action and reward: an arm index of the menu and a finite real number (a NaN reward would
        turn the statistics NaN, after which every policy picks arm 0 for ever; -1 credited the last arm)."""
        from numbers import Integral, Real

        # a 0-d array or tensor (what predict returns for one observation) is its one value
        action, reward = (x.item() if getattr(x, "ndim", None) == 0 and hasattr(x, "item") else x
                          for x in (action, reward))  # fmt: skip
        if (
            isinstance(action, (bool, np.bool_))
            or not isinstance(action, Integral)
            or not 0 <= action < self.num_arms
        ):
            raise PolicyError(
                f"{self.name}: update's action must be an arm index in 0..{self.num_arms - 1}, got {repr(action)[:40]}"
            )
        if (
            isinstance(reward, (bool, np.bool_))
            or not isinstance(reward, Real)
            or not np.isfinite(float(reward))
        ):
            raise PolicyError(
                f"{self.name}: update's reward must be a finite number, got {repr(reward)[:40]}"
            )
        return int(action), float(reward)

    def _check_batch(self, obs: object) -> np.ndarray:
        """``act_batch``'s observations: a numeric [B, obs_size] array of finite values (a NaN row got arm 0, a
        [B, 1] array was broadcast to every feature)."""
        x = np.asarray(obs)
        if x.ndim != 2 or x.shape[1] != self.obs_size or x.dtype.kind not in "fiu":
            raise PolicyError(
                f"{self.name}: act_batch takes a numeric array of shape (rows, {self.obs_size}), "
                f"got {x.dtype} of shape {x.shape}"
            )
        if x.dtype.kind == "f" and not np.isfinite(x).all():
            r, c = np.argwhere(~np.isfinite(x))[0]
            raise PolicyError(f"{self.name}: act_batch's observations hold {x[r, c]} at row {r}, index {c}")
        return x

    def _check_obs(self, obs: np.ndarray | None) -> np.ndarray:
        """The observation as a float vector of ``obs_size``; a missing or wrong-sized one is an error."""
        if obs is None:
            raise PolicyError(f"{self.name} needs an observation of size {self.obs_size}, got None")
        x = np.asarray(obs, dtype=np.float64).reshape(-1)
        if x.shape[0] != self.obs_size:
            raise PolicyError(f"{self.name} expects an observation of size {self.obs_size}, got {x.shape[0]}")
        if not np.isfinite(x).all():  # every model would pick some arm from it, none for a reason
            bad = np.flatnonzero(~np.isfinite(x))
            raise PolicyError(
                f"{self.name}: the observation holds {x[bad[0]]} at index {bad[0]} ({bad.size} not finite)"
            )
        return x

    def __repr__(self) -> str:
        return f"{type(self).__name__}(arms={list(self.arm_names)}, obs_size={self.obs_size})"


MAX_OBS = 1 << 20  # observation entries (as a policy file's header may hold)
MAX_PARAM = (
    1e6  # a bandit's exploration constant or reward scale: far past any use (1e308 made every arm alike)
)
MAX_STEPS = 1 << 40  # a window or horizon of steps


def _names(value: object, what: str) -> tuple[str, ...]:
    """A list of non-empty strings (a string is no list: "abc" was a menu of three arms a, b, c)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise PolicyError(f"{what} must be a list of names, got {repr(value)[:60]}")
    names = tuple(value)
    if len(names) > MAX_OBS or not all(isinstance(n, str) and n for n in names):
        bad = next((n for n in names if not (isinstance(n, str) and n)), f"{len(names)} names")
        raise PolicyError(f"{what} must be a list of non-empty strings, got {repr(bad)[:60]}")
    return tuple(str(n) for n in names)  # (numpy's strings too)


def library_versions() -> dict[str, str | None]:
    """The versions a policy file names (the libraries its training and loading use)."""
    from env.machine import library_versions as versions

    return versions(("draftgym", "numpy", "scikit-learn", "stable-baselines3", "gymnasium", "torch"))


def write_policy(path: str | Path, header: Header, files: dict[str, bytes]) -> None:
    """Write the archive atomically (a temporary file renamed into place)."""
    if header.type not in POLICY_TYPES:
        raise PolicyError(f"unknown policy type {header.type!r}; known: {', '.join(sorted(POLICY_TYPES))}")
    if header.kind not in KINDS:
        raise PolicyError(f"unknown policy kind {header.kind!r}; known: {', '.join(KINDS)}")
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "type": header.type,
        "kind": header.kind,
        "arms": list(header.arms),
        "obs_size": header.obs_size,
        "features": None if header.features is None else list(header.features),
        "params": header.params,
        "versions": library_versions(),
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "payload": {name: hashlib.sha256(data).hexdigest() for name, data in sorted(files.items())},
        "meta": header.meta,
    }
    path = Path(path)
    if (
        not path.name or path.is_dir() or (path.exists() and not path.is_file())
    ):  # (a bare OS error, a .tmp left)
        raise PolicyError(
            f"cannot save a policy to {str(path) or repr('')}: give a file name (a folder or device is no file)"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    write_archive(path, "header.json", meta, files, check=_loadable)


def _loadable(tmp: Path) -> None:
    """A policy is written only if ``read_policy`` will read it back: within POLICY_BYTES counted as it counts."""
    from env.safe_zip import ArchiveProblem, unpacked_bytes

    try:
        unpacked_bytes(tmp, max_bytes=POLICY_BYTES, levels=3, max_members=ARCHIVE_MEMBERS)
    except ArchiveProblem as err:
        raise PolicyError(
            f"the policy is too large to be read back ({err}); use a smaller network or state"
        ) from None


def _regular_file(path: Path) -> None:
    """A policy is read from a regular file: a missing one, a folder, a FIFO (which would block) or a device
    (``/dev/zero``, endless) is a ``PolicyError`` before any byte is read."""
    from env.file_checks import not_a_file

    if not path.is_file():
        raise PolicyError(f"policy file {path} {not_a_file(path)}")


def _object(v: Any, name: str) -> dict[str, Any]:
    """A header field that is a JSON object (absent or null: empty)."""
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise TypeError(f"{name} must be a JSON object, got {type(v).__name__}")
    return dict(v)


def read_policy(path: str | Path) -> tuple[Header, dict[str, bytes]]:
    """Read and check an archive: every problem is a ``PolicyError`` naming the file."""
    path = Path(path)
    _regular_file(path)
    meta, files = read_archive(
        path,
        "header.json",
        FORMAT,
        FORMAT_VERSION,
        "draftgym policy file",
        max_bytes=POLICY_BYTES,
        named=True,
    )
    try:
        features = meta.get("features")
        header = Header(
            type=str(meta["type"]),
            kind=str(meta["kind"]),
            arms=_strings(meta["arms"], "arms"),
            obs_size=_count(meta["obs_size"], "obs_size"),
            params=_object(meta.get("params"), "params"),
            features=None if features is None else _strings(features, "features"),
            versions=_object(meta.get("versions"), "versions"),
            created=str(meta.get("created", "")),
            payload=_object(meta.get("payload"), "payload"),
            meta=_object(meta.get("meta"), "meta"),
        )
    except (KeyError, TypeError, ValueError, OverflowError) as err:
        raise PolicyError(f"{path}: header.json lacks or mangles a field ({err})") from err
    if not all(isinstance(d, str) for d in header.payload.values()):
        raise PolicyError(f"{path}: header.json lacks or mangles a field (payload checksums must be strings)")
    for name, digest in header.payload.items():
        if name not in files:
            raise PolicyError(f"{path} is corrupted: member {name} is missing")
        if hashlib.sha256(files[name]).hexdigest() != digest:
            raise PolicyError(f"{path} is corrupted: member {name} does not match its checksum")
    return header, files


def _strings(value: object, name: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"{name} must be a list of strings")
    return tuple(value)


def _count(value: object, name: str, most: int = 1 << 20) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
        raise ValueError(f"{name} must be an integer in [0, {most}], got {str(value)[:40]}")
    return value


def _policy_class(type_name: str) -> type[BasePolicy]:
    target = POLICY_TYPES.get(type_name)
    if target is None:
        raise PolicyError(f"unknown policy type {type_name!r}; known: {', '.join(sorted(POLICY_TYPES))}")
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)


def check_compatible(
    header: Header | BasePolicy,
    *,
    arms: Sequence[str] | None = None,
    obs_size: int | None = None,
    features: Sequence[str] | None = None,
    source: str = "the policy",
) -> None:
    """Refuse a policy built for another arm menu, observation size or feature set."""
    h_arms = header.arms if isinstance(header, Header) else header.arm_names
    if arms is not None and tuple(arms) != tuple(h_arms):
        raise PolicyError(
            f"{source} was trained for arms {list(h_arms)}, but this decoder/env has {list(arms)}"
        )
    uses_obs = header.obs_size > 0
    if uses_obs and obs_size is not None and obs_size != header.obs_size:
        raise PolicyError(
            f"{source} expects observations of size {header.obs_size}, but this decoder/env gives {obs_size}"
        )
    if (
        uses_obs
        and features is not None
        and header.features is not None
        and tuple(features) != header.features
    ):
        diff = sorted(set(header.features) ^ set(features))
        raise PolicyError(f"{source} was trained on other observation features (differ: {diff[:6]})")


def load_policy(
    path: str | Path,
    *,
    arms: Sequence[str] | None = None,
    obs_size: int | None = None,
    features: Sequence[str] | None = None,
) -> BasePolicy:
    """Restore any saved policy, or a plain stable-baselines3 zip; with ``arms``/``obs_size``/``features`` given,
    refuse a mismatched one."""
    _regular_file(Path(path))
    plain_sb3 = is_sb3_zip(path)  # a stable-baselines3 ``model.save`` file, read as data (policies.sb3_files)
    what = "stable-baselines3 model"
    if plain_sb3:  # the members read, and the tensor records inside policy.pth, within a policy's bound
        from env.safe_zip import ArchiveProblem, unpacked_bytes

        try:
            unpacked_bytes(
                path, max_bytes=POLICY_BYTES, levels=2, only=SB3_MEMBERS, max_members=ARCHIVE_MEMBERS
            )
        except ArchiveProblem as err:
            raise PolicyError(f"{path} is not a readable stable-baselines3 zip ({err})") from None
    else:
        header, files = read_policy(path)
        check_compatible(header, arms=arms, obs_size=obs_size, features=features, source=f"policy {path}")
        cls = _policy_class(header.type)
        what = f"{header.type} policy"
    try:
        if plain_sb3:
            from policies.sb3_files import load_sb3_zip

            policy = load_sb3_zip(path, arms=arms, obs_size=obs_size)
        else:
            policy = cls.from_header(header, files)
    except PolicyError as err:  # named by the file it came from
        if str(path) in str(err):
            raise
        raise PolicyError(f"{path}: cannot restore the {what} ({err})") from None
    except Exception as err:  # a payload that cannot be decoded is a corrupted file, reported in one line
        raise PolicyError(f"{path}: cannot restore the {what} ({one_line(err)})") from err
    check_compatible(policy, arms=arms, obs_size=obs_size, features=features, source=f"policy {path}")
    policy.source = str(path)
    return policy
