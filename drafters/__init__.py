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
    """Build a registered drafter by name; an unknown name lists the known ones."""
    if name not in DRAFTERS:
        known = ", ".join(sorted([*DRAFTERS, "none"]))
        raise DrafterError(f"unknown drafter {name!r}; known drafters: {known}")
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
    "make_drafter",
]
