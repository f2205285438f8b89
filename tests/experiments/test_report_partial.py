"""``draftgym report`` on a run that was killed and later resumed: a run some method has not finished is marked
partial and its methods are compared on the prompts every method has finished; a summary older than the records
(a resumed run appended some) is made again. From records alone, no model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments.cli import main
from experiments.config import load_config
from experiments.records import Record
from experiments.runner import partial_note, prepare_run_dir, select_prompts

CONFIG = 'name = "resumed"\nmethods = ["ar", "ngram-d8"]\n[workload]\nlimit = 2\n'


def _record(method: str, prompt: object, wall_s: float) -> Record:
    steps = 20 if method == "ar" else 8
    return Record(
        method, prompt.prompt_id, prompt.category, 40, 20, wall_s, steps, 20 / steps, list(range(20))
    )


def _append(run: Path, *records: Record) -> None:
    with (run / "records.jsonl").open("a") as fh:
        fh.writelines(json.dumps(r.__dict__) + "\n" for r in records)


def _overall(report: str) -> dict[str, int]:
    """method -> prompts of the report's overall rows."""
    rows = [line.split("|")[1:-1] for line in report.splitlines() if line.startswith("| overall |")]
    return {cells[1].strip(): int(cells[2]) for cells in rows}


def _killed_run(tmp_path: Path) -> tuple[Path, object, object]:
    """A run killed with ar's two prompts (the second one slow) recorded and ngram-d8's first only."""
    cfg = load_config(None, text=CONFIG)
    run = tmp_path / "resumed"
    prepare_run_dir(cfg, run)
    p1, p2 = select_prompts(cfg)
    _append(run, _record("ar", p1, 2.0), _record("ngram-d8", p1, 1.0), _record("ar", p2, 8.0))
    return run, p1, p2


def test_report_of_a_killed_then_resumed_run(tmp_path):
    run, p1, p2 = _killed_run(tmp_path)
    assert main(["report", str(run)]) == 0
    text = (run / "report.md").read_text()
    assert "(partial: some prompts have no record yet; 1 of 2 prompts finished by every method)" in text
    assert "records per method: ar 2, ngram-d8 1" in text
    assert _overall(text) == {"ar": 1, "ngram-d8": 1}  # the same prompts for both methods
    summary = json.loads((run / "summary.json").read_text())
    ngram = next(r for r in summary["summary"] if r["category"] == "overall" and r["method"] == "ngram-d8")
    assert ngram["speedup_vs_ar"] == 2.0  # over p1 only: 20 tok/s against ar's 10 (its slow p2 left out)

    _append(run, _record("ngram-d8", p2, 4.0))  # the resumed run finished
    assert main(["report", str(run)]) == 0
    text = (run / "report.md").read_text()
    assert "(partial" not in text and "- partial:" not in text
    assert _overall(text) == {"ar": 2, "ngram-d8": 2}
    assert json.loads((run / "summary.json").read_text())["partial"] is None

    assert main(["report", str(run)]) == 0  # up to date: read as it is
    assert _overall((run / "report.md").read_text()) == {"ar": 2, "ngram-d8": 2}


def test_a_method_without_records_makes_a_run_partial(tmp_path):
    cfg = load_config(None, text=CONFIG)
    p1, p2 = select_prompts(cfg)
    records = [_record("ar", p1, 2.0), _record("ar", p2, 2.0)]
    note = partial_note(records, [p1, p2], ["ar", "ngram-d8"])
    assert (
        note is not None and note["common_prompts"] == [] and note["per_method"] == {"ar": 2, "ngram-d8": 0}
    )
    assert partial_note([*records, _record("ngram-d8", p1, 1.0), _record("ngram-d8", p2, 1.0)], [p1, p2],
                        ["ar", "ngram-d8"]) is None  # fmt: skip


@pytest.mark.parametrize(
    "damage, needle",
    [
        (b"\xff\xfe garbage\n", "line 1 is not a run record"),  # a complete line that is no record
        (b"", "fewer lines than the 3 summary.json was made from"),  # emptied
        (b'{"method": "ar"}\n', "line 1 is not a run record"),  # a record missing its fields
    ],
    ids=["garbage", "emptied", "fields-missing"],
)
def test_damaged_records_leave_the_summary_as_it_is(tmp_path, capsys, damage, needle):
    run, _, _ = _killed_run(tmp_path)
    assert main(["report", str(run)]) == 0
    summary = (run / "summary.json").read_bytes()
    capsys.readouterr()

    (run / "records.jsonl").write_bytes(damage)
    assert main(["report", str(run)]) == 0  # reports what the summary holds, and says why it is not remade
    assert (run / "summary.json").read_bytes() == summary
    text = (run / "report.md").read_text()
    assert "could not be made again" in text and needle in text, text
    assert _overall(text) == {"ar": 1, "ngram-d8": 1}


def test_a_run_writing_the_folder_keeps_its_summary_to_itself(tmp_path):
    """While a run holds its folder (``env.folder_lock``), report shows the summary there and does not write one
    beside the run's own; the stale summary is made again once the run has let go."""
    from tests.env.test_folder_lock import Holder

    run, p1, p2 = _killed_run(tmp_path)
    assert main(["report", str(run)]) == 0
    _append(run, _record("ngram-d8", p2, 4.0))  # the resumed run's next record; its summary still to come
    summary = (run / "summary.json").read_bytes()
    holder = Holder(run)
    try:
        assert main(["report", str(run)]) == 0
        text = (run / "report.md").read_text()
        assert "could not be made again" in text and "is in use by another process" in text, text
        assert (run / "summary.json").read_bytes() == summary
    finally:
        holder.kill()
    assert main(["report", str(run)]) == 0
    assert _overall((run / "report.md").read_text()) == {"ar": 2, "ngram-d8": 2}


def test_a_run_in_its_first_session_is_reported_from_its_records_without_writing(tmp_path):
    """A run writes summary.json when it ends; while its first session holds the folder, report summarizes the
    records so far in memory (the report of other folders beside it is not lost) and writes nothing there."""
    from tests.env.test_folder_lock import Holder

    run, _, _ = _killed_run(tmp_path)
    before = sorted(p.name for p in run.iterdir())
    holder = Holder(run)
    try:
        out = tmp_path / "report.md"
        assert main(["report", str(run), "--out", str(out)]) == 0
        text = out.read_text()
        assert "no summary.json yet" in text and "summarized here, not written" in text, text
        assert _overall(text) == {"ar": 1, "ngram-d8": 1}
        assert sorted(p.name for p in run.iterdir()) == before  # no summary, no plots under the run
    finally:
        holder.kill()


@pytest.mark.parametrize("left", ["trials.jsonl", "study.db", "settings.json"])
def test_an_unfinished_sweep_is_named_as_one(tmp_path, capsys, left):
    """A sweep killed before its sweep.json (written at the end) was reported as "not a run directory"; one still
    running is named as running (a rerun would find its folder held)."""
    from tests.env.test_folder_lock import Holder

    sweep = tmp_path / "sk"
    sweep.mkdir()
    (sweep / "config.toml").write_text(CONFIG)
    (sweep / left).write_text('{"command": "sweep"}' if left == "settings.json" else "")
    assert main(["report", str(sweep), "--out", str(tmp_path / "rep")]) == 2
    err = capsys.readouterr().err
    assert f"{sweep} is a sweep that has not finished (no sweep.json yet" in err and err.count("\n") == 1, err
    assert not (tmp_path / "rep").exists()
    if left == "study.db":
        holder = Holder(sweep)
        try:
            assert main(["report", str(sweep), "--out", str(tmp_path / "rep")]) == 2
        finally:
            holder.kill()
        assert f"{sweep} is a sweep still running" in capsys.readouterr().err


def test_records_one_line_short_of_the_summary_leave_it_as_it_is(tmp_path, capsys):
    run, _, _ = _killed_run(tmp_path)
    assert main(["report", str(run)]) == 0
    summary = (run / "summary.json").read_bytes()
    lines = (run / "records.jsonl").read_bytes().splitlines(keepends=True)
    (run / "records.jsonl").write_bytes(b"".join(lines[:-1]))  # its last record cut: a run never does that
    assert main(["report", str(run)]) == 0
    assert (run / "summary.json").read_bytes() == summary
    assert "fewer lines than the 3 summary.json was made from" in (run / "report.md").read_text()
