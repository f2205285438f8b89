"""Prompt sets in the Spec-Bench JSONL format: one object per line with ``question_id``, ``category`` and
``turns`` (only the first turn is used). The eight MT-Bench categories are grouped as ``mt_bench``, as the
benchmark does. A small built-in set, written for this project, ships with the package."""

from __future__ import annotations

import ast
import functools
import json
import sysconfig
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from env.file_checks import not_a_file

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


OVERALL = "overall"  # the category of the summary rows over every category (experiments.bench_summary)


def load_workload(
    path: str | Path | None = None, *, per_category: int | None = None, categories: list[str] | None = None
) -> list[Prompt]:
    """Read a workload (``None`` or ``"builtin"`` for the built-in set). ``per_category`` keeps the first N of each
    group (for mt_bench: spread over its sub-categories, round robin); ``categories`` keeps only those groups."""
    if per_category is not None and per_category < 1:
        raise WorkloadError(f"per_category must be >= 1, got {per_category}")
    if isinstance(path, str) and path.startswith(CODE_PREFIX):
        return _code_workload(path[len(CODE_PREFIX) :], per_category, categories)
    file = builtin_path() if path in (None, BUILTIN) else Path(path)
    if file.is_dir():
        raise WorkloadError(f"workload {file} is a directory, not a JSONL file")
    if not file.is_file():
        raise WorkloadError(f"workload file {file} {not_a_file(file)}; {WHERE_TO_GET}")
    groups: dict[str, list[tuple[str, Prompt]]] = defaultdict(list)
    try:
        # lines end at "\n" only (a "\r" before it is JSON whitespace): str.splitlines would also cut at U+2028,
        # U+0085 and others, which JSON allows raw inside a string
        lines = file.read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError as err:
        raise WorkloadError(f"workload {file} is not UTF-8 text (byte {err.start})") from err
    except OSError as err:
        raise WorkloadError(f"cannot read workload {file}: {err.strerror or err}") from err
    seen: dict[str, int] = {}
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise TypeError(f"a JSON {type(row).__name__}, not an object")
            raw_cat, turns, qid = row["category"], row["turns"], row.get("question_id", lineno)
            if not isinstance(raw_cat, str) or not raw_cat.strip():
                raise TypeError("its category is not a name")
            if not isinstance(turns, list) or not turns:
                raise TypeError("its turns are not a list of strings")
            if isinstance(qid, bool) or not isinstance(qid, (int, str)):
                raise TypeError("its question_id is neither a number nor a string")
            text, qid = turns[0], str(qid)
        except (ValueError, RecursionError, KeyError, IndexError, TypeError) as err:  # JSON's are ValueErrors
            from drafters.base import reason

            why = reason(err)
            raise WorkloadError(f"{file}:{lineno}: not a Spec-Bench question line ({why})") from None
        if not isinstance(text, str):
            raise WorkloadError(
                f"{file}:{lineno}: the first turn is not text but a JSON {type(text).__name__}"
            )
        if not text.strip():
            raise WorkloadError(f"{file}:{lineno}: the first turn is empty")
        # the category and id are written with the results, as UTF-8: a lone surrogate would fail the run at its end
        for what, value in (("the first turn", text), ("its category", raw_cat), ("its question_id", qid)):
            if not _encodable(value):
                raise WorkloadError(f"{file}:{lineno}: {what} is not valid Unicode (a lone surrogate escape)")
        if "|" in raw_cat or not raw_cat.isprintable():  # it names a row of the printed and Markdown tables
            raise WorkloadError(
                f"{file}:{lineno}: its category {raw_cat!r} holds a control character or '|' (it names the rows of "
                "the results' tables)"
            )
        if qid in seen:  # results are kept by prompt id: two prompts under one id would lose one on a resume
            raise WorkloadError(f"{file}:{lineno}: question_id {qid} already used on line {seen[qid]}")
        seen[qid] = lineno
        group = "mt_bench" if raw_cat in MT_BENCH else raw_cat
        if (
            group == OVERALL
        ):  # the summaries' row over all categories: a category of that name would count twice
            raise WorkloadError(
                f"{file}:{lineno}: the category {OVERALL!r} is the name of the summaries' total row"
            )
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


def check_prompts(prompts: Sequence[Any], what: str = "workload") -> list[Prompt]:
    """A workload given as a list of ``Prompt`` (the Python API's): not empty, each a ``Prompt`` of text, ids
    unique (a second prompt under one id could never be chosen by it, and results are kept by id)."""
    out = list(prompts)
    if not out:
        raise WorkloadError(f"the {what} has no prompts")
    seen: set[str] = set()
    for i, p in enumerate(out):
        if not isinstance(p, Prompt):
            raise WorkloadError(f"{what} entry {i} is a {type(p).__name__}, not a Prompt")
        if not isinstance(p.text, str) or not isinstance(p.category, str):
            raise WorkloadError(f"{what} entry {i} ({p.prompt_id!r}): its text and category must be strings")
        if str(p.prompt_id) in seen:
            raise WorkloadError(f"{what} entry {i}: prompt_id {p.prompt_id!r} is used twice")
        seen.add(str(p.prompt_id))
    return out


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


CODE_PREFIX = "code:"


def _code_workload(source: str, per_category: int | None, categories: list[str] | None) -> list[Prompt]:
    """``code:PACKAGE``: code instructions from an installed package's docstrings (category ``code``)."""
    if categories and set(categories) != {"code"}:
        raise WorkloadError(
            f"unknown categories {sorted(set(categories) - {'code'})}; this workload has ['code']"
        )
    try:
        found = code_prompts(source, limit=per_category or 200)
    except ValueError as err:
        raise WorkloadError(f"workload code:{source}: {err}") from err
    if not found:
        raise WorkloadError(f"workload code:{source} has no documented public functions")
    return [Prompt(prompt_id=pid, category="code", text=text) for pid, text in found]


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _source_files(root: Path) -> list[Path]:
    """Python files of a source tree in a fixed order, without test suites and vendored third-party trees."""
    skip = {"test", "tests", "site-packages", "dist-packages", "idle_test", "__pycache__", "lib2to3"}
    return sorted(p for p in root.rglob("*.py") if not (set(p.relative_to(root).parts[:-1]) & skip))


def _summary(doc: str) -> str:
    """The first paragraph of a docstring, on one line."""
    para = doc.strip().split("\n\n")[0]
    return " ".join(para.split())


def code_prompts(source: str = "stdlib", limit: int = 600, min_words: int = 6) -> list[tuple[str, str]]:
    """(prompt id, text) code instructions from the public functions with a docstring in a source tree, parsed
    with ``ast`` (nothing is imported or run): ``stdlib`` (training) or an installed package such as ``numpy``
    (held out: another source). Deterministic: files and functions in order, every k-th kept up to ``limit``."""
    found = list(_documented_functions(source, min_words))
    step = max(1, len(found) // max(1, limit))
    return found[::step][:limit]


@functools.lru_cache(maxsize=8)
def _documented_functions(source: str, min_words: int) -> tuple[tuple[str, str], ...]:
    if source == "stdlib":
        root = _stdlib_root()
    else:
        import importlib.util

        # located without importing anything: find_spec of a dotted name would import (run) its parent packages,
        # so only the top-level package is looked up and its subpackages are followed as folders
        parts = source.split(".")
        if not all(p.isidentifier() for p in parts):
            raise ValueError(f"{source!r} is not a package name")
        spec = importlib.util.find_spec(parts[0])
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"package {parts[0]!r} is not installed")
        root = Path(next(iter(spec.submodule_search_locations))).joinpath(*parts[1:])
        if not root.is_dir():
            raise ValueError(f"package {source!r} is not installed")
    found = []
    seen: dict[str, int] = {}
    for path in _source_files(root):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc:
                continue
            summary = _summary(doc)
            if len(summary.split()) < min_words or len(summary) > 400:
                continue
            args = [a.arg for a in node.args.args if a.arg not in ("self", "cls")]
            text = (
                f"Write a Python function `{node.name}({', '.join(args)})` that does the following: {summary}"
                " Explain briefly how it works."
            )
            pid = f"code-{source}-{path.relative_to(root).as_posix()}:{node.name}"
            seen[pid] = n = seen.get(pid, 0) + 1  # a name defined twice in a file: ids stay unique
            found.append((pid if n == 1 else f"{pid}#{n}", text))
    return tuple(found)


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


def prompts_digest(workload: str | None) -> str | None:
    """sha256 of the (id, text) pairs of every prompt of a workload without a file the user names (the built-in set;
    a ``code:`` source: every documented function, whatever a run selects, so that a resume may extend its
    selection): a package upgrade may change their text under the same ids. None for a workload file
    (``experiments.records.workload_digest`` hashes its bytes) and for a ``code:`` package not installed."""
    import hashlib

    if workload and workload != BUILTIN and not workload.startswith(CODE_PREFIX):
        return None
    try:
        prompts = load_workload(None if workload in (None, BUILTIN) else workload, per_category=1 << 30)
    except WorkloadError:  # a label naming no installed package (``record``'s caller passes the prompts)
        return None
    pairs = [[str(p.prompt_id), str(p.text)] for p in prompts]
    return hashlib.sha256(json.dumps(pairs, ensure_ascii=False).encode("utf-8", "surrogatepass")).hexdigest()
