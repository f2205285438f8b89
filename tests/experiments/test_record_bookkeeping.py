"""What a run reads back and checks of its records, on cases written by hand: a record must be one the run could
have written, a (method, prompt) recorded twice is refused where it is counted, a saved state's learned prompts
must be the records', a partial run compares the prompts every method finished, and the summary counts the
records file's complete lines."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from env.workloads import Prompt
from experiments.errors import UserError
from experiments.records import Record, check_learned, load_done
from experiments.runner import check_results, partial_note, records_stamp

PROMPTS = [Prompt(f"p{i}", "qa", f"Say thing {i}.") for i in range(3)]


def _rec(method: str, pid: str, **kw) -> Record:
    fields = dict(method=method, prompt_id=pid, category="qa", prompt_tokens=4, new_tokens=3, wall_s=0.1,
                  steps=3, tau=1.0, token_ids=[5, 6, 7])  # fmt: skip
    return Record(**{**fields, **kw})


@pytest.mark.parametrize(
    "field, value",
    [
        ("new_tokens", 2),  # fewer than the ids it lists
        ("new_tokens", 4),  # more than the ids it lists
        ("steps", True),  # a bool is no count
        ("prompt_tokens", -1),
        ("wall_s", float("inf")),
        ("wall_s", float("nan")),
        ("tau", float("inf")),
    ],
)
def test_a_record_the_run_could_not_have_written_is_refused(field, value):
    _rec("ar", "p0")  # the same record with the field as written is one
    with pytest.raises(TypeError, match="not a result record"):
        _rec("ar", "p0", **{field: value})


def _write(path, *rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_strict_reader_refuses_a_second_record_of_a_prompt_and_a_resume_reads_both(tmp_path):
    path = tmp_path / "records.jsonl"
    _write(path, asdict(_rec("ar", "p0")), asdict(_rec("ar", "p1")), asdict(_rec("ar", "p0")))
    with pytest.raises(UserError, match="line 3 records ar on p0 a second time"):
        load_done(path, strict=True)
    assert len(load_done(path, strict=True, unique=False)) == 3
    assert len(load_done(path)) == 3  # a resume counts them (check_results names the duplicate)


def test_a_strict_reader_names_a_line_that_is_no_record_and_a_resume_skips_it(tmp_path):
    path = tmp_path / "records.jsonl"
    _write(path, asdict(_rec("ar", "p0")), {**asdict(_rec("ar", "p1")), "new_tokens": 9})
    assert [r.prompt_id for r in load_done(path)] == ["p0"]  # p1 runs again
    with pytest.raises(UserError, match="line 2 is not a run record"):
        load_done(path, strict=True)


def test_a_state_must_have_learned_from_the_prompts_the_records_hold():
    records = [_rec("policy:ucb", "p0"), _rec("policy:ucb", "p1"), _rec("ar", "p2")]
    check_learned("s.zip", "policy:ucb", ["p0", "p1"], "p1", records)
    check_learned("s.zip", "policy:ucb", ["p0", "p1", "p2"], "p2", records)  # killed before p2's record
    check_learned("s.zip", "policy:ucb", None, None, records)  # a state from before the list was kept
    with pytest.raises(UserError, match="learned from other prompts of policy:ucb"):
        check_learned("s.zip", "policy:ucb", ["p0"], "p0", records)  # p1 was recorded, not learned
    with pytest.raises(UserError, match="learned from other prompts"):
        check_learned("s.zip", "policy:ucb", ["p0", "p1", "p2"], "p1", records)  # learned p2, no record


def test_a_run_is_partial_until_every_method_has_every_prompt():
    full = [_rec(m, p.prompt_id) for m in ("ar", "ngram-d4") for p in PROMPTS]
    assert partial_note(full, PROMPTS, ["ar", "ngram-d4"]) is None
    some = [r for r in full if not (r.method == "ngram-d4" and r.prompt_id == "p1")]
    note = partial_note(some, PROMPTS, ["ar", "ngram-d4"])
    assert note["common_prompts"] == ["p0", "p2"]
    assert (note["prompts"], note["common"], note["per_method"]) == (3, 2, {"ar": 3, "ngram-d4": 2})
    # one method with every prompt and one with none is partial too
    only_ar = [r for r in full if r.method == "ar"]
    assert partial_note(only_ar, PROMPTS, ["ar", "ngram-d4"])["common_prompts"] == []


def test_a_finished_run_names_a_duplicate_and_a_missing_record():
    recs = [_rec("ar", "p0"), _rec("ar", "p0"), _rec("ar", "p1")]
    assert check_results(recs, PROMPTS[:2], ["ar"]) == ["duplicate ('ar', 'p0')"]
    assert check_results(recs[1:], PROMPTS, ["ar"]) == ["missing ('ar', 'p2')"]


def test_the_records_stamp_counts_complete_lines_only(tmp_path):
    path = tmp_path / "records.jsonl"
    assert records_stamp(path) is None
    path.write_text('{"a": 1}\n{"b": 2}\n{"c": 3')  # a torn last line (a kill mid-write) is not counted
    assert records_stamp(path) == 2
