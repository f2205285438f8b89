"""A sweep's bookkeeping on the analytic backend (no model), called directly: which trials count as finished, how a
folder names its storage, the study a config names, samplers that differ per worker, the surplus trial of a race
failed unevaluated and left out of the log, and an export whose best is the highest complete trial."""

from __future__ import annotations

import json

import optuna
import pytest

import experiments.sweep as sweep
from experiments.config import load_config
from experiments.sweep import counts, export, finished, open_study, storage_identity, work

TOML = """name = "bk"
methods = ["ar", "ngram-d8"]
[workload]
limit = 2
[sweep]
method = "ngram-d8"
backend = "analytic"
n_trials = {n}
pruner = "none"
heartbeat_s = 1
grace_s = 5
"""

State = optuna.trial.TrialState

pytestmark = pytest.mark.usefixtures("quiet_optuna")  # (tests/experiments/conftest.py)


def _tell(study: optuna.Study, state: State, value: float | None = None) -> None:
    trial = study.ask()
    if state == State.PRUNED:
        trial.report(1.0, 0)
    study.tell(trial, value if state == State.COMPLETE else None, state=state)


def test_only_complete_and_pruned_trials_are_finished():
    study = optuna.create_study(direction="maximize")
    for state in (State.COMPLETE, State.COMPLETE, State.PRUNED, State.FAIL, State.FAIL, State.FAIL):
        _tell(study, state, 1.0)
    study.ask()  # running
    assert counts(study) == {"COMPLETE": 2, "PRUNED": 1, "FAIL": 3, "RUNNING": 1}
    assert finished(study) == 3


def test_a_folder_names_its_own_study_db_by_name_and_other_storage_by_path(tmp_path):
    out = tmp_path / "run"
    assert storage_identity(f"sqlite:///{out / 'study.db'}", out) == "study.db"
    other = tmp_path / "elsewhere" / "s.db"
    assert storage_identity(f"sqlite:///{other}", out) == str(other.resolve())
    assert storage_identity("postgresql://u:secret@h/db", out) == "postgresql://u:***@h/db"


def test_the_study_is_the_one_the_config_names_and_a_reopen_resumes_it(tmp_path):
    url = f"sqlite:///{tmp_path / 's.db'}"
    cfg = load_config(None, text=TOML.format(n=3) + 'study_name = "named"\n')
    study = open_study(cfg, url)
    assert study.study_name == "named"
    again = open_study(cfg, url, worker=1)
    assert optuna.study.get_all_study_names(storage=url) == ["named"]
    assert len(again.get_trials()) == 1  # the config as written, enqueued once


def test_each_worker_samples_its_own_points_and_repeats_them(tmp_path):
    cfg = load_config(None, text=TOML.format(n=3) + 'sampler = "random"\n')

    def draws(worker: int) -> list[float]:
        study = optuna.create_study(sampler=sweep._sampler(cfg, worker))
        study.optimize(lambda t: t.suggest_float("x", 0.0, 1.0), n_trials=3)
        return [t.params["x"] for t in study.trials]

    assert draws(0) == draws(0) and draws(1) == draws(1)
    assert draws(0) != draws(1)


def test_a_trial_with_n_trials_ahead_of_it_is_failed_as_surplus_and_not_logged(tmp_path, monkeypatch):
    """Another machine's workers finished both trials between this worker's count and its take: the trial it
    takes has ``n_trials`` finished ones ahead and fails itself unevaluated, leaving exactly ``n_trials``."""
    path = tmp_path / "bk.toml"
    path.write_text(TOML.format(n=2))
    url, out = f"sqlite:///{tmp_path / 's.db'}", tmp_path / "run"
    real = sweep.take_trial
    raced = []

    def racing_take(study, me):
        if not raced:  # the race: trials 0 and 1 finish elsewhere first
            raced.append(True)
            for _ in range(2):
                study.tell(real(study, "other"), 1.0)
        return real(study, me)

    monkeypatch.setattr(sweep, "take_trial", racing_take)
    work(str(path), [], url, out, progress=False)
    trials = optuna.load_study(study_name="bk", storage=url).get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE", "FAIL"]
    assert trials[2].user_attrs.get("surplus") is True and "method" not in trials[2].user_attrs
    log = out / "trials.jsonl"
    assert not log.exists() or not log.read_text()  # the log holds what this worker finished: nothing


def test_the_export_picks_the_highest_complete_trial_not_a_pruned_one(tmp_path, capsys):
    path = tmp_path / "bk.toml"
    path.write_text(TOML.format(n=4))
    url, out = f"sqlite:///{tmp_path / 's.db'}", tmp_path / "run"
    work(str(path), [], url, out, progress=False)
    study = optuna.load_study(study_name="bk", storage=url)
    complete = [t for t in study.get_trials() if t.state == State.COMPLETE]
    assert len({t.value for t in complete}) > 1  # a best to choose
    top = max(complete, key=lambda t: t.value)
    # a pruned trial whose prompts' mean beats every complete trial, and a failed one
    pruned = study.ask()
    for k in range(2):
        study._storage.set_trial_param(pruned._trial_id, *_param(top, k))
    pruned.report(top.value + 10.0, 0)
    study.tell(pruned, state=State.PRUNED)
    study.tell(study.ask(), state=State.FAIL)
    result = export(str(path), [], url, out)
    assert result["best"]["number"] == top.number and result["best"]["value"] == top.value
    assert result["states"] == {"COMPLETE": 4, "PRUNED": 1, "FAIL": 1}
    saved = json.loads((out / "sweep.json").read_text())
    assert saved["best"]["number"] == top.number and saved["states"] == result["states"]
    assert load_config(out / "best.toml").methods[-1] == top.user_attrs["method"]


def _param(t: optuna.trial.FrozenTrial, k: int) -> tuple:
    name = sorted(t.params)[k % len(t.params)]
    dist = t.distributions[name]
    return name, dist.to_internal_repr(t.params[name]), dist
