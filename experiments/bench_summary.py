"""The summary of a ``bench`` or ``run`` folder's records: per category (and overall) and method, tokens/s, tau,
speedups over HF greedy and over our AR loop on the prompts both finished, whether greedy output equals the AR
loop's token for token, and which timing sessions the records come from; the table and the notes printed under it.

Greedy speculative decoding is exact (docs/DESIGN.md, "Verification semantics"): in fp32 every greedy method of
ours must produce the AR loop's tokens. In bf16 a batched verify rounds differently from a single-token step, so a
near-tie can flip (agreement, not identity: ``draftgym agreement`` checks each divergence).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Any

from env.engine import parse_arm, split_weights
from env.metrics import speedup, throughput
from env.workloads import OVERALL
from experiments.config import EXTERNAL_METHODS, device_depth, is_device_method
from experiments.records import Record

BASES = {"hf_greedy": "speedup_vs_hf", "ar": "speedup_vs_ar"}  # the ratio columns' baselines
UNKNOWN_SESSION = "unknown"  # the session of records from before records named theirs: one, unknown
# the fields of a summary row that depend on when the methods were timed (two runs of the same work differ there)
TIMED_FIELDS = (
    "tokens_per_s",
    "speedup_vs_hf",
    "speedup_vs_ar",
    "median_speedup_vs_ar",
    "sessions",
    "cross_session",
)


def summarize(records: list[Record], methods: list[str], *, greedy: bool = True) -> list[dict[str, Any]]:
    """Per category (and overall) and method: tokens/s, tau, speedup over HF greedy and over our AR loop. A
    speedup compares the two methods on the prompts both finished (a method that stopped early, e.g. llama.cpp's
    worker dying, is not compared with a baseline's whole workload). ``sessions``: records per timing session;
    ``cross_session``: per baseline, the compared prompts whose two records were timed in different sessions.
    ``greedy`` (temperature 0): ``identical_to_ar`` of ``compared_to_ar`` prompts both finished have the token ids
    of ``ar_reference`` (``ar_reference_of``; None for it and when there is none, or when sampling)."""
    by: dict[tuple[str, str], list[Record]] = defaultdict(list)
    for r in records:
        if (
            r.category != OVERALL
        ):  # (a workload refuses a category of that name; records written by hand may not)
            by[(r.category, r.method)].append(r)
        by[(OVERALL, r.method)].append(r)
    cats = sorted({c for c, _ in by if c != OVERALL}) + [OVERALL]
    rows = []
    for cat in cats:
        for m in methods:
            rs = by[(cat, m)]
            if not rs:
                continue
            steps = sum(r.steps for r in rs)
            ref = ar_reference_of(m, methods) if greedy else None
            same, compared = _identical(rs, by[(cat, ref)]) if ref else (None, None)
            row = {
                "category": cat,
                "method": m,
                "prompts": len(rs),
                "tokens": sum(r.new_tokens for r in rs),
                "tokens_per_s": throughput([r.new_tokens for r in rs], [r.wall_s for r in rs]),
                "tau": (sum(r.new_tokens for r in rs) / steps) if steps and m != "hf_pld" else None,
                "speedup_vs_hf": _paired(rs, by[(cat, "hf_greedy")]) if "hf_greedy" in methods else None,
                "speedup_vs_ar": _paired(rs, by[(cat, "ar")]) if "ar" in methods else None,
                "median_speedup_vs_ar": _median_paired(rs, by[(cat, "ar")]) if "ar" in methods else None,
                "identical_to_ar": same,
                "compared_to_ar": compared,
                "ar_reference": ref,
                "sessions": dict(sorted(_sessions(rs).items())),
                "cross_session": {
                    b: _cross_session(rs, by[(cat, b)]) for b in BASES if b in methods and b != m
                },
            }
            rows.append(row)
    return rows


def ar_reference_of(method: str, methods: list[str]) -> str | None:
    """What ``method``'s tokens must equal when decoding greedily: the AR loop in the same target variant (``ar``;
    ``ar@int4`` for ``ngram-d8@int4``), else, for a method on the target as loaded, ``hf_greedy``; None for the
    reference itself and when there is none among ``methods`` (a variant without its own AR loop is not compared:
    its weights differ)."""
    variant = None
    if not (method.startswith("policy:") or method in EXTERNAL_METHODS or is_device_method(method)):
        try:
            variant = split_weights(method)[1]
        except ValueError:  # a name of an older version's methods: compared with the loaded target's
            variant = None
    candidates = [f"ar@{variant}", f"none@{variant}"] if variant else ["ar", "none", "hf_greedy"]
    ref = next((c for c in candidates if c in methods), None)
    return None if ref == method else ref


def _identical(rs: list[Record], ref: list[Record]) -> tuple[int, int]:
    """(prompts whose token ids equal ``ref``'s, prompts both have)."""
    theirs = {r.prompt_id: r.token_ids for r in ref}
    both = [r for r in rs if r.prompt_id in theirs]
    return sum(r.token_ids == theirs[r.prompt_id] for r in both), len(both)


def _session(r: Record) -> str:
    return r.session or UNKNOWN_SESSION


def _sessions(rs: list[Record]) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for r in rs:
        out[_session(r)] += 1
    return dict(out)


def _cross_session(rs: list[Record], base: list[Record]) -> int:
    """The prompts both have whose two records were timed in different sessions."""
    theirs = {r.prompt_id: _session(r) for r in base}
    return sum(r.prompt_id in theirs and theirs[r.prompt_id] != _session(r) for r in rs)


def _paired(rs: list[Record], base: list[Record]) -> float | None:
    """tokens/s of ``rs`` over that of ``base``, both on the prompts both have; None when there is no such ratio."""
    both = {r.prompt_id for r in rs} & {r.prompt_id for r in base}
    a = [r for r in rs if r.prompt_id in both]
    b = [r for r in base if r.prompt_id in both]
    x = speedup(throughput([r.new_tokens for r in a], [r.wall_s for r in a]),
                throughput([r.new_tokens for r in b], [r.wall_s for r in b]))  # fmt: skip
    return x if math.isfinite(x) else None  # no prompt in common (or none timed): no ratio, JSON null


def _median_paired(rs: list[Record], base: list[Record]) -> float | None:
    """The median over the prompts both have of ``rs``'s tokens/s over ``base``'s on the same prompt (a long
    prompt weighs as much as a short one; the aggregate ratio, ``_paired``, weighs them by time). A prompt timed
    at 0 s on either side compares nothing and is left out."""
    mine = {r.prompt_id: throughput([r.new_tokens], [r.wall_s]) for r in rs if r.wall_s > 0}
    ratios = [speedup(mine[r.prompt_id], throughput([r.new_tokens], [r.wall_s]))
              for r in base if r.prompt_id in mine and r.wall_s > 0]  # fmt: skip
    ratios = [x for x in ratios if math.isfinite(x)]
    return statistics.median(ratios) if ratios else None


def summary_notes(
    records: list[Record], rows: list[dict[str, Any]], dtype: str, greedy: bool = True
) -> list[str]:
    """The lines printed under a summary table: the sessions its records come from (when more than one) and
    whether greedy output equals the AR loop's (``identity_notes``)."""
    return session_notes(records, rows) + identity_notes(rows, dtype, greedy)


def session_notes(records: list[Record], rows: list[dict[str, Any]]) -> list[str]:
    """None when every record was timed in one session; else the records per session and method, then one line per
    ratio (``~`` in the table) whose two methods were timed in different sessions on some prompt: a method added
    to a folder later, or the prompt a killed run stopped at."""
    sessions = list(dict.fromkeys(_session(r) for r in records))  # in the order they were appended
    if len(sessions) < 2:
        return []
    each = []
    for s in sessions:
        counts = _sessions_by_method(records, s)
        name = "records without a session (older)" if s == UNKNOWN_SESSION else f"session {s}"
        each.append(f"{name}: " + ", ".join(f"{m} {n}" for m, n in counts.items()))
    lines = [
        f"these records come from {len(sessions)} sessions (a resumed or extended run): " + "; ".join(each)
    ]
    have: dict[str, set[str]] = defaultdict(set)
    for r in records:
        have[r.method].add(r.prompt_id)
    for row in rows:
        m = row["method"]
        for base, n in row.get("cross_session", {}).items() if row["category"] == "overall" else ():
            if n:
                lines.append(f"{m} was timed in another session than {base} on {n} of the {len(have[m] & have[base])} "
                             f"prompts both finished: its ratios to {base} (marked ~) compare runs at different "
                             "times")  # fmt: skip
    return lines


def _sessions_by_method(records: list[Record], session: str) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for r in records:
        if _session(r) == session:
            out[r.method] += 1
    return dict(out)


def identity_notes(rows: list[dict[str, Any]], dtype: str, greedy: bool = True) -> list[str]:
    """Greedy speculative methods of ours whose tokens differ from the AR loop's: in fp32 one loud line (greedy
    speculative decoding must be exact there: a differing token is a bug), in bf16 or fp16 a note (a batched verify
    rounds differently from a single-token step). A note too when no method stands as the reference."""
    if not greedy:
        return []
    overall = [r for r in rows if r["category"] == "overall" and drafts(r["method"])]
    if overall and all(r.get("ar_reference") is None for r in overall):
        return [
            "token identity not checked: neither ar nor hf_greedy (in the methods' target variant) was run"
        ]
    differ = [r for r in overall if r.get("compared_to_ar") and r["identical_to_ar"] < r["compared_to_ar"]]
    if not differ:
        return []
    each = ", ".join(f"{r['method']} equals {r['ar_reference']} on {r['identical_to_ar']} of {r['compared_to_ar']}"
                     for r in differ)  # fmt: skip
    name = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(
        dtype, str(dtype).removeprefix("torch.")
    )
    if name == "float32":
        return [f"WARNING: in float32 greedy speculative output must equal AR output token for token, but {each} "
                "prompts: a bug in drafting or verification (the tokens are in records.jsonl)"]  # fmt: skip
    if name in ("bfloat16", "float16"):
        return [f"note: in {name} {each} prompts: a batched verify rounds differently from a single-token step, "
                "so near-ties can flip (agreement, not identity; exact in float32; draftgym agreement explains "
                "each divergence)"]  # fmt: skip
    return [f"note: {each} prompts (dtype {name} not recorded as resolved: greedy speculative output is exact in "
            "float32, agreement only in bf16)"]  # fmt: skip


def ratio_cell(row: dict[str, Any], key: str, base: str, empty: str = "-") -> str:
    """A summary row's ratio ``key`` (to ``base``) as text, ``~`` after it when the two methods' records were timed
    in different sessions on some compared prompt; ``empty`` for none."""
    x = row.get(key)
    if x is None:
        return empty
    return format(x, ".2f") + ("~" if (row.get("cross_session") or {}).get(base) else "")


def format_table(rows: list[dict[str, Any]], failures: dict[str, str] | None = None) -> str:
    """The summary rows as a table; each failed method (``failures``: method -> why) adds one line below. ``= AR``:
    prompts whose tokens equal the AR loop's, of those compared (``= HF`` when hf_greedy is the reference, ``= ref``
    when both are, each row's named below the table); a ratio
    marked ``~`` compares records timed in different sessions (``session_notes``)."""

    def f(x: Any, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    def ratio(r: dict[str, Any], key: str, base: str) -> str:
        return ratio_cell(r, key, base)

    def same(r: dict[str, Any]) -> str:
        n = r.get("compared_to_ar")
        return "-" if not n else f"{r['identical_to_ar']}/{n}"

    refs = {r.get("ar_reference") for r in rows} - {None}
    # the AR loop (in any target variant), HF greedy, or both in one table: then each row's own, said below
    same_head = "= HF" if refs == {"hf_greedy"} else "= ref" if "hf_greedy" in refs else "= AR"
    head = (f"{'category':<15}{'method':<20}{'prompts':>8}{'tokens':>8}{'tok/s':>8}{'tau':>7}{'x HF':>7}{'x AR':>7}"
            f"{'med x AR':>10}{same_head:>8}")  # fmt: skip
    lines = [head, "-" * len(head)]
    last = None
    for r in rows:
        if last is not None and r["category"] != last:
            lines.append("")
        last = r["category"]
        lines.append(
            f"{r['category']:<15}{r['method']:<20}{r['prompts']:>8}{r['tokens']:>8}{r['tokens_per_s']:>8.2f}"
            f"{f(r['tau'], '.2f'):>7}{ratio(r, 'speedup_vs_hf', 'hf_greedy'):>7}{ratio(r, 'speedup_vs_ar', 'ar'):>7}"
            f"{ratio(r, 'median_speedup_vs_ar', 'ar'):>10}{same(r):>8}"
        )
    if same_head == "= ref":
        each = {}
        for r in rows:
            if r.get("ar_reference"):
                each.setdefault(r["ar_reference"], []).append(r["method"])
        lines += ["", "= ref: prompts whose tokens equal " + "; ".join(
            f"{ref}'s for {', '.join(dict.fromkeys(ms))}" for ref, ms in each.items())]  # fmt: skip
    if failures:
        lines += [""] + [f"{m} failed: {why}" for m, why in failures.items()]
    best = best_by_category(rows)
    if best and sum(map(drafts, {r["method"] for r in rows})) > 1:
        overall = best.get("overall", ("-", 0.0))[0]
        lines += ["", "best speculative method per category (x HF greedy; * = not the overall best):"]
        for cat, (m, x) in best.items():
            lines.append(f"  {cat:<15}{m:<22}{x:>6.2f}{'  *' if cat != 'overall' and m != overall else ''}")
    return "\n".join(lines)


def drafts(method: str) -> bool:
    """Whether ``method`` decodes speculatively with drafters of ours: an arm with a drafter (in any target variant:
    ``ngram-d8@int4``), a ``device:lookup-dD`` loop or a policy -- not a baseline (``hf_*``, ``llama_cpp``) nor
    an autoregressive loop (``ar``, ``none``, ``ar@int4``, ``device:none``). A name that is none of these: False."""
    if method in EXTERNAL_METHODS:
        return False
    if method.startswith("policy:"):
        return True
    try:
        if is_device_method(method):
            return device_depth(method) > 0
        return parse_arm(split_weights(method)[0]).drafter is not None
    except ValueError:  # DrafterError, a bad variant: e.g. a table of an older version's methods
        return False


def best_by_category(rows: list[dict[str, Any]]) -> dict[str, tuple[str, float]]:
    """Per category, the speculative method (``drafts``: baselines and autoregressive loops excluded) with the
    highest speedup over HF greedy."""
    best: dict[str, tuple[str, float]] = {}
    for r in rows:
        x = r.get("speedup_vs_hf")
        if not drafts(r["method"]) or x is None or x != x:
            continue
        if r["category"] not in best or x > best[r["category"]][1]:
            best[r["category"]] = (r["method"], float(x))
    return best
