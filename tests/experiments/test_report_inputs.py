"""``draftgym report`` on inputs it must refuse in one line (exit code 2) without reading, rewriting or replacing
anything: an --out or comparison plot in the way, one folder named twice, numbers past a float, files that are no
regular file or too large to read; and values from a sweep that cannot start a Markdown heading. From folders
written by hand (and one ``draftgym run`` folder made from records), no model."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from experiments import report, report_inputs
from experiments.cli import main
from tests.experiments.test_report import _fake_run


def _row(method: str, tok_s: float) -> dict:
    return {"category": "overall", "method": method, "prompts": 1, "tokens": 20, "tokens_per_s": tok_s,
            "tau": 2.0, "speedup_vs_ar": tok_s / 10, "speedup_vs_hf": None}  # fmt: skip


def _run(root: Path, name: str, tok_s: float = 20.0) -> Path:
    """A run folder as the report reads it: a summary.json only."""
    out = root / name
    out.mkdir(parents=True)
    summary = {"name": name, "settings": {"methods": ["ar", "ngram-d8"], "prompts": 1},
               "summary": [_row("ar", 10.0), _row("ngram-d8", tok_s)]}  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary))
    return out


def _sweep(root: Path, **change: object) -> Path:
    out = root / "sw"
    out.mkdir(parents=True)
    best = {"number": 1, "state": "COMPLETE", "value": 1.5, "params": {}, "method": "ngram-d8"}
    data = {"study": "s", "storage": "sqlite:///s.db", "objective": "tokens_per_s", "backend": "optuna",
            "states": {"COMPLETE": 2}, "best": best}  # fmt: skip
    for key, value in change.items():
        if key.startswith("best_"):
            best[key.removeprefix("best_")] = value
        else:
            data[key] = value
    (out / "sweep.json").write_text(json.dumps(data))
    return out


def _one_line_error(capsys, rc: int, *needles: str) -> str:
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert all(n in err for n in needles), err
    return err


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------------------ outputs


def test_a_refused_report_leaves_a_stale_summary_as_it_is(tmp_path, capsys):
    """``load_run`` made the stale summary again before --out was found to be the run's records."""
    run = _fake_run(tmp_path, "r", 20.0)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["records_lines"] == 6
    summary["records_lines"] = 5  # made before the last record was appended
    (run / "summary.json").write_text(json.dumps(summary))
    before = _tree(run)
    rc = main(["report", str(run), "--out", str(run / "records.jsonl")])
    _one_line_error(capsys, rc, str(run / "records.jsonl"), "not overwritten")
    assert _tree(run) == before


def test_the_comparison_plot_replaces_no_file_it_did_not_write(tmp_path, capsys):
    a, b = _run(tmp_path / "M", "a"), _run(tmp_path / "M", "b", 30.0)
    (a / "plots").mkdir()
    mine = a / "plots" / "x_compare.png"
    mine.write_bytes(b"\x89PNG a plot of mine")
    before = _tree(tmp_path)
    rc = main(["report", str(a), str(b), "--out", str(a / "plots" / "x.md")])
    _one_line_error(capsys, rc, str(mine), "not overwritten")
    assert _tree(tmp_path) == before
    rc = main(
        ["report", str(a), str(b), "--out", str(b / "plots" / "y.md")]
    )  # one the report would show as b's
    _one_line_error(capsys, rc, str(b / "plots" / "y_compare.png"), "plots folder")
    assert _tree(tmp_path) == before and not (b / "plots").exists()

    theirs = tmp_path / "r_compare.png"  # beside --out, not written by a report
    theirs.write_bytes(b"\x89PNG someone's plot")
    rc = main(["report", str(a), str(b), "--out", str(tmp_path / "r.md")])
    _one_line_error(capsys, rc, str(theirs), "not overwritten")
    assert theirs.read_bytes() == b"\x89PNG someone's plot" and not (tmp_path / "r.md").exists()

    theirs.unlink()  # a report's own plot is written over, as the report is
    for _ in range(2):
        assert main(["report", str(a), str(b), "--out", str(tmp_path / "r.md")]) == 0
    assert (
        theirs.read_bytes().startswith(b"\x89PNG\r\n")
        and "](r_compare.png)" in (tmp_path / "r.md").read_text()
    )


def test_a_comparison_plot_path_that_is_a_folder_is_named(tmp_path, capsys):
    a, b = _run(tmp_path, "a"), _run(tmp_path, "b", 30.0)
    (tmp_path / "r_compare.png").mkdir()
    rc = main(["report", str(a), str(b), "--out", str(tmp_path / "r.md")])
    err = _one_line_error(capsys, rc, f"{tmp_path / 'r_compare.png'} is a directory")
    assert ".tmp" not in err and not (tmp_path / "r.md").exists()


@pytest.mark.parametrize("twin", ["same", "dot", "link"])
def test_one_folder_named_twice_is_refused(tmp_path, capsys, twin):
    a = _run(tmp_path / "M", "a")
    other = {"same": a, "dot": tmp_path / "M" / "." / "a", "link": tmp_path / "link"}[twin]
    if twin == "link":
        other.symlink_to(a)
    rc = main(["report", str(a), str(other), "--out", str(tmp_path / "r.md")])
    _one_line_error(capsys, rc, "the same directory")
    assert not (tmp_path / "r.md").exists() and not (tmp_path / "r_compare.png").exists()


# ------------------------------------------------------------------------------------------------ numbers


@pytest.mark.parametrize("field", ["tokens_per_s", "tau", "speedup_vs_ar"])
def test_a_rate_past_a_float_is_named(tmp_path, capsys, field):
    """``10**400 < inf`` is True: it passed the check and ended in ``OverflowError`` when formatted."""
    run = _run(tmp_path, "big")
    data = json.loads((run / "summary.json").read_text())
    data["summary"][1][field] = 10**400
    (run / "summary.json").write_text(json.dumps(data))
    rc = main(["report", str(run)])
    _one_line_error(capsys, rc, str(run / "summary.json"), f"summary row 1: {field} is not a finite number")
    assert not (run / "report.md").exists()


def test_a_sweep_value_past_a_float_is_named(tmp_path, capsys):
    sweep = _sweep(tmp_path, best_value=10**400)
    rc = main(["report", str(sweep)])
    _one_line_error(capsys, rc, str(sweep / "sweep.json"), "best.value is not a finite number")


# ------------------------------------------------------------------------------------------------ reads


def _main_within(argv: list[str], fifo: Path, seconds: float = 60.0) -> int | None:
    """``main(argv)`` in a thread; None when it is still blocked after ``seconds`` (opening ``fifo`` for writing
    then lets a read of it end)."""
    rc: list[int] = []
    t = threading.Thread(target=lambda: rc.append(main(argv)), daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        t.join(seconds)
        return None
    return rc[0]


def test_a_summary_that_is_a_fifo_is_refused_without_blocking(tmp_path, capsys):
    """With config.toml and records.jsonl there, the summary's records count was read from the FIFO: for ever."""
    run = _fake_run(tmp_path, "r", 20.0)
    (run / "summary.json").unlink()
    os.mkfifo(run / "summary.json")
    rc = _main_within(["report", str(run)], run / "summary.json")
    assert rc is not None, "report blocked on a FIFO"
    _one_line_error(capsys, rc, str(run / "summary.json"), "not a regular file")
    assert not (run / "report.md").exists()


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="no /dev/zero")
def test_a_summary_that_links_to_a_device_is_refused_unread(tmp_path, capsys):
    run = tmp_path / "r"
    run.mkdir()
    (run / "summary.json").symlink_to("/dev/zero")
    _one_line_error(capsys, main(["report", str(run)]), str(run / "summary.json"), "not a regular file")
    with pytest.raises(report.ReportError, match="not a regular file"):  # checked before a byte is read
        report_inputs.read_bytes(run / "summary.json", 1 << 20)


def _sparse(file: Path, size: int) -> None:
    file.unlink(missing_ok=True)
    with file.open("wb") as fh:
        fh.truncate(size)


def test_files_too_large_to_read_are_refused_by_their_size(tmp_path, capsys, monkeypatch):
    run = _run(tmp_path, "huge")
    _sparse(run / "summary.json", (64 << 20) + 1)
    _one_line_error(capsys, main(["report", str(run)]), str(run / "summary.json"), "over 64 MiB")

    run = _fake_run(tmp_path, "r", 20.0)  # records are read whole by the summary's modules: their size first
    monkeypatch.setattr(report_inputs, "MAX_RECORDS_BYTES", 1 << 20)
    _sparse(run / "records.jsonl", 2 << 20)
    before = _tree(run)
    _one_line_error(capsys, main(["report", str(run)]), str(run / "records.jsonl"), "over 1 MiB")
    assert _tree(run) == before


def test_a_provenance_too_large_to_read_is_noted(tmp_path):
    """Provenance is context, not a result: the report is made, and says it was not read."""
    run = _run(tmp_path, "r")
    _sparse(run / "provenance.jsonl", (64 << 20) + 1)
    assert main(["report", str(run)]) == 0
    text = (run / "report.md").read_text()
    assert "- provenance: provenance.jsonl not read: " in text and "over 64 MiB" in text


# ------------------------------------------------------------------------------------------------ markdown


def test_values_from_a_sweep_cannot_start_a_heading(tmp_path):
    sweep = _sweep(tmp_path, storage="sqlite:///a`b\n# storage", best_method="ngram\n## method")
    assert main(["report", str(sweep)]) == 0
    text = (sweep / "report.md").read_text()
    assert "\n# storage" not in text and "\n## method" not in text
    assert "storage `sqlite:///a'b # storage`" in text and "ngram ## method, value 1.5000" in text


def test_a_refused_report_makes_no_output_folder(tmp_path, capsys):
    from experiments.cli import main

    (tmp_path / "empty").mkdir()  # no run or sweep in it: refused once read
    out = tmp_path / "new" / "sub" / "r.md"
    assert main(["report", str(tmp_path / "empty"), "--out", str(out)]) == 2
    capsys.readouterr()
    assert not (tmp_path / "new").exists()
