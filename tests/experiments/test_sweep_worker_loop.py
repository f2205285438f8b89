"""A sweep worker's loop (``experiments.sweep.work``) on a study that other workers share, called directly on the
analytic backend (no model): a trial another worker is still running counts toward ``n_trials``, a trial of a worker
whose process is gone is failed and its point run again, pruned trials count as finished, and a worker started on a
full study takes nothing. A regression here loops forever: each test has a timeout."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from pathlib import Path

import optuna
import pytest

import experiments.sweep as sweep
from experiments.config import load_config
from experiments.sweep import open_study, work
from tests.experiments.test_sweep_bookkeeping import TOML

State = optuna.trial.TrialState

pytestmark = pytest.mark.usefixtures("quiet_optuna")  # (tests/experiments/conftest.py)


@pytest.fixture
def dead_worker():
    """The name (``host:pid``) of a worker of this machine whose process has ended: kept a zombie (not reaped)
    until the test ends, so that no other process can take its id meanwhile."""
    p = subprocess.Popen(["true"])
    stat = Path(f"/proc/{p.pid}/stat")
    while stat.read_text().rpartition(")")[2].split()[0] != "Z":
        time.sleep(0.01)
    yield f"{socket.gethostname()}:{p.pid}"
    p.wait()


def _logged(out) -> list[int]:
    log = out / "trials.jsonl"
    return [json.loads(line)["number"] for line in log.read_text().splitlines()] if log.exists() else []


@pytest.mark.timeout(60)
def test_a_running_trial_of_another_worker_counts_and_is_retried_once_its_worker_is_gone(
    tmp_path, monkeypatch, dead_worker
):
    """Between this worker's count and its take, another worker finished trial 0 and took trial 1 (n_trials = 2):
    the trial this worker took has two trials ahead and fails as surplus; then the other worker turns out to be dead,
    so its trial 1 is failed and its retry is the one this worker runs, leaving exactly two finished trials."""
    path = tmp_path / "bk.toml"
    path.write_text(TOML.format(n=2))
    url, out = f"sqlite:///{tmp_path / 's.db'}", tmp_path / "run"
    real, dead = sweep.take_trial, dead_worker
    raced = []

    def racing_take(study, me):
        if not raced:
            raced.append(True)
            study.tell(real(study, "other"), 1.0)  # trial 0: finished elsewhere
            real(study, dead)  # trial 1: running, until its worker is found gone
        return real(study, me)

    monkeypatch.setattr(sweep, "take_trial", racing_take)
    work(str(path), [], url, out, progress=False)
    trials = optuna.load_study(study_name="bk", storage=url).get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE", "FAIL", "FAIL", "COMPLETE"]
    assert trials[2].user_attrs.get("surplus") is True  # one running trial ahead counted
    assert trials[3].system_attrs.get("failed_trial") == 1  # the dead worker's trial, run again
    assert _logged(out) == [3]


@pytest.mark.timeout(60)
def test_pruned_trials_count_toward_n_trials_and_a_full_study_takes_no_trial(tmp_path):
    path = tmp_path / "bk.toml"
    path.write_text(TOML.format(n=2))
    url, out = f"sqlite:///{tmp_path / 's.db'}", tmp_path / "run"
    study = open_study(load_config(path), url)
    pruned = sweep.take_trial(study, "other")  # the config as written, pruned on another worker
    pruned.report(0.5, 0)
    study.tell(pruned, state=State.PRUNED)

    work(str(path), [], url, out, progress=False)
    states = [t.state.name for t in optuna.load_study(study_name="bk", storage=url).get_trials()]
    assert states == ["PRUNED", "COMPLETE"] and _logged(out) == [1]

    work(str(path), [], url, out, progress=False)  # a worker started on the full study
    assert len(optuna.load_study(study_name="bk", storage=url).get_trials()) == 2 and _logged(out) == [1]


@pytest.mark.timeout(60)
def test_a_trial_another_worker_pruned_meanwhile_counts_and_the_one_taken_after_it_is_surplus(
    tmp_path, monkeypatch
):
    """Between this worker's count and its take, another worker took trial 0 and pruned it (n_trials = 1): the trial
    this worker took has one finished trial ahead, so it fails as surplus and runs nothing."""
    path = tmp_path / "bk.toml"
    path.write_text(TOML.format(n=1))
    url, out = f"sqlite:///{tmp_path / 's.db'}", tmp_path / "run"
    real, raced = sweep.take_trial, []

    def racing_take(study, me):
        if not raced:
            raced.append(True)
            other = real(study, "other")
            other.report(0.5, 0)
            study.tell(other, state=State.PRUNED)
        return real(study, me)

    monkeypatch.setattr(sweep, "take_trial", racing_take)
    work(str(path), [], url, out, progress=False)
    trials = optuna.load_study(study_name="bk", storage=url).get_trials()
    assert [t.state.name for t in trials] == ["PRUNED", "FAIL"] and trials[1].user_attrs.get(
        "surplus"
    ) is True
    assert _logged(out) == []


@pytest.mark.timeout(60)
def test_a_trial_pruned_here_is_logged_with_the_mean_of_the_prompts_it_ran(tmp_path, monkeypatch):
    """The log of trials (``trials.jsonl``) holds the pruned ones too, as the study does."""
    from experiments.objective import EVALUATORS

    path = tmp_path / "bk.toml"
    path.write_text(TOML.format(n=1))
    url, out = f"sqlite:///{tmp_path / 's.db'}", tmp_path / "run"
    analytic = EVALUATORS["analytic"]

    class PrunedAtTheFirstPrompt(analytic):  # the real evaluator; its pruner says stop after the first prompt
        def __call__(self, cfg, params, report):
            def report_then_prune(step, value, n_steps):
                report(step, value, n_steps)
                raise optuna.TrialPruned(f"pruned at prompt {step}")

            return super().__call__(cfg, params, report_then_prune)

    monkeypatch.setitem(EVALUATORS, "analytic", PrunedAtTheFirstPrompt)
    work(str(path), [], url, out, progress=False)
    (trial,) = optuna.load_study(study_name="bk", storage=url).get_trials()
    (line,) = [json.loads(x) for x in (out / "trials.jsonl").read_text().splitlines()]
    assert trial.state == State.PRUNED and len(trial.intermediate_values) == 1
    assert line["state"] == "PRUNED" and line["number"] == 0
    assert line["value"] == pytest.approx(trial.intermediate_values[0]) and line["params"] == trial.params
