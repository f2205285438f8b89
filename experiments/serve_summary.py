"""The summary of a ``serve-bench`` folder's cells (one per method and load level): the rows of ``serve.json`` with
their speedup over ``ar`` at the same load, its ``requests``, the table and the notes printed under it.

Each cell names the session (one ``serve-bench`` call, ``experiments.records.new_session``) that served it: a
folder resumed after a kill, or extended with a method, holds cells of several sessions, and a speedup whose cell
and ``ar`` cell come from different sessions compares runs at different times — marked ``~``, as ``bench`` marks
its ratios (``experiments.bench_summary.session_notes``).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import numpy as np


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize_cell(
    method: str, level: int, served: list[dict[str, Any]], log: dict[str, Any] | None = None
) -> dict[str, Any]:
    from env.metrics import goodput, tau, tpot

    tokens = [len(s["token_ids"]) for s in served]
    tpots = [  # (a request of no first-token time, hf_batch's: none)
        t
        for s in served
        if s.get("first_token_s") is not None
        and (t := tpot(len(s["token_ids"]), s["first_token_s"], s["finish_s"])) is not None
    ]
    ttfts = [s["first_token_s"] - s["arrival_s"] for s in served if s.get("first_token_s") is not None]
    steps = sum(s["steps"] for s in served)
    return {
        "method": method,
        "concurrency": level,
        "requests": len(served),
        "tokens": sum(tokens),
        "goodput_tok_s": goodput(
            tokens, min(s["arrival_s"] for s in served), max(s["finish_s"] for s in served)
        ),
        "tpot_ms_mean": 1e3 * statistics.fmean(tpots) if tpots else None,
        "tpot_ms_p50": None if not tpots else 1e3 * _pct(tpots, 50),
        "tpot_ms_p99": None if not tpots else 1e3 * _pct(tpots, 99),
        "ttft_ms_p50": None if not ttfts else 1e3 * _pct(ttfts, 50),
        "tau": tau(sum(tokens), steps) if steps else None,
        "mean_batch": None if log is None else log["mean_batch"],  # rows per batch step (hf_batch: none)
        "prefill_s": None if log is None else log["prefill_s"],  # time spent prefilling on admission
        # ms per batch step: the step (a policy's observation and act included), and a policy's own part of it
        # and of the bookkeeping after it (observation, act, record, update): what switching costs per step
        "step_ms": None if not log or not log["steps"] else 1e3 * log["step_s"] / log["steps"],
        "policy_ms": None if not log or not log["steps"] else 1e3 * log.get("policy_s", 0.0) / log["steps"],
    }


# what the table, the notes and the plot read of every cell's summary (``summarize_cell`` has written them since the
# first cells; ``mean_batch``, ``prefill_s``, ``step_ms`` and ``policy_ms`` came later and are read with .get)
SUMMARY_READ = ("goodput_tok_s", "tpot_ms_p50", "tpot_ms_p99", "ttft_ms_p50", "tau")
SUMMARY_NUMBERS = ("requests", "tokens", "goodput_tok_s", "tpot_ms_mean", "tpot_ms_p50", "tpot_ms_p99", "ttft_ms_p50",
                   "tau", "mean_batch", "prefill_s", "step_ms", "policy_ms")  # fmt: skip


def cell_problem(c: Any) -> str | None:
    """What makes a line of ``cells.jsonl`` no cell that ``serve-bench`` wrote (None: it is one): the parts the
    summary, the requests and the plot read back -- a method, a concurrency, a summary of finite numbers (or null
    where a cell has none), served requests with their token ids, arm, times and steps."""

    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    def count(x: Any, low: int = 0) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= low

    if not isinstance(c, dict):
        return "is not an object"
    if not isinstance(c.get("method"), str) or not count(c.get("concurrency"), 1):
        return "has no method name or no integer concurrency >= 1"
    s = c.get("summary")
    if not isinstance(s, dict) or not number(s.get("goodput_tok_s")) or s["goodput_tok_s"] < 0:
        return "has no summary with a finite goodput_tok_s >= 0"
    if s.get("method") != c["method"] or s.get("concurrency") != c["concurrency"]:
        return "has a summary of another method or concurrency"
    missing = [
        k for k in SUMMARY_READ if k not in s
    ]  # (null where a cell has none; later keys may be absent)
    if missing:
        return f"has no summary.{missing[0]}"
    bad = [k for k in SUMMARY_NUMBERS if s.get(k) is not None and not number(s[k])]
    if bad:
        return f"summary.{bad[0]} is not a finite number"
    served = c.get("served")
    if not isinstance(served, list) or not served:
        return "has no list of served requests"
    for i, r in enumerate(served):
        ok = (
            isinstance(r, dict)
            and isinstance(r.get("rid"), (str, int))
            and isinstance(r.get("token_ids"), list)
            and all(count(t) for t in r["token_ids"])
            and isinstance(r.get("arm"), str)
            and number(r.get("arrival_s"))
            and (r.get("first_token_s") is None or number(r["first_token_s"]))
            and count(r.get("steps"))
            and (r.get("arm_steps") is None or isinstance(r["arm_steps"], dict))
        )
        if not ok:
            return f"served[{i}] is no served request (rid, token_ids, arm, arrival_s, first_token_s, steps)"
    return None


def cell_session(cell: dict[str, Any]) -> str:
    """The session that served a cell; cells from before cells named theirs are one unknown session."""
    from experiments.bench_summary import UNKNOWN_SESSION

    s = cell.get("session")
    return s if isinstance(s, str) and s else UNKNOWN_SESSION


def summary_rows(
    cells: dict[tuple[str, int], dict[str, Any]], levels: list[int], methods: list[str]
) -> list[dict[str, Any]]:
    """serve.json's ``rows``: each cell's summary with its ``session``, ``speedup_vs_ar`` (goodput over the
    ``ar`` cell's at the same load; None without one) and ``cross_session`` (that ratio compares two sessions)."""
    rows = []
    for c in levels:
        ar = cells.get(("ar", c)) if "ar" in methods else None
        for m in methods:
            cell = cells[(m, c)]
            base = ar["summary"]["goodput_tok_s"] if ar else None
            x = cell["summary"]["goodput_tok_s"] / base if base else None
            cross = x is not None and cell_session(cell) != cell_session(ar)
            rows.append(
                {**cell["summary"], "session": cell_session(cell), "speedup_vs_ar": x, "cross_session": cross}
            )
    return rows


def session_notes(rows: list[dict[str, Any]]) -> list[str]:
    """Empty when every row was served in one session; else one line: the sessions, and how many speedups (``~``
    in the table) divide by an ``ar`` cell of another session (a method added later, the cells a killed run
    left)."""
    sessions = list(dict.fromkeys(r["session"] for r in rows))
    if len(sessions) < 2:
        return []
    compared = [r for r in rows if r["method"] != "ar" and r.get("speedup_vs_ar") is not None]
    n = sum(bool(r.get("cross_session")) for r in compared)
    head = f"these cells come from {len(sessions)} sessions (a resumed or extended run): "
    if not n:
        return [head + "each cell compared with ar was timed in the same session as its level's ar cell"]
    return [head + f"{n} of the {len(compared)} cells compared with ar were timed in another session than their "
            "level's ar cell: their speedups over ar (marked ~) compare runs at different times"]  # fmt: skip


def request_rows(
    cells: dict[tuple[str, int], dict[str, Any]], levels: list[int], methods: list[str]
) -> list[dict[str, Any]]:
    """serve.json's ``requests``: one per request of every (method, load); ``arm``: the request's arm (``policy``
    when a serving policy chose every step's), ``arm_steps``: arm name -> its batch steps with that arm (none for
    ``hf_batch`` and for cells of an older run)."""
    return [{"prompt_id": s["rid"], "method": m, "concurrency": c, "token_ids": s["token_ids"], "arm": s["arm"],
             "ttft_ms": None if s.get("first_token_s") is None else 1e3 * (s["first_token_s"] - s["arrival_s"]),
             "steps": s["steps"], "arm_steps": s.get("arm_steps")}
            for c in levels for m in methods for s in cells[(m, c)]["served"]]  # fmt: skip


def format_rows(rows: list[dict[str, Any]]) -> str:
    """The rows as a table; a speedup marked ``~`` compares cells of two sessions (``session_notes``)."""
    head = f"{'method':<28}{'conc':>5}{'goodput':>9}{'x ar':>7}{'tpot p50':>10}{'tpot p99':>10}{'ttft p50':>10}{'tau':>6}"
    lines = [head, "-" * len(head)]

    def f(x, spec):
        return "-" if x is None else format(x, spec)

    for r in rows:
        x = f(r.get("speedup_vs_ar"), ".2f") + ("~" if r.get("cross_session") else "")
        lines.append(
            f"{r['method']:<28}{r['concurrency']:>5}{f(r['goodput_tok_s'], '.1f'):>9}{x:>7}"
            f"{f(r['tpot_ms_p50'], '.1f'):>10}{f(r['tpot_ms_p99'], '.1f'):>10}{f(r['ttft_ms_p50'], '.0f'):>10}"
            f"{f(r['tau'], '.2f'):>6}"
        )
    return "\n".join(lines)
