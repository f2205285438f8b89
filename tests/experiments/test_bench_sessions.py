"""A bench folder resumed or extended later holds records of several timing sessions: each record names its
session, and a ratio between two methods timed in different sessions is marked in the table, the summary and a
note (a method added later, the prompt a killed run stopped at; older records count as one unknown session).

The model is a stand-in and the generations are stubbed: nothing is decoded."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

import experiments.bench as bench
from env.workloads import Prompt
from experiments.records import Record, load_done
from tests.experiments.test_bench_folder import _loaded

PROMPTS = [Prompt(f"p{i}", "qa", f"Say thing {i}.") for i in range(4)]


class _Killed(Exception):
    pass


def _stub_generation(monkeypatch, kill_after: int | None = None) -> None:
    """Every method generates [5, 6, 7] in 0.1 s; ``kill_after``: the run dies at that timed generation."""
    calls = {"timed": 0}

    def run_method(method, loaded, decoders, prompt_ids, max_new_tokens, **kw):
        if max_new_tokens != 4:  # not the warm-up
            calls["timed"] += 1
            if kill_after is not None and calls["timed"] > kill_after:
                raise _Killed
        return [5, 6, 7], 0.1, 3, 1.0, []

    monkeypatch.setattr(bench, "run_method", run_method)


def _bench(tmp_path, methods):
    return bench.run_bench(_loaded(), PROMPTS, methods, max_new_tokens=3, out_dir=tmp_path, settings={},
                           progress=False, decoders={m: object() for m in methods})  # fmt: skip


def test_a_method_added_to_a_folder_later_is_marked_as_timed_in_another_session(tmp_path, monkeypatch):
    _stub_generation(monkeypatch)
    _bench(tmp_path, ["ar"])
    result = _bench(tmp_path, ["ar", "ngram-d8"])  # the same --out, one method more: only it is timed now
    records = load_done(tmp_path / "records.jsonl")
    first = {r.session for r in records if r.method == "ar"}
    later = {r.session for r in records if r.method == "ngram-d8"}
    assert len(first) == 1 and len(later) == 1 and first != later and None not in first | later
    row = next(r for r in result["summary"] if r["category"] == "overall" and r["method"] == "ngram-d8")
    assert row["cross_session"] == {"ar": 4} and row["sessions"] == {later.pop(): 4}
    assert (
        "ngram-d8 was timed in another session than ar on 4 of the 4 prompts both finished: its ratios to ar "
        "(marked ~) compare runs at different times" in result["notes"]
    )
    assert result["notes"][0].startswith("these records come from 2 sessions (a resumed or extended run): ")
    assert "ar 4" in result["notes"][0] and "ngram-d8 4" in result["notes"][0]
    line = next(
        ln
        for ln in bench.format_table(result["summary"]).splitlines()
        if ln.startswith("overall") and "ngram" in ln
    )
    assert "1.00~" in line


def test_a_killed_and_resumed_run_names_its_sessions_without_alarm(tmp_path, monkeypatch):
    """Methods run prompt by prompt: a kill between two methods of one prompt leaves that prompt's pair in two
    sessions, and only that one is counted."""
    _stub_generation(monkeypatch, kill_after=3)  # p0: ar, ngram; p1: ngram (rotated), then killed before ar
    with pytest.raises(_Killed):
        _bench(tmp_path, ["ar", "ngram-d8"])
    _stub_generation(monkeypatch)
    result = _bench(tmp_path, ["ar", "ngram-d8"])
    records = load_done(tmp_path / "records.jsonl")
    first, second = list(dict.fromkeys(r.session for r in records))
    assert result["notes"][0] == (
        f"these records come from 2 sessions (a resumed or extended run): session {first}: ar 1, ngram-d8 2; "
        f"session {second}: ar 3, ngram-d8 2"
    )
    row = next(r for r in result["summary"] if r["category"] == "overall" and r["method"] == "ngram-d8")
    assert row["cross_session"] == {"ar": 1}
    assert result["notes"][1].startswith(
        "ngram-d8 was timed in another session than ar on 1 of the 4 prompts both finished"
    )


def test_one_session_has_no_note_and_older_records_count_as_one_unknown_session(tmp_path, monkeypatch):
    _stub_generation(monkeypatch)
    assert _bench(tmp_path / "one", ["ar", "ngram-d8"])["notes"] == []
    old = tmp_path / "old"
    old.mkdir()
    with (old / "records.jsonl").open("w") as fh:  # written before records named their session
        for p in PROMPTS:
            row = asdict(Record("ar", p.prompt_id, "qa", 4, 3, 0.1, 3, 1.0, [5, 6, 7]))
            del row["session"]
            fh.write(json.dumps(row) + "\n")
    result = _bench(old, ["ar", "ngram-d8"])
    assert "records without a session (older): ar 4" in result["notes"][0]
    row = next(r for r in result["summary"] if r["category"] == "overall" and r["method"] == "ar")
    assert row["sessions"] == {"unknown": 4}


def test_records_of_two_old_sessions_are_one_unknown_session():
    from experiments.bench_summary import session_notes, summarize

    recs = [
        Record(m, f"p{i}", "qa", 4, 3, 0.1, 3, 1.0, [5, 6, 7]) for m in ("ar", "ngram-d8") for i in range(2)
    ]
    rows = summarize(recs, ["ar", "ngram-d8"])
    assert session_notes(recs, rows) == []
    assert all(r["cross_session"] in ({}, {"ar": 0}) for r in rows)


def test_a_session_that_is_not_a_string_is_not_a_record():
    with pytest.raises(TypeError):
        Record("ar", "p1", "qa", 4, 3, 0.1, 3, 1.0, [5, 6, 7], [], 7)
