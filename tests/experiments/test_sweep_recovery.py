"""What a sweep does after a kill and with several workers, called directly on an SQLite study of the analytic backend
(no model): a trial whose worker is gone (this very process id, a nameless trial older than ``grace_s``, a stale
heartbeat of another machine) is failed and its point retried exactly once; ``--workers N`` gives each worker its own
id (its sampler's seed), and a worker that failed after the others finished the study is a warning, not an error."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from types import SimpleNamespace

import optuna
import pytest

import experiments.sweep as sweep
from experiments.config import load_config
from experiments.sweep import StorageError, open_study, spawn, work
from experiments.sweep_recovery import ORPHANED, fail_orphaned_trials, worker_gone
from experiments.sweep_trial import take_trial
from tests.experiments.test_sweep_bookkeeping import TOML

State = optuna.trial.TrialState

pytestmark = pytest.mark.usefixtures("quiet_optuna")  # (tests/experiments/conftest.py)


def _study(tmp_path, n: int = 1, toml: str = TOML):
    path = tmp_path / "bk.toml"
    path.write_text(toml.format(n=n))
    url = f"sqlite:///{tmp_path / 's.db'}"
    return path, url, open_study(load_config(path), url)


def test_a_trial_named_with_this_process_id_is_a_previous_process_s_and_is_failed(tmp_path):
    """This process runs no trial while it checks: a RUNNING trial naming its id was left by a killed process
    whose id came round again."""
    me = f"{socket.gethostname()}:{os.getpid()}"
    assert worker_gone(me) and not worker_gone(f"elsewhere.invalid:{os.getpid()}")
    _, _, study = _study(tmp_path)
    take_trial(study, me)
    assert fail_orphaned_trials(study, grace_s=3600) == [0]
    assert [t.state.name for t in study.get_trials()] == ["FAIL", "WAITING"]


def test_an_orphaned_trial_is_retried_once_however_often_the_workers_look(tmp_path):
    """Each worker fails and retries orphans before each trial: a retried orphan is not retried again, while one
    whose retry was never enqueued (its worker died in between) is."""
    _, _, study = _study(tmp_path)
    take_trial(study, f"{socket.gethostname()}:{os.getpid()}")
    assert fail_orphaned_trials(study, grace_s=3600) == [0]
    for _ in range(3):
        assert fail_orphaned_trials(study, grace_s=3600) == []
    trials = study.get_trials()
    assert [t.state.name for t in trials] == ["FAIL", "WAITING"]
    assert trials[1].system_attrs["failed_trial"] == 0

    # the retry, failed as orphaned, its own retry not enqueued
    unretried = take_trial(study, "elsewhere.invalid:1")
    study._storage.set_trial_system_attr(unretried._trial_id, ORPHANED, True)
    study._storage.set_trial_state_values(unretried._trial_id, state=State.FAIL)
    assert fail_orphaned_trials(study, grace_s=3600) == [1]
    assert fail_orphaned_trials(study, grace_s=3600) == []
    trials = study.get_trials()
    assert [t.state.name for t in trials] == ["FAIL", "FAIL", "WAITING"]
    assert trials[2].system_attrs["retry_history"] == [0, 1]


@pytest.mark.filterwarnings("ignore:Heartbeat of storage:UserWarning")
def test_a_nameless_running_trial_is_failed_only_once_older_than_grace_s(tmp_path):
    """A trial killed before it named its worker has no heartbeat: its age alone tells it is orphaned."""
    _, _, study = _study(tmp_path)
    study.ask()  # trial 0, RUNNING, no worker named
    assert fail_orphaned_trials(study, grace_s=3600) == []
    assert [t.state.name for t in study.get_trials()] == ["RUNNING"]
    assert fail_orphaned_trials(study, grace_s=0) == [0]
    assert [t.state.name for t in study.get_trials()] == ["FAIL", "WAITING"]


@pytest.mark.timeout(60)
def test_a_worker_retries_the_trial_of_another_machine_once_its_heartbeat_is_stale(tmp_path):
    """Only the heartbeat tells a worker of another machine is dead: the loop waits for it to go stale (grace_s),
    then fails the trial and runs its point again, instead of waiting forever for a running trial."""
    path, url, study = _study(tmp_path, toml=TOML.replace("grace_s = 5", "grace_s = 2"))
    other = take_trial(study, "elsewhere.invalid:1")
    study._storage.record_heartbeat(other._trial_id)  # one beat, then silence
    work(str(path), [], url, tmp_path / "run", progress=False)
    trials = optuna.load_study(study_name="bk", storage=url).get_trials()
    assert [t.state.name for t in trials] == ["FAIL", "COMPLETE"]
    assert trials[1].system_attrs["failed_trial"] == 0
    assert trials[1].user_attrs["default"]  # the config as written


@pytest.fixture
def fake_workers(monkeypatch):
    """``spawn`` starts worker processes that exit at once with the code ``codes[worker id]`` (default 0),
    printing a last line to their log; the commands it gave are recorded."""
    started, codes, real = [], {}, subprocess.Popen

    def popen(cmd, **kwargs):
        if "--worker-id" not in cmd:  # another process this test's code starts (``uname -p``): as it is
            return real(cmd, **kwargs)
        started.append(list(cmd))
        wid = cmd[cmd.index("--worker-id") + 1]
        code = codes.get(wid, 0)
        script = f"print('worker {wid} says boom'); raise SystemExit({code})"
        return real([sys.executable, "-c", script], **kwargs)

    monkeypatch.setattr(sweep.subprocess, "Popen", popen)
    return SimpleNamespace(started=started, codes=codes)


@pytest.mark.timeout(60)
def test_each_spawned_worker_gets_its_own_id_and_the_sets(tmp_path, fake_workers):
    """The worker id seeds the worker's sampler (``(sweep.seed, i)``): workers sharing one would draw one point."""
    path, url, study = _study(tmp_path)
    args = SimpleNamespace(config=str(path), set=["workload.limit=2"])
    spawn(args, url, tmp_path / "run", 3, progress=False)
    ids = [cmd[cmd.index("--worker-id") + 1] for cmd in fake_workers.started]
    assert ids == ["0", "1", "2"]
    assert all(cmd[-2:] == ["--set", "workload.limit=2"] for cmd in fake_workers.started)


@pytest.mark.timeout(60)
def test_a_worker_failing_before_the_study_is_full_is_an_error_naming_its_log(tmp_path, fake_workers):
    path, url, _ = _study(tmp_path)
    fake_workers.codes["1"] = 3
    args = SimpleNamespace(config=str(path), set=[])
    with pytest.raises(
        StorageError, match=r"worker 1 exited with 3: worker 1 says boom \(log: .*worker-1.log\)"
    ):
        spawn(args, url, tmp_path / "run", 2, progress=False)


@pytest.mark.timeout(60)
def test_a_worker_failing_once_the_others_finished_the_study_is_a_warning(tmp_path, fake_workers, capsys):
    path, url, study = _study(tmp_path)
    study.tell(take_trial(study, "other"), 1.0)  # n_trials = 1: the study is full
    fake_workers.codes["1"] = 3
    spawn(SimpleNamespace(config=str(path), set=[]), url, tmp_path / "run", 2, progress=False)
    assert "worker 1 exited with 3; the others finished the study" in capsys.readouterr().err
