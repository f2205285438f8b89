"""The arm menu: what the policy chooses between each step (DESIGN.md "Arms"). Arm 0 is always "none", one
autoregressive step; the others are a drafter and a tree shape.

A menu comes from config as a list whose entries are arm names (``"ngram-d8"``, ``"ngram-d8-k4-b24"``, ``"none"``),
mappings ``{drafter, depth, topk, budget}`` or ``Arm`` objects.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from drafters import DRAFTERS, DrafterError, TreeShape
from env.engine import NO_DRAFT, Arm, parse_arm

DEFAULT_ARMS = (
    "none",
    "ngram-d2",
    "ngram-d4",
    "ngram-d8",
    "ngram-d16",
    "ngram-d4-k2",
    "ngram-d8-k4-b24",
)


def _arm(entry: Any) -> Arm:
    if isinstance(entry, Arm):
        return entry
    if isinstance(entry, str):
        return parse_arm(entry.strip())
    if isinstance(entry, Mapping):
        unknown = set(entry) - {"drafter", "depth", "topk", "budget"}
        if unknown:
            raise DrafterError(
                f"arm entry {dict(entry)} has unknown keys {sorted(unknown)}; valid: drafter, depth, topk, budget"
            )
        drafter = entry.get("drafter")
        if drafter in (None, "none") or int(entry.get("depth", 1)) == 0:
            return NO_DRAFT
        if "depth" not in entry:
            raise DrafterError(f"arm entry {dict(entry)} has no depth")
        return Arm(
            str(drafter),
            TreeShape(
                int(entry["depth"]), int(entry.get("topk", 1)), int(entry.get("budget", 0))
            ).arm_shape(),
        )
    raise DrafterError(f"cannot read arm {entry!r}; expected a name like ngram-d8, a mapping or an Arm")


def make_arms(
    entries: Iterable[Any] | None = None, known_drafters: Iterable[str] | None = None
) -> tuple[Arm, ...]:
    """The menu as a tuple of arms, "none" first (added when absent). Unknown drafters and repeated arms fail."""
    if isinstance(entries, str):  # "none,ngram-d4,ngram-d8"
        entries = [e for e in entries.split(",") if e.strip()]
    arms = [_arm(e) for e in (DEFAULT_ARMS if entries is None else entries)]
    known = set(DRAFTERS if known_drafters is None else known_drafters)
    for a in arms:
        if a.drafter is not None and a.drafter not in known:
            raise DrafterError(
                f"arm {a.name} uses unknown drafter {a.drafter!r}; known drafters: {', '.join(sorted([*known, 'none']))}"
            )
    names = [a.name for a in arms]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise DrafterError(f"the arm menu lists {dup} more than once")
    if NO_DRAFT.name in names:
        arms.remove(next(a for a in arms if a.name == NO_DRAFT.name))
    return (NO_DRAFT, *arms)


def arm_depths(arms: Sequence[Arm]) -> list[int]:
    return [0 if a.drafter is None else a.shape.depth for a in arms]


def drafter_names(arms: Sequence[Arm]) -> list[str]:
    return sorted({a.drafter for a in arms if a.drafter is not None})
