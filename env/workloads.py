"""Prompt sets in the Spec-Bench JSONL format: one object per line with ``question_id``, ``category`` and
``turns`` (only the first turn is used). The eight MT-Bench categories are grouped as ``mt_bench``, as the
benchmark does. A small built-in set, written for this project, ships with the package."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

MT_BENCH = frozenset(
    {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
)
BUILTIN = "builtin"


class WorkloadError(ValueError):
    """A workload file that cannot be read; the message is meant for the user."""


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    category: str  # benchmark group: mt_bench, translation, summarization, qa, math_reasoning, rag, ...
    text: str


def builtin_path() -> Path:
    return Path(str(resources.files("env") / "data" / "builtin.jsonl"))


def load_workload(
    path: str | Path | None = None, *, per_category: int | None = None, categories: list[str] | None = None
) -> list[Prompt]:
    """Read a workload (``None`` or ``"builtin"`` for the built-in set). ``per_category`` keeps the first N of each
    group (for mt_bench: spread over its sub-categories, round robin); ``categories`` keeps only those groups."""
    file = builtin_path() if path in (None, BUILTIN) else Path(path)
    if not file.is_file():
        raise WorkloadError(f"workload file {file} does not exist")
    groups: dict[str, list[tuple[str, Prompt]]] = defaultdict(list)
    with file.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                raw_cat = str(row["category"])
                text = row["turns"][0]
                qid = str(row.get("question_id", lineno))
            except (json.JSONDecodeError, KeyError, IndexError, TypeError) as err:
                raise WorkloadError(f"{file}:{lineno}: not a Spec-Bench question line ({err})") from err
            if not isinstance(text, str) or not text.strip():
                raise WorkloadError(f"{file}:{lineno}: the first turn is empty")
            group = "mt_bench" if raw_cat in MT_BENCH else raw_cat
            groups[group].append((raw_cat, Prompt(prompt_id=qid, category=group, text=text)))
    if categories:
        unknown = sorted(set(categories) - set(groups))
        if unknown:
            raise WorkloadError(f"unknown categories {unknown}; this workload has {sorted(groups)}")
        groups = {c: groups[c] for c in categories}
    out: list[Prompt] = []
    for rows in groups.values():
        out.extend(_round_robin(rows)[:per_category] if per_category else [p for _, p in rows])
    if not out:
        raise WorkloadError(f"workload {file} has no prompts")
    return out


def _round_robin(rows: list[tuple[str, Prompt]]) -> list[Prompt]:
    """Interleave sub-categories so that the first N prompts of a group cover its sub-categories evenly."""
    by_sub: dict[str, list[Prompt]] = defaultdict(list)
    for sub, p in rows:
        by_sub[sub].append(p)
    out, i = [], 0
    while len(out) < len(rows):
        for lst in by_sub.values():
            if i < len(lst):
                out.append(lst[i])
        i += 1
    return out
