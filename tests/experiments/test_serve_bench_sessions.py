"""A serve-bench folder resumed or extended later holds cells of several sessions: each cell names its session, and
a speedup whose cell and ``ar`` cell come from different sessions is marked in serve.json, the table and a note
(as ``bench`` marks its ratios; cells from before cells named theirs are one unknown session). serve.json's
settings and the printed table name the machine, as bench's do."""

from __future__ import annotations

import json
import re

import pytest

from experiments.cli import main
from experiments.records import machine_label
from experiments.serve_summary import format_rows, session_notes, summary_rows


def _cell(method: str, goodput: float, session: str | None) -> dict:
    summary = {"method": method, "concurrency": 8, "goodput_tok_s": goodput, "tpot_ms_p50": None,
               "tpot_ms_p99": None, "ttft_ms_p50": None, "tau": None}  # fmt: skip
    return {"method": method, "concurrency": 8, "served": [], "summary": summary,
            **({} if session is None else {"session": session})}  # fmt: skip


def test_a_speedup_over_an_ar_cell_of_another_session_is_marked():
    cells = {("ar", 8): _cell("ar", 10.0, "old"), ("ngram-d4", 8): _cell("ngram-d4", 25.0, "new")}
    rows = summary_rows(cells, [8], ["ar", "ngram-d4"])
    assert [(r["session"], r["speedup_vs_ar"], r["cross_session"]) for r in rows] == [
        ("old", 1.0, False),
        ("new", 2.5, True),
    ]
    assert session_notes(rows) == [
        "these cells come from 2 sessions (a resumed or extended run): 1 of the 1 cells compared with ar were "
        "timed in another session than their level's ar cell: their speedups over ar (marked ~) compare runs at "
        "different times"
    ]
    table = format_rows(rows).splitlines()
    assert "2.50~" in table[-1] and "~" not in table[-2]


@pytest.mark.parametrize(
    ("sessions", "cross"), [((None, None), False), (("s", "s"), False), ((None, "s"), True)]
)
def test_cells_without_a_session_are_one_unknown_session(sessions, cross):
    ar, ngram = sessions
    cells = {("ar", 8): _cell("ar", 10.0, ar), ("ngram-d4", 8): _cell("ngram-d4", 20.0, ngram)}
    rows = summary_rows(cells, [8], ["ar", "ngram-d4"])
    assert rows[1]["cross_session"] is cross and rows[0]["session"] == (ar or "unknown")
    assert bool(session_notes(rows)) is cross and ("~" in format_rows(rows)) is cross


@pytest.mark.model
def test_a_resumed_serve_bench_marks_its_cross_session_speedups_and_names_the_machine(tmp_path, capsys):
    out = tmp_path / "sb"
    argv = ["serve-bench", "--limit", "2", "--concurrency", "2", "--max-new-tokens", "4", "--dtype", "fp32",
            "--out", str(out)]  # fmt: skip
    # killed after the ar cell: a rerun serves the rest
    assert main([*argv, "--methods", "ar", "--json"]) == 0
    capsys.readouterr()
    assert main([*argv, "--methods", "ar,ngram-d4"]) == 0
    printed = capsys.readouterr().out
    cells = [json.loads(line) for line in (out / "cells.jsonl").read_text().splitlines()]
    assert [c["method"] for c in cells] == ["ar", "ngram-d4"]
    assert all(isinstance(c["session"], str) for c in cells) and cells[0]["session"] != cells[1]["session"]
    data = json.loads((out / "serve.json").read_text())
    assert [r["cross_session"] for r in data["rows"]] == [False, True]
    assert [r["session"] for r in data["rows"]] == [c["session"] for c in cells]
    (note,) = data["notes"]
    assert "1 of the 1 cells compared with ar were timed in another session" in note
    lines = printed.splitlines()
    assert re.search(r"\d\.\d\d~", next(ln for ln in lines if ln.startswith("ngram-d4")))
    assert not re.search(r"~", next(ln for ln in lines if ln.startswith("ar ")))
    assert note in lines
    machine = data["settings"]["machine"]  # as bench.json names it; the label printed with the table
    assert isinstance(machine.get("cpu"), str) and machine_label(data["settings"])
    assert lines[0] == f"{data['settings']['model']} (float32) on {machine_label(data['settings'])}"

    # a folder from before cells named their session, and its settings the machine: it still resumes, nothing
    # is served again, and its cells are one unknown session
    older = [{k: v for k, v in c.items() if k != "session"} for c in cells]
    (out / "cells.jsonl").write_text("".join(json.dumps(c) + "\n" for c in older))
    saved = json.loads((out / "settings.json").read_text())
    saved = {k: v for k, v in saved.items() if k not in ("cpu", "gpu")}
    (out / "settings.json").write_text(json.dumps(saved))
    before = (out / "cells.jsonl").read_text()
    assert main([*argv, "--methods", "ar,ngram-d4", "--json"]) == 0
    assert (out / "cells.jsonl").read_text() == before
    data = json.loads((out / "serve.json").read_text())
    assert {r["session"] for r in data["rows"]} == {"unknown"} and data["notes"] == []
    assert not any(r["cross_session"] for r in data["rows"])
    assert data["settings"]["machine"] == machine
