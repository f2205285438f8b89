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
SPEC_BENCH = "data/spec_bench/question.jsonl"  # in a clone of github.com/hemingkx/Spec-Bench
WHERE_TO_GET = (
    f"Spec-Bench's prompts are {SPEC_BENCH} in a clone of github.com/hemingkx/Spec-Bench "
    "(the default, --workload builtin, ships with draftgym)"
)


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
    if per_category is not None and per_category < 1:
        raise WorkloadError(f"per_category must be >= 1, got {per_category}")
    file = builtin_path() if path in (None, BUILTIN) else Path(path)
    if file.is_dir():
        raise WorkloadError(f"workload {file} is a directory, not a JSONL file")
    if not file.is_file():
        raise WorkloadError(f"workload file {file} does not exist; {WHERE_TO_GET}")
    groups: dict[str, list[tuple[str, Prompt]]] = defaultdict(list)
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise WorkloadError(f"workload {file} is not UTF-8 text (byte {err.start})") from err
    except OSError as err:
        raise WorkloadError(f"cannot read workload {file}: {err.strerror or err}") from err
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise TypeError(f"a JSON {type(row).__name__}, not an object")
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
