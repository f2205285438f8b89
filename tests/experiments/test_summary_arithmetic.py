"""The numbers of a ``bench``/``run`` summary and of a ``serve-bench`` cell, on small cases whose answer is known:
the median and the aggregate speedup over AR, tau, token counts, the best method per category, the identity
notes, the column order of the tables, and what a cell of ``cells.jsonl`` must be."""

from __future__ import annotations

import pytest

from experiments.bench_summary import (
    ar_reference_of,
    best_by_category,
    format_table,
    identity_notes,
    summarize,
)
from experiments.records import Record
from experiments.serve_summary import cell_problem, format_rows, session_notes, summarize_cell


def _rec(
    method: str, pid: str, wall: float, tokens: int = 10, steps: int = 5, cat: str = "qa", ids=None
) -> Record:
    ids = list(range(tokens)) if ids is None else ids
    return Record(method, pid, cat, 4, len(ids), wall, steps, None, ids)


def _row(rows, method, cat="overall"):
    return next(r for r in rows if r["method"] == method and r["category"] == cat)


def test_the_median_speedup_is_the_middle_per_prompt_ratio_and_the_aggregate_weighs_by_time():
    # AR: 10 tokens in 1 s on each prompt; the method is 1x, 2x and 6x as fast: median 2, mean 3
    recs = [_rec("ar", f"p{i}", 1.0) for i in range(3)]
    recs += [_rec("ngram-d4", "p0", 1.0), _rec("ngram-d4", "p1", 0.5), _rec("ngram-d4", "p2", 1 / 6)]
    row = _row(summarize(recs, ["ar", "ngram-d4"]), "ngram-d4")
    assert row["median_speedup_vs_ar"] == pytest.approx(2.0)
    assert row["speedup_vs_ar"] == pytest.approx(30 / (1 + 0.5 + 1 / 6) / 10)  # 1.8: tokens over time
    assert _row(summarize(recs, ["ar", "ngram-d4"]), "ar")["speedup_vs_ar"] == pytest.approx(1.0)


def test_counts_and_tau_of_a_row():
    recs = [_rec("ngram-d4", "p0", 1.0, tokens=6, steps=2), _rec("ngram-d4", "p1", 1.0, tokens=4, steps=3)]
    recs += [_rec("hf_pld", "p0", 1.0, tokens=6, steps=2)]
    rows = summarize(recs, ["ngram-d4", "hf_pld"])
    row = _row(rows, "ngram-d4")
    assert (row["prompts"], row["tokens"], row["tau"]) == (2, 10, 2.0)  # 10 new tokens in 5 steps
    assert _row(rows, "hf_pld")["tau"] is None  # HF's prompt lookup reports no steps of its own


def test_greedy_output_is_compared_with_the_ar_loop_before_hf_greedy():
    assert ar_reference_of("ngram-d4", ["hf_greedy", "ar", "ngram-d4"]) == "ar"
    assert ar_reference_of("ngram-d4", ["hf_greedy", "ngram-d4"]) == "hf_greedy"
    assert ar_reference_of("ar", ["ar", "ngram-d4"]) is None


def test_the_best_method_per_category_has_the_highest_speedup_over_hf():
    recs = [_rec("hf_greedy", f"p{i}", 1.0) for i in range(2)]
    recs += [_rec("ngram-d4", f"p{i}", 0.5) for i in range(2)]
    recs += [_rec("ngram-d8", f"p{i}", 0.25) for i in range(2)]
    rows = summarize(recs, ["hf_greedy", "ngram-d4", "ngram-d8"])
    assert best_by_category(rows) == {"qa": ("ngram-d8", 4.0), "overall": ("ngram-d8", 4.0)}


def _identity_rows(same: int) -> list[dict]:
    recs = [_rec("ar", f"p{i}", 1.0, ids=[1, 2, 3]) for i in range(3)]
    recs += [_rec("ngram-d4", f"p{i}", 1.0, ids=[1, 2, 3] if i < same else [1, 2, 4]) for i in range(3)]
    return summarize(recs, ["ar", "ngram-d4"])


def test_identity_notes_are_loud_in_float32_a_note_in_bf16_and_silent_when_every_prompt_agrees():
    row = _row(_identity_rows(2), "ngram-d4")
    assert (row["identical_to_ar"], row["compared_to_ar"]) == (2, 3)
    [loud] = identity_notes(_identity_rows(2), "fp32")
    assert loud.startswith("WARNING: in float32") and "ngram-d4 equals ar on 2 of 3" in loud
    [note] = identity_notes(_identity_rows(2), "bf16")
    assert note.startswith("note: in bfloat16") and "WARNING" not in note
    assert identity_notes(_identity_rows(3), "fp32") == []


def test_the_table_shows_x_hf_before_x_ar():
    recs = [_rec("hf_greedy", "p0", 1.0), _rec("ar", "p0", 2.0), _rec("ngram-d4", "p0", 0.5)]
    rows = summarize(recs, ["hf_greedy", "ar", "ngram-d4"])
    lines = format_table(rows).splitlines()
    head = lines[0].split()
    assert head.index("HF") < head.index("AR")
    line = next(ln for ln in lines if ln.startswith("overall") and "ngram-d4" in ln)
    # prompts, tokens, tok/s, tau, x HF (2.00), x AR (4.00), median x AR (4.00), = ref
    assert line.split()[2:] == ["1", "10", "20.00", "2.00", "2.00", "4.00", "4.00", "1/1"]


# ------------------------------------------------------------------------------------------------ serve-bench


def _served(arrival: float, first: float, finish: float, n: int) -> dict:
    return {"rid": "r", "token_ids": list(range(n)), "arm": "ngram-d4", "arrival_s": arrival,
            "first_token_s": first, "finish_s": finish, "steps": n}  # fmt: skip


def test_a_cell_summary_of_known_times():
    # tpot: (finish - first) / (tokens - 1) = 0.1 s and 0.3 s; ttft: 0.5 s and 1.5 s
    served = [_served(0.0, 0.5, 1.5, 11), _served(1.0, 2.5, 5.5, 11)]
    s = summarize_cell("ngram-d4", 2, served)
    assert s["goodput_tok_s"] == pytest.approx(22 / 5.5)
    assert s["tpot_ms_mean"] == pytest.approx(200.0)
    assert s["tpot_ms_p50"] == pytest.approx(200.0)
    assert s["tpot_ms_p99"] == pytest.approx(100 + 200 * 0.99)  # linear between 100 and 300 ms
    assert s["ttft_ms_p50"] == pytest.approx(1000.0)
    assert s["tau"] == pytest.approx(1.0)


def _cell(**summary) -> dict:
    s = {"method": "ar", "concurrency": 2, "goodput_tok_s": 1.0, "tpot_ms_p50": None, "tpot_ms_p99": None,
         "ttft_ms_p50": None, "tau": None, **summary}  # fmt: skip
    served = [
        {"rid": 0, "token_ids": [1], "arm": "none", "arrival_s": 0.0, "first_token_s": None, "steps": 1}
    ]
    return {"method": "ar", "concurrency": s["concurrency"], "summary": s, "served": served}


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_cell_with_a_number_that_is_not_finite_is_no_cell(bad):
    assert cell_problem(_cell()) is None
    assert cell_problem(_cell(tau=bad)) == "summary.tau is not a finite number"


def test_a_cell_of_concurrency_zero_is_no_cell():
    assert cell_problem(_cell(concurrency=0)) == "has no method name or no integer concurrency >= 1"


def test_the_serve_table_shows_p50_before_p99_and_ar_cells_are_not_counted_as_compared():
    rows = [
        {"method": "ar", "concurrency": 4, "goodput_tok_s": 10.0, "speedup_vs_ar": 1.0, "tpot_ms_p50": 1.0,
         "tpot_ms_p99": 9.0, "ttft_ms_p50": 3.0, "tau": 1.0, "session": "a", "cross_session": False},
        {"method": "ngram-d4", "concurrency": 4, "goodput_tok_s": 20.0, "speedup_vs_ar": 2.0, "tpot_ms_p50": 2.0,
         "tpot_ms_p99": 8.0, "ttft_ms_p50": 4.0, "tau": 2.5, "session": "b", "cross_session": True},
    ]  # fmt: skip
    head, _, ar, ngram = format_rows(rows).splitlines()
    assert head.replace(" ", "") == "methodconcgoodputxartpotp50tpotp99ttftp50tau"
    assert ngram.split() == ["ngram-d4", "4", "20.0", "2.00~", "2.0", "8.0", "4", "2.50"]
    assert "1 of the 1 cells compared with ar" in session_notes(rows)[0]
