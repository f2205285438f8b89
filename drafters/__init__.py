"""Drafters propose draft trees; the target verifies them. One drafter per file, all in ``DRAFTERS``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from drafters.base import (
    BatchProposer,
    Carries,
    DraftContext,
    Drafter,
    DrafterError,
    DraftTree,
    Feedback,
    Forkable,
    KVView,
    TargetModel,
    TreeShape,
    check_tree,
    keyword_options,
    tree_problem,
)
from drafters.eagle import Eagle3Drafter, EagleDrafter
from drafters.early_exit import EarlyExitDrafter
from drafters.hybrid import HybridDrafter
from drafters.ngram import NGramDrafter
from drafters.recycling import RecyclingDrafter
from drafters.suffix import SuffixDrafter

DRAFTERS: dict[str, Callable[..., Drafter]] = {
    "eagle": EagleDrafter,
    "eagle3": Eagle3Drafter,
    "early_exit": EarlyExitDrafter,
    "hybrid": HybridDrafter,
    "ngram": NGramDrafter,
    "recycling": RecyclingDrafter,
    "suffix": SuffixDrafter,
}


def make_drafter(name: str, **kwargs: Any) -> Drafter:
    """Build a registered drafter by name; an unknown name lists the known ones, an option it does not take lists
    the ones it does (``DrafterError``, one line)."""
    if not isinstance(name, str) or name not in DRAFTERS:
        why = " (no drafter: the arm that drafts nothing has none to build)" if name in ("none", None) else ""
        raise DrafterError(f"unknown drafter {name!r}{why}; known drafters: {', '.join(sorted(DRAFTERS))}")
    takes = keyword_options(DRAFTERS[name])
    odd = [k for k in kwargs if k not in takes]
    if odd:
        raise DrafterError(f"{name} has no option {odd[0]!r}; its options: {', '.join(takes) or 'none'}")
    return DRAFTERS[name](**kwargs)


__all__ = [
    "BatchProposer",
    "Carries",
    "Forkable",
    "DRAFTERS",
    "check_tree",
    "tree_problem",
    "DraftContext",
    "DraftTree",
    "Drafter",
    "DrafterError",
    "Feedback",
    "KVView",
    "TargetModel",
    "EagleDrafter",
    "Eagle3Drafter",
    "EarlyExitDrafter",
    "HybridDrafter",
    "NGramDrafter",
    "RecyclingDrafter",
    "SuffixDrafter",
    "TreeShape",
    "keyword_options",
    "make_drafter",
]
