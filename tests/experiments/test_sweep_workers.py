"""Workers of one SQLite study take each trial once: a queued trial (trial 0, the config as written, and every retry of
a killed trial) is taken under the workers' lock (``study.ask`` alone reads it WAITING, then writes RUNNING, in two
transactions: three racing workers took one queued trial 13 times in 30); a trial runs under a heartbeat that
keeps it alive past ``grace_s`` and whose silence gets it failed and retried; a trial failed under its worker does
not crash the worker."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import optuna
import pytest

from experiments.config import load_config
from experiments.sweep import open_study
from experiments.sweep_recovery import lock_file, recovery_lock
from experiments.sweep_trial import heartbeat, run_trial, take_trial

TOML = 'name = "race"\nmethods = ["ar", "ngram-d8"]\n[sweep]\nbackend = "analytic"\nheartbeat_s = 1\ngrace_s = 2\n'


def _race(studies: list, lock: Path) -> list[int]:
    """Each study (one worker's connection) takes a trial at the same moment, as ``work`` does; their numbers."""
    start, got = threading.Barrier(len(studies)), [-1] * len(studies)

    def take(i: int) -> None:
        start.wait()
        with recovery_lock(lock):
            got[i] = take_trial(studies[i], f"w{i}").number

    threads = [threading.Thread(target=take, args=(i,)) for i in range(len(studies))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return got


def test_racing_workers_take_the_queued_trial_once(tmp_path):
    cfg = load_config(None, text=TOML)
    n_workers = 3
    for rep in range(12):  # without the lock, about 4 in 10 reps saw the queued trial taken twice
        url = f"sqlite:///{tmp_path / f'race{rep}.db'}"
        open_study(cfg, url)  # the creator: the config as written is queued (WAITING)
        studies = [open_study(cfg, url, worker=i) for i in range(n_workers)]
        got = _race(studies, lock_file(url, tmp_path / "run"))
        assert sorted(got) == list(range(n_workers)), (rep, got)  # each trial taken by one worker
        trials = studies[0].get_trials(deepcopy=False)
        assert [t.state.name for t in trials] == ["RUNNING"] * n_workers
        assert [t.user_attrs["worker"] for t in trials] == [f"w{got.index(k)}" for k in range(n_workers)]


def test_the_lock_of_an_sqlite_study_lies_beside_its_file(tmp_path):
    """Two run folders sharing one SQLite file share its lock; other storage locks in the run folder."""
    url = f"sqlite:///{tmp_path / 'db' / 'shared.db'}"
    assert (
        lock_file(url, tmp_path / "a")
        == lock_file(url, tmp_path / "b")
        == tmp_path / "db" / ".shared.db.lock"
    )
    assert lock_file("postgresql://u@h/db", tmp_path / "a") == tmp_path / "a" / ".recovery.lock"


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
def test_a_trial_lives_while_its_heartbeat_beats_and_is_retried_once_it_stops(tmp_path):
    cfg = load_config(None, text=TOML)
    url = f"sqlite:///{tmp_path / 's.db'}"
    study, other = open_study(cfg, url), open_study(cfg, url, worker=1)

    def slow(trial: optuna.Trial) -> float:  # outlives grace_s (2 s; SQLite's clock counts whole seconds)
        time.sleep(4.2)
        optuna.storages.fail_stale_trials(other)  # another worker looks for dead trials
        return 1.0

    alive = run_trial(study, take_trial(study, "w0"), slow)
    assert alive.state.name == "COMPLETE" and alive.value == 1.0

    dead = take_trial(study, "w0")
    with heartbeat(study._storage, dead._trial_id):
        pass  # one beat, then silence: its worker hangs or is gone
    time.sleep(4.2)
    optuna.storages.fail_stale_trials(other)
    trials = other.get_trials(deepcopy=False)
    assert trials[dead.number].state.name == "FAIL"
    retry = [t for t in trials if t.system_attrs.get("failed_trial") == dead.number]
    assert [t.state.name for t in retry] == ["WAITING"]  # its point runs again


def test_a_trial_failed_under_its_worker_is_left_failed(tmp_path):
    """A worker whose trial was failed meanwhile (its heartbeat went stale under load) records nothing and goes on:
    the tell that used to raise ("Cannot tell a FAIL trial") is skipped."""
    cfg = load_config(None, text=TOML)
    study = open_study(cfg, f"sqlite:///{tmp_path / 's.db'}")
    trial = take_trial(study, "w0")

    def failed_meanwhile(t: optuna.Trial) -> float:
        study._storage.set_trial_state_values(t._trial_id, state=optuna.trial.TrialState.FAIL)
        return 2.0

    assert run_trial(study, trial, failed_meanwhile).state.name == "FAIL"
    trial = take_trial(study, "w0")

    def reports_after_it(t: optuna.Trial) -> float:
        study._storage.set_trial_state_values(t._trial_id, state=optuna.trial.TrialState.FAIL)
        t.report(1.0, 0)  # UpdateFinishedTrialError
        return 2.0

    assert run_trial(study, trial, reports_after_it).state.name == "FAIL"


def test_an_error_fails_the_trial_and_is_raised(tmp_path):
    study = open_study(load_config(None, text=TOML), f"sqlite:///{tmp_path / 's.db'}")

    def broken(t: optuna.Trial) -> float:
        raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        run_trial(study, take_trial(study, "w0"), broken)
    assert run_trial(study, take_trial(study, "w0"), broken, catch=(ZeroDivisionError,)).state.name == "FAIL"
    assert [t.state.name for t in study.get_trials()] == ["FAIL", "FAIL"]


@pytest.mark.slow
def test_three_workers_take_every_trial_once(tmp_path):
    """Three worker processes on one SQLite file: every trial once, the config as written once, no traceback."""
    import json
    import subprocess
    import sys

    path = tmp_path / "c.toml"
    path.write_text(TOML.replace("[sweep]", "[workload]\nlimit = 3\n[sweep]\nn_trials = 6\npruner = \"none\"\n"
                                 "analytic_prompt_s = 0.05\nmax_topk = 2"))  # fmt: skip
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "experiments", "sweep", str(path), "--out", str(out), "--json",
                        "--workers", "3"], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr
    trials = optuna.load_study(study_name="race", storage=f"sqlite:///{out / 'study.db'}").get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE"] * 6
    assert sum(bool(t.user_attrs.get("default")) for t in trials) == 1 and trials[0].user_attrs["default"]
    logged = [json.loads(line)["number"] for line in (out / "trials.jsonl").read_text().splitlines()]
    assert sorted(logged) == list(range(6))
    for log in Path(out / "workers").glob("*.log"):
        assert "Traceback" not in log.read_text()


def test_workers_of_machines_given_adjacent_seeds_draw_different_points():
    """The sampler is seeded with (sweep seed, worker), not their sum: worker 1 of a machine with seed 0 and worker 0
    of one with seed 1 (two machines sharing a study) draw different points; a worker's points repeat exactly."""
    from experiments.sweep_sampler import HistorySeededSampler

    def draws(seed: int, worker: int) -> list[float]:
        sampler = HistorySeededSampler(lambda s: optuna.samplers.RandomSampler(seed=s), seed, worker)
        study = optuna.create_study(sampler=sampler)
        study.optimize(lambda t: t.suggest_float("x", 0.0, 1.0), n_trials=3)
        return [t.params["x"] for t in study.trials]

    assert draws(0, 1) == draws(0, 1)
    assert draws(0, 1) != draws(1, 0)
    assert len({tuple(draws(s, w)) for s in range(3) for w in range(3)}) == 9


def test_sigterm_to_a_sweep_stops_its_workers(tmp_path):
    """SIGTERM (``timeout``, a scheduler) ended the parent on the spot, and its workers ran on without it,
    finishing trials into the study for minutes; it stops them as Ctrl-C does, in one line, exit 143."""
    import json
    import os
    import signal
    import subprocess
    import sys

    (tmp_path / "sw.toml").write_text(TOML + "n_trials = 100000\n")
    out = tmp_path / "run"
    parent = subprocess.Popen([sys.executable, "-m", "experiments", "sweep", str(tmp_path / "sw.toml"), "--out",
                               str(out), "--workers", "2"], stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        for _ in range(600):
            if (out / "workers.json").is_file():
                break
            time.sleep(0.1)
        pids = json.loads((out / "workers.json").read_text())["pids"]
        parent.send_signal(signal.SIGTERM)
        _, err = parent.communicate(timeout=60)
        assert parent.returncode == 143 and err.endswith("draftgym: terminated\n"), (
            parent.returncode,
            err[-300:],
        )
        for _ in range(100):  # terminated by the parent, reaped by it
            alive = [p for p in pids if Path(f"/proc/{p}").exists()]
            if not alive:
                break
            time.sleep(0.1)
        assert not alive, alive
    finally:
        parent.kill()
        for p in (
            json.loads((out / "workers.json").read_text())["pids"] if (out / "workers.json").is_file() else []
        ):
            with contextlib.suppress(
                OSError
            ):  # still this sweep's worker (an ended one's id may be another's now)
                if str(tmp_path).encode() in Path(f"/proc/{p}/cmdline").read_bytes():
                    os.kill(p, signal.SIGKILL)
