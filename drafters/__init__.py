"""Drafters propose draft trees; the target verifies them. One drafter per file, all in ``DRAFTERS``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from drafters.base import DraftContext, Drafter, DrafterError, DraftTree, Feedback, TreeShape
from drafters.ngram import NGramDrafter

DRAFTERS: dict[str, Callable[..., Drafter]] = {
    "ngram": NGramDrafter,
}


def make_drafter(name: str, **kwargs: Any) -> Drafter:
    """Build a registered drafter by name; an unknown name lists the known ones."""
    if name not in DRAFTERS:
        known = ", ".join(sorted([*DRAFTERS, "none"]))
        raise DrafterError(f"unknown drafter {name!r}; known drafters: {known}")
    return DRAFTERS[name](**kwargs)


__all__ = [
    "DRAFTERS",
    "DraftContext",
    "DraftTree",
    "Drafter",
    "DrafterError",
    "Feedback",
    "NGramDrafter",
    "TreeShape",
    "make_drafter",
]
