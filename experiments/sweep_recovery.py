"""A sweep after a kill: what tells a dead worker's trial, and how its point runs again.

Optuna fails a trial whose heartbeat went stale and retries it (``retry_callback``, at most 3 times). On one machine
a rerun need not wait for that: a worker whose process is gone (``worker_gone``) left a trial that
``fail_orphaned_trials`` fails at once and retries first, so a killed and resumed local sweep runs the points an
uninterrupted one would have, in the same order.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def retry_callback() -> Any:
    """Optuna's retry of a stale trial (at most 3 times), whose retry does not inherit the dead trial's
    ``worker``: a retry names its worker once one runs it (``fail_orphaned_trials`` reads that name)."""
    import optuna

    retry = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None)  # optuna >= 4.9
    retry = (retry or optuna.storages.RetryFailedTrialCallback)(max_retry=3)

    def callback(study: Any, trial: Any) -> None:
        trial.user_attrs = {k: v for k, v in trial.user_attrs.items() if k != "worker"}
        trial.system_attrs = {
            k: v for k, v in trial.system_attrs.items() if k != ORPHANED
        }  # the retry is not
        retry(study, trial)

    return callback


def lock_file(url: str, run_dir: Path) -> Path:
    """The file the workers of one storage lock: beside an SQLite file (every run folder that shares it takes
    turns), else in the run folder."""
    path = sqlite_file(url)
    return run_dir / ".recovery.lock" if path is None else path.with_name(f".{path.name}.lock")


def sqlite_file(url: str) -> Path | None:
    """The file (resolved) of an SQLite URL; None for another backend, an in-memory database, a ``file:`` URI
    or a string that is no URL."""
    u = _sqlite_url(url)
    db = (u.database or "") if u is not None else ""
    if db in ("", ":memory:") or db.startswith("file:"):
        return None
    return Path(db).resolve()


def in_memory(url: str) -> bool:
    """Whether ``url`` is an in-memory SQLite database (``sqlite://``, ``:memory:``, a ``mode=memory`` URI)."""
    u = _sqlite_url(url)
    if u is None:
        return False
    db = u.database or ""
    return db in ("", ":memory:") or db.startswith("file::memory:") or u.query.get("mode") == "memory"


def _sqlite_url(url: str) -> Any:
    """The parsed URL when it names SQLite, else None."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        u = make_url(url)
    except (ArgumentError, ValueError):
        return None
    return u if u.get_backend_name() == "sqlite" else None


@contextlib.contextmanager
def recovery_lock(path: Path) -> Iterator[None]:
    """Held (an exclusive ``flock`` on ``path``, from ``lock_file``) while a worker fails and retries dead trials
    and takes its next trial: the workers of one SQLite file take turns. Without it two workers could both fail the
    same dead trial, or both take the same queued one (trial 0, a retry) — SQLite reads a trial in both before
    either writes — so one point would run twice and the later ``tell`` fail. (PostgreSQL locks the row.)"""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def worker_gone(worker: str) -> bool:
    """Whether the worker ``host:pid`` is known to be dead: a process of this machine that no longer runs (or
    is a zombie), or this very process id (which runs no trial while it checks: a previous process's id)."""
    host, _, pid = worker.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False  # another machine: only its heartbeat tells
    if int(pid) == os.getpid():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except (OSError, IndexError):
        return False


ORPHANED = "draftgym_orphaned"  # system attr of a trial failed because its worker died (it must be retried)


def fail_orphaned_trials(study: Any, grace_s: float) -> list[int]:
    """Fail the RUNNING trials whose worker is known to be dead, without waiting ``grace_s`` for its heartbeat to
    go stale: a worker of this machine whose process is gone, and a trial that never named its worker (killed
    before its first heartbeat, which Optuna's staleness check never fails) started over ``grace_s`` ago. Each is
    retried as a stale trial is, so a local rerun after a kill runs the killed trial's point first, as an
    uninterrupted study would have. Returns the numbers of the failed trials."""
    import copy
    import datetime as dt

    import optuna

    storage, now = study._storage, dt.datetime.now()
    callback = storage.get_heartbeat_stale_trial_callback()
    trials = study.get_trials(deepcopy=False)
    # A worker that failed an orphan and died before enqueueing its retry left it unretried: retry it now.
    retried = {n for t in trials for n in t.system_attrs.get("retry_history", [])}
    failed = [
        t for t in trials
        if t.state == optuna.trial.TrialState.FAIL and t.system_attrs.get(ORPHANED) and t.number not in retried
    ]  # fmt: skip
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        worker = t.user_attrs.get("worker")
        if worker is not None:
            gone = worker_gone(str(worker))
        else:
            gone = t.datetime_start is not None and (now - t.datetime_start).total_seconds() > grace_s
        if not gone:
            continue
        try:
            storage.set_trial_system_attr(t._trial_id, ORPHANED, True)  # marked first: see above
            if storage.set_trial_state_values(t._trial_id, state=optuna.trial.TrialState.FAIL):
                failed.append(t)
        except optuna.exceptions.UpdateFinishedTrialError:
            continue  # another worker failed it first
    for t in failed:
        if callback is not None:
            callback(study, copy.deepcopy(storage.get_trial(t._trial_id)))
    return [t.number for t in failed]
