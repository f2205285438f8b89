"""The arm menu: what the policy chooses between each step (DESIGN.md "Arms"). Arm 0 is always "none", one
autoregressive step; the others are a drafter and a tree shape.

A menu comes from config as a list whose entries are arm names (``"ngram-d8"``, ``"ngram-d8-k4-b24"``, ``"none"``),
mappings ``{drafter, depth, topk, budget}`` or ``Arm`` objects.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence
from numbers import Integral
from typing import Any

import numpy as np

from drafters import DRAFTERS, DrafterError, TreeShape
from env.engine import NO_DRAFT, Arm, as_arm, parse_arm

DEFAULT_ARMS = (
    "none",
    "ngram-d2",
    "ngram-d4",
    "ngram-d8",
    "ngram-d16",
    "ngram-d4-k2",
    "ngram-d8-k4-b24",
)


def _arm(entry: Any, known: set[str]) -> Arm:
    if isinstance(entry, Arm):
        return as_arm(entry)
    if isinstance(entry, str):
        return parse_arm(entry.strip())
    if isinstance(entry, Mapping):
        unknown = set(entry) - {"drafter", "depth", "topk", "budget"}
        if unknown:
            raise DrafterError(
                f"arm entry {dict(entry)} has unknown keys {sorted(unknown)}; valid: drafter, depth, topk, budget"
            )
        drafter = entry.get("drafter")
        if drafter is not None and not (isinstance(drafter, str) and drafter.strip()):
            raise DrafterError(
                f"arm entry {dict(entry)}: drafter must be a drafter's name, got {drafter!r:.40}"
            )
        depth, topk, budget = (_int_field(entry, k, d) for k, d in (("depth", 1), ("topk", 1), ("budget", 0)))
        if drafter in (None, "none") or depth == 0:  # (a drafter's depth 0 is no draft: checked as one below)
            if drafter not in (None, "none") and drafter not in known:
                raise DrafterError(
                    f"arm entry {dict(entry)} uses unknown drafter {drafter!r}; "
                    f"known drafters: {', '.join(sorted([*known, 'none']))}"
                )
            return NO_DRAFT
        if "depth" not in entry:
            raise DrafterError(f"arm entry {dict(entry)} has no depth")
        return Arm(drafter, TreeShape(depth, topk, budget).arm_shape())
    raise DrafterError(f"cannot read arm {entry!r}; expected a name like ngram-d8, a mapping or an Arm")


def arm_index(action: Any, names: Sequence[str]) -> int:
    """``action`` as an index into the menu ``names``: an integer (Python or numpy, a one-element integer array),
    not a bool, a float or anything else, within range (a ``ValueError`` naming the problem otherwise)."""
    try:
        if isinstance(action, bool):  # operator.index(True) is 1, but a bool is no arm index
            raise TypeError
        a = operator.index(action)
    except TypeError:
        arr = np.asarray(action)
        if arr.size != 1 or arr.dtype.kind not in "iu":
            raise ValueError(
                f"action {action!r} is not an arm index (an integer in 0..{len(names) - 1})"
            ) from None
        a = int(arr.reshape(()))
    if not 0 <= a < len(names):
        raise ValueError(
            f"action {a} is not a valid arm index; valid: 0..{len(names) - 1} ({', '.join(names)})"
        )
    return a


def _int_field(entry: Mapping, key: str, default: int) -> int:
    v = entry.get(key, default)
    if isinstance(v, bool) or not isinstance(v, Integral):
        raise DrafterError(f"arm entry {dict(entry)}: {key} must be an integer, got {v!r}")
    return int(v)


def make_arms(
    entries: Iterable[Any] | None = None, known_drafters: Iterable[str] | None = None
) -> tuple[Arm, ...]:
    """The menu as a tuple of arms, "none" first (added when absent). Unknown drafters and repeated arms fail."""
    if isinstance(entries, str):  # "none,ngram-d4,ngram-d8"
        entries = [e for e in entries.split(",") if e.strip()]
    if entries is not None and not isinstance(entries, Iterable):
        raise DrafterError(f"an arm menu is a list of arms or a comma list of names, got {entries!r:.60}")
    known = set(DRAFTERS if known_drafters is None else known_drafters)
    arms = [_arm(e, known) for e in (DEFAULT_ARMS if entries is None else entries)]
    if not arms:
        raise DrafterError("the arm menu is empty")
    for a in arms:
        if a.drafter is not None and a.drafter not in known:
            raise DrafterError(
                f"arm {a.name} uses unknown drafter {a.drafter!r}; known drafters: {', '.join(sorted([*known, 'none']))}"
            )
    names = [a.name for a in arms]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        also = " (an entry of depth 0 is the arm none)" if NO_DRAFT.name in dup else ""
        raise DrafterError(f"the arm menu lists {dup} more than once{also}")
    if NO_DRAFT.name in names:
        arms.remove(next(a for a in arms if a.name == NO_DRAFT.name))
    return (NO_DRAFT, *arms)


def arm_depths(arms: Sequence[Arm]) -> list[int]:
    return [0 if a.drafter is None else a.shape.depth for a in arms]


def drafter_names(arms: Sequence[Arm]) -> list[str]:
    return sorted({a.drafter for a in arms if a.drafter is not None})
