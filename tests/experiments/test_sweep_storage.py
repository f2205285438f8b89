"""What a sweep folder is tied to: the storage and study its trials came from (a rerun on other storage would mix
two studies in one trials.jsonl), storage that outlives the command (not in-memory SQLite), and a replay cost model
of the trace's model, each refused in one line before the folder is made or written."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest

from experiments.cli import main
from tests.experiments.test_sweep_guards import _one_line_error

CONFIG = """name = "s1"
methods = ["ar", "ngram-d8"]
[sweep]
method = "ngram-d8"
n_trials = 4
backend = "analytic"
objective = "speedup"
pruner = "none"
"""


def _trials(out: Path) -> list[int]:
    return [json.loads(ln)["number"] for ln in (out / "trials.jsonl").read_text().splitlines()]


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "s1.toml"
    path.write_text(CONFIG)
    return path


def test_other_storage_for_a_sweep_folder_is_refused(tmp_path, config, capsys):
    out = tmp_path / "so1"
    assert main(["sweep", str(config), "--out", str(out), "--json"]) == 0
    before = _trials(out)
    (tmp_path / "x").mkdir()
    other = f"sqlite:///{tmp_path / 'x' / 'other.db'}"
    capsys.readouterr()
    rc = main(["sweep", str(config), "--out", str(out), "--storage", other, "--set", "sweep.n_trials=3"])
    _one_line_error(capsys, rc, str(out), "storage", "study.db", "other.db")
    assert _trials(out) == before and optuna.study.get_all_study_names(other) == []  # no trial ran there
    # the folder's own study, named by its path, and the moved folder resume
    mine = f"sqlite:///{out / 'study.db'}"
    assert main(["sweep", str(config), "--out", str(out), "--storage", mine, "--json"]) == 0
    moved = out.rename(tmp_path / "moved")
    assert main(["sweep", str(config), "--out", str(moved), "--set", "sweep.n_trials=5", "--json"]) == 0
    assert sorted(_trials(moved)) == list(range(5))


def test_a_sweep_folder_from_before_the_record_resumes(tmp_path, config, capsys):
    out = tmp_path / "old"
    assert main(["sweep", str(config), "--out", str(out), "--json"]) == 0
    (out / "settings.json").unlink(missing_ok=True)  # as a folder written before the storage was recorded
    assert main(["sweep", str(config), "--out", str(out), "--set", "sweep.n_trials=5", "--json"]) == 0
    assert sorted(_trials(out)) == list(range(5))
    assert json.loads((out / "settings.json").read_text()) == {
        "storage": "study.db",
        "study": "s1",
        "command": "sweep",
    }


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:", "sqlite:///file:m?mode=memory&uri=true"])
def test_in_memory_storage_is_refused_upfront(tmp_path, config, capsys, url):
    out = tmp_path / "mem"
    rc = main(["sweep", str(config), "--out", str(out), "--storage", url])
    _one_line_error(capsys, rc, "in-memory", "sqlite:///path/study.db")
    assert not out.exists()


def test_replay_cost_model_of_another_model_is_refused_before_the_folder(tmp_path, capsys):
    from tests.env.conftest import make_trace

    trace = make_trace().save(tmp_path / "trace.npz")  # recorded for model "toy"
    path = tmp_path / "replay.toml"
    path.write_text(
        'name = "r"\nmethods = ["ar", "ngram-d2"]\n[decode]\nmax_new_tokens = 40\n'
        f'[sweep]\nbackend = "replay"\nn_trials = 2\ntrace = "{trace}"\nmax_topk = 1\n'  # the shipped cost model
    )
    out = tmp_path / "r"
    rc = main(["sweep", str(path), "--out", str(out)])
    _one_line_error(capsys, rc, "calibrated for", "not toy")
    assert not out.exists()


@pytest.mark.parametrize("damage", ["deleted", "emptied"])
def test_a_sweep_folder_whose_study_db_is_gone_is_refused_and_its_results_stay(
    tmp_path, config, capsys, damage
):
    """A new study started in its place: its trials were appended to the old ones' and its best replaced theirs."""
    out = tmp_path / "gone"
    assert main(["sweep", str(config), "--out", str(out), "--json"]) == 0
    kept = {n: (out / n).read_bytes() for n in ("trials.jsonl", "sweep.json", "best.toml")}
    (out / "study.db").unlink() if damage == "deleted" else (out / "study.db").write_bytes(b"")
    capsys.readouterr()
    rc = main(["sweep", str(config), "--out", str(out), "--set", "sweep.n_trials=6", "--json"])
    _one_line_error(capsys, rc, str(out), "no such study", "'s1'")
    assert {n: (out / n).read_bytes() for n in kept} == kept
