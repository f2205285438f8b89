"""``draftgym report``: runs side by side with their tables, plots and provenance, from records alone (no model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments.cli import main
from experiments.config import load_config
from experiments.records import Record, load_done
from experiments.runner import finish, prepare_run_dir, select_prompts


def _fake_run(
    root: Path,
    name: str,
    speed: float,
    folder: str | None = None,
    cpu: str | None = None,
    sessions=(None, None),
) -> Path:
    """A run directory as ``draftgym run`` leaves it, with made-up timings (ar at 10 tok/s, the arm at ``speed``;
    ``cpu``: the machine its settings name; ``sessions``: the two methods' timing sessions)."""
    cfg = load_config(None, text=f'name = "{name}"\nmethods = ["ar", "ngram-d8"]\n[workload]\nlimit = 3\n')
    out = root / (folder or name)
    prepare_run_dir(cfg, out)
    if cpu:
        (out / "settings.json").write_text(json.dumps({"device": "cpu", "cpu": cpu}))
    records = []
    for p in select_prompts(cfg):
        records.append(
            Record(
                "ar",
                p.prompt_id,
                p.category,
                40,
                20,
                2.0,
                20,
                1.0,
                list(range(20)),
                ["none"] * 19,
                session=sessions[0],
            )  # fmt: skip
        )
        arms = ["ngram-d8"] * 8
        records.append(
            Record(
                "ngram-d8",
                p.prompt_id,
                p.category,
                40,
                20,
                20 / speed,
                9,
                20 / 9,
                list(range(20)),
                arms,
                session=sessions[1],
            )  # fmt: skip
        )
    (out / "records.jsonl").write_text("".join(json.dumps(r.__dict__) + "\n" for r in records))
    finish(cfg, out, load_done(out / "records.jsonl"), select_prompts(cfg))
    return out


def test_report_compares_runs_side_by_side(tmp_path):
    a, b = _fake_run(tmp_path, "slow", 12.0), _fake_run(tmp_path, "fast", 25.0)
    out = tmp_path / "reports" / "report.md"
    assert main(["report", str(a), str(b), "--out", str(out)]) == 0
    text = out.read_text()
    assert (
        "## Runs side by side (overall)" in text
        and "| ngram-d8 | 12.00 | 2.22 | 1.20 | – | 25.00 | 2.22 | 2.50 | – |" in text
    )
    assert "## Run `slow`" in text and "## Run `fast`" in text
    images = [line[line.index("](") + 2 : -1] for line in text.splitlines() if line.startswith("![")]
    assert len(images) == 7  # the comparison, then three plots per run
    for rel in images:
        assert (out.parent / rel).is_file(), rel


def test_report_summarizes_a_killed_run_and_refuses_other_paths(tmp_path):
    run = _fake_run(tmp_path, "partial", 20.0)
    (run / "summary.json").unlink()  # killed before the summary was written
    lines = (run / "records.jsonl").read_text().splitlines()
    (run / "records.jsonl").write_text("\n".join(lines[:3]) + "\n")
    assert main(["report", str(run)]) == 0
    assert "partial: some prompts have no record yet" in (run / "report.md").read_text()
    assert main(["report", str(tmp_path / "nothing")]) == 2


def test_plots_handle_runs_without_our_methods(tmp_path):
    from experiments import plots

    rows = [{"category": "overall", "method": "hf_greedy", "tokens_per_s": 10.0, "speedup_vs_hf": 1.0}]
    assert plots.arm_choices([], ["hf_greedy"], tmp_path / "a.png").is_file()
    assert plots.speedup_per_category(rows, ["hf_greedy"], tmp_path / "s.png").is_file()


def test_runs_of_one_name_keep_their_machines_and_columns_apart(tmp_path):
    """Two runs of one config on two machines: each its own label (name and folder), machine and columns; the
    Markdown names both machines, not only the plot's footer."""
    a = _fake_run(tmp_path, "bench", 12.0, folder="intel", cpu="Intel Xeon X (avx512_bf16)")
    b = _fake_run(tmp_path, "bench", 25.0, folder="amd", cpu="AMD EPYC Y")
    out = tmp_path / "r.md"
    assert main(["report", str(a), str(b), "--out", str(out)]) == 0
    text = out.read_text()
    assert "- bench (intel): CPU Intel Xeon X (avx512_bf16); bench (amd): CPU AMD EPYC Y" in text
    assert "| method | bench (intel) tok/s |" in text and "| bench (amd) tok/s |" in text
    assert "## Run `bench (intel)`" in text and "## Run `bench (amd)`" in text


def test_ratios_across_timing_sessions_keep_their_mark(tmp_path):
    run = _fake_run(tmp_path, "two", 20.0, sessions=("s1", "s2"))
    assert main(["report", str(run)]) == 0
    text = (run / "report.md").read_text()
    assert "(marked ~)" in text and "| overall | ngram-d8 | 3 | 60 | 20.00 | 2.22 | 2.00~ | – |" in text


def test_the_comparison_plot_uses_a_baseline_every_run_has(tmp_path, monkeypatch):
    from experiments import plots

    bars = {}

    def spy(fig, path, note=""):
        ax = fig.axes[0]
        bars[path.name] = (
            ax.get_ylabel(),
            {c.get_label(): [p.get_height() for p in c.patches] for c in ax.containers},
        )
        return path

    monkeypatch.setattr(plots, "_save", spy)
    over = {"category": "overall", "speedup_vs_hf": None}
    a = [{**over, "method": "ngram-d8", "speedup_vs_ar": 1.2, "speedup_vs_hf": 2.0}]
    b = [{**over, "method": "ngram-d8", "speedup_vs_ar": 1.5, "speedup_vs_hf": 4.0}]
    plots.compare_runs([("A", a, ["hf_greedy", "ar", "ngram-d8"]), ("B", b, ["hf_greedy", "ngram-d8"])],
                       tmp_path / "c.png")  # fmt: skip
    ylabel, series = bars["c.png"]
    assert ylabel == "overall speedup over hf_greedy" and series == {"ar": [], "ngram-d8": [2.0, 4.0]}
    rows = [{"category": "x", "method": "ngram-d8", "speedup_vs_ar": None}, {"category": "y", "method": "ngram-d8",
            "speedup_vs_ar": 2.0}]  # fmt: skip
    plots.speedup_per_category(rows, ["ar", "ngram-d8"], tmp_path / "p.png")
    assert bars["p.png"][1] == {"ngram-d8": [2.0]}  # no 0x bar for the undefined ratio


def test_summaries_count_a_category_once_and_name_each_rows_reference(tmp_path):
    from env.workloads import WorkloadError, load_workload
    from experiments.bench_summary import format_table, summarize

    recs = [Record(m, p, c, 4, 4, 1.0, 2, 2.0, [1, 2, 3, 4], session="s") for p, c in (("1", "overall"), ("2", "qa"))
            for m in ("hf_greedy", "ngram-d8", "ar@int4", "ngram-d8@int4")]  # fmt: skip
    rows = summarize(recs, ["hf_greedy", "ngram-d8", "ar@int4", "ngram-d8@int4"])
    overall = next(r for r in rows if r["category"] == "overall" and r["method"] == "ngram-d8")
    assert overall["prompts"] == 2 and overall["tokens"] == 8
    table = format_table(rows)
    assert "= ref" in table and "hf_greedy's for ngram-d8; ar@int4's for ngram-d8@int4" in table
    bad = tmp_path / "w.jsonl"
    bad.write_text(json.dumps({"question_id": 1, "category": "overall", "turns": ["hi"]}) + "\n")
    with pytest.raises(WorkloadError, match="the category 'overall' is the name of the summaries' total row"):
        load_workload(bad)


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("tau", float("nan"), "tau is not a finite number >= 0 (nan)"),
        ("tokens_per_s", float("inf"), "tokens_per_s is not a finite number >= 0 (inf)"),
        ("tokens", -5, "tokens is not a count (-5)"),
        ("method", 3, "method is not text"),
        ("speedup_vs_ar", -1.5, "speedup_vs_ar is not a finite number >= 0 (-1.5)"),
        ("prompts", True, "prompts is not a count (True)"),
    ],
)
def test_a_summary_row_it_cannot_show_as_measured_is_named(tmp_path, capsys, field, value, needle):
    run = _fake_run(tmp_path, "edited", 20.0)
    data = json.loads((run / "summary.json").read_text())
    data["summary"][1][field] = value
    (run / "summary.json").write_text(json.dumps(data))
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "summary row 1: " + needle in err, err


def test_names_from_a_file_cannot_split_the_tables(tmp_path):
    run = _fake_run(tmp_path, "named", 20.0)
    data = json.loads((run / "summary.json").read_text())
    data["summary"][0]["method"] = "x|y\n## injected"
    data["name"] = "a`b\n# title"
    (run / "summary.json").write_text(json.dumps(data))
    assert main(["report", str(run)]) == 0
    text = (run / "report.md").read_text()
    assert "x\\|y ## injected" in text and "\n## injected" not in text
    assert "## Run `a'b # title`" in text and "\n# title" not in text


def test_runs_of_one_name_in_folders_of_one_name_are_numbered_from_one():
    from experiments.report import label_items

    items = [
        {"name": "a", "path": Path("x/run")},
        {"name": "a", "path": Path("y/run")},
        {"name": "b", "path": Path("z/run")},
    ]
    label_items(items)
    assert [r["label"] for r in items] == ["a #1", "a #2", "b"]


def test_runs_whose_machines_are_not_recorded_are_not_said_to_share_one(tmp_path):
    a, b = _fake_run(tmp_path, "slow", 12.0), _fake_run(tmp_path, "fast", 25.0)
    out = tmp_path / "r.md"
    assert main(["report", str(a), str(b), "--out", str(out)]) == 0
    text = out.read_text()
    assert "- slow: machine not recorded; fast: machine not recorded" in text and "measured on" not in text
