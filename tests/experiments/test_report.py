"""``draftgym report``: runs side by side with their tables, plots and provenance, from records alone (no model)."""

from __future__ import annotations

import json
from pathlib import Path

from experiments.cli import main
from experiments.config import load_config
from experiments.records import Record, load_done
from experiments.runner import finish, prepare_run_dir, select_prompts


def _fake_run(root: Path, name: str, speed: float) -> Path:
    """A run directory as ``draftgym run`` leaves it, with made-up timings (ar at 10 tok/s, the arm at ``speed``)."""
    cfg = load_config(None, text=f'name = "{name}"\nmethods = ["ar", "ngram-d8"]\n[workload]\nlimit = 3\n')
    out = root / name
    prepare_run_dir(cfg, out)
    records = []
    for p in select_prompts(cfg):
        records.append(
            Record("ar", p.prompt_id, p.category, 40, 20, 2.0, 20, 1.0, list(range(20)), ["none"] * 19)
        )
        arms = ["ngram-d8"] * 8
        records.append(
            Record("ngram-d8", p.prompt_id, p.category, 40, 20, 20 / speed, 9, 20 / 9, list(range(20)), arms)
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
        and "| ngram-d8 | 12.00 | 2.22 | 1.20 | 25.00 | 2.22 | 2.50 |" in text
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
