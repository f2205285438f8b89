"""What the report's sections say, on cases with a known answer: the side-by-side table takes each run's overall
row (not a category's), a method a run lacks is a row of dashes, an old summary that does not say it is partial is
read as partial when a method is short of prompts, versions that are not known are left out, the machine line names
a GPU only when the run used one, and the files the report may write: an empty ``--out`` or comparison plot, the
default ``report.md`` of several runs, never a result file of a run. From folders written by hand, no model."""

from __future__ import annotations

import json

import pytest

from experiments.cli import main
from experiments.report import _machine_text, side_by_side
from tests.experiments.test_report_inputs import _one_line_error, _run, _tree


def _summary_row(category: str, method: str, tok_s: float, tau: float, vs_ar: float | None) -> dict:
    return {"category": category, "method": method, "prompts": 1, "tokens": 20, "tokens_per_s": tok_s,
            "tau": tau, "speedup_vs_ar": vs_ar, "speedup_vs_hf": None}  # fmt: skip


def test_runs_side_by_side_show_each_runs_overall_row_and_dashes_for_a_method_it_lacks():
    qa_first = [
        _summary_row("qa", "ngram-d8", 99.0, 9.0, 9.9),
        _summary_row("overall", "ngram-d8", 20.0, 2.5, 2.0),
    ]
    a = {
        "name": "a",
        "label": "a",
        "data": {"settings": {"methods": ["ar", "ngram-d8"]}, "summary": qa_first},
    }
    b = {
        "name": "b",
        "label": "b",
        "data": {"settings": {"methods": ["ar"]}, "summary": [_summary_row("overall", "ar", 10.0, 1.0, 1.0)]},
    }
    table = side_by_side([a, b])
    assert table[0] == "| method | a tok/s | a tau | a × AR | a × HF | b tok/s | b tau | b × AR | b × HF |"
    assert table[2:] == [
        "| ar | – | – | – | – | 10.00 | 1.00 | 1.00 | – |",  # a has no overall row of ar
        "| ngram-d8 | 20.00 | 2.50 | 2.00 | – | – | – | – | – |",  # a's overall row, not its qa row
    ]


def test_an_old_summary_without_a_partial_note_is_partial_when_a_method_is_short_of_prompts(tmp_path):
    """A summary from before summaries said they were partial: a method with fewer prompts than the run's, or
    without any row, makes the run partial; one where every method has every prompt does not."""
    run = _run(tmp_path, "old")  # every method: 1 of 1 prompts
    assert main(["report", str(run)]) == 0
    assert "## Run `old`\n" in (run / "report.md").read_text()
    data = json.loads((run / "summary.json").read_text())
    data["summary"] = [r for r in data["summary"] if r["method"] == "ar"]  # ngram-d8 recorded nothing
    (run / "summary.json").write_text(json.dumps(data))
    assert main(["report", str(run)]) == 0
    assert "## Run `old` (partial: some prompts have no record yet)\n" in (run / "report.md").read_text()


def test_versions_not_known_are_left_out_of_the_machine_line(tmp_path):
    run = _run(tmp_path, "v")
    prov = {"command": "draftgym run v.toml", "versions": {"torch": "2.5.1", "transformers": None, "optuna": "",
            "numpy": "2.1"}}  # fmt: skip
    (run / "provenance.jsonl").write_text(json.dumps(prov) + "\n")
    assert main(["report", str(run)]) == 0
    line = next(ln for ln in (run / "report.md").read_text().splitlines() if ln.startswith("- machine:"))
    assert line.endswith("; torch 2.5.1"), line


@pytest.mark.parametrize(
    "device, cuda, text",
    [
        ("cuda:1", True, "Xeon, GPU H100"),
        ("cuda", True, "Xeon, GPU H100"),
        ("cpu", True, "Xeon, GPU not used"),
        ("auto", True, "Xeon, GPU H100 present (the run's device is not recorded)"),
        (None, True, "Xeon, GPU H100 present (the run's device is not recorded)"),
        ("cpu", False, "Xeon, no GPU"),
        ("cuda:0", False, "Xeon, no GPU"),
    ],
)
def test_an_old_summarys_machine_names_a_gpu_only_where_the_run_used_one(device, cuda, text):
    """A summary that does not name its machine: the first start's provenance says which CPU and GPU there were."""
    settings = {} if device is None else {"device": device}
    assert _machine_text(settings, {"cpu_label": "Xeon", "cuda": cuda, "gpu": "H100"}) == text


def test_an_empty_report_file_and_an_empty_comparison_plot_are_written_over(tmp_path):
    a, b = _run(tmp_path, "a"), _run(tmp_path, "b", 30.0)
    out = tmp_path / "r.md"
    out.touch()
    (tmp_path / "r_compare.png").touch()  # e.g. left by a report killed while writing
    assert main(["report", str(a), str(b), "--out", str(out)]) == 0
    assert out.read_text().startswith("# draftgym report\n")
    assert (tmp_path / "r_compare.png").read_bytes().startswith(b"\x89PNG\r\n")


def test_the_report_of_several_runs_goes_to_report_md_in_the_current_folder(tmp_path, monkeypatch):
    a, b = _run(tmp_path, "a"), _run(tmp_path, "b", 30.0)
    monkeypatch.chdir(tmp_path)
    assert main(["report", str(a), str(b)]) == 0
    assert (tmp_path / "report.md").is_file() and (tmp_path / "report_compare.png").is_file()
    assert not (a / "report.md").exists() and not (b / "report.md").exists()


@pytest.mark.parametrize("name", ["sweep.json", "records.jsonl", "provenance.jsonl"])
def test_a_result_file_a_run_does_not_have_yet_is_no_report_file(tmp_path, capsys, name):
    """A sweep.json written into a run's folder would make it a sweep; records.jsonl, its records."""
    run = _run(tmp_path, "r")
    before = _tree(tmp_path)
    rc = main(["report", str(run), "--out", str(run / name)])
    _one_line_error(capsys, rc, str(run / name), "is a result file of the run directory")
    assert _tree(tmp_path) == before
