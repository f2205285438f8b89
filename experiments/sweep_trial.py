"""One sweep trial on shared storage: taken under the workers' lock, run under a heartbeat, then told.

``study.optimize`` takes a queued trial (trial 0, the config as written, and every retry of a killed trial) by
reading it WAITING, then writing RUNNING; on SQLite the two are not one transaction, so two workers could both take
one trial, and the later ``tell`` fail ("Cannot tell a COMPLETE trial"). Here a worker takes its trial
(``take_trial``) while it holds the lock under which it also fails and retries dead trials
(``sweep_recovery.recovery_lock``) and names itself on it at once; it then runs it (``run_trial``) with the
heartbeat that ``optimize`` would have kept (a trial whose heartbeat is silent for ``sweep.grace_s`` is failed and
its point retried).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any


def take_trial(study: Any, worker: str) -> Any:
    """``study.ask()``: a queued trial if there is one, else a new one; call it under ``recovery_lock``."""
    with warnings.catch_warnings():
        # "Heartbeat of storage is supposed to be used with Study.optimize": run_trial keeps the heartbeat
        warnings.simplefilter("ignore", UserWarning)
        trial = study.ask()
    trial.set_user_attr("worker", worker)  # at once: until then only the trial's age tells it is orphaned
    return trial


@contextlib.contextmanager
def heartbeat(storage: Any, trial_id: int) -> Iterator[None]:
    """Record the trial's heartbeat now and every ``heartbeat_interval`` seconds until the block ends (as Optuna's
    ``optimize`` does); nothing for a storage without heartbeats."""
    interval = getattr(storage, "get_heartbeat_interval", lambda: None)()
    if not interval:
        yield
        return
    stop = threading.Event()

    def beat() -> None:
        while True:
            # a lost connection is reported by the trial's own writes, in one line; a silent heartbeat then lets
            # the other workers retry the trial's point
            with contextlib.suppress(Exception):
                storage.record_heartbeat(trial_id)
            if stop.wait(interval):
                return

    thread = threading.Thread(target=beat, name=f"heartbeat-{trial_id}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def run_trial(
    study: Any, trial: Any, objective: Callable[[Any], float], catch: tuple[type[BaseException], ...] = ()
) -> Any:
    """Evaluate ``trial`` and tell the storage how it ended: COMPLETE with the objective's value, PRUNED, or FAIL.
    An exception of ``catch`` fails the trial and is not raised; any other is raised once the trial is failed.
    A trial that was failed meanwhile (its heartbeat went stale: another worker retries its point) is left as it
    is. Returns the trial as stored."""
    import optuna
    from optuna.trial import TrialState

    value, state, error = None, TrialState.COMPLETE, None
    with heartbeat(study._storage, trial._trial_id):
        try:
            value = objective(trial)
        except optuna.TrialPruned:
            state = TrialState.PRUNED
        except optuna.exceptions.UpdateFinishedTrialError:
            state = TrialState.FAIL  # failed under us as stale: its retry runs the point
        except (Exception, KeyboardInterrupt) as err:
            state, error = TrialState.FAIL, err
    try:
        frozen = study.tell(trial, value, state=state, skip_if_finished=True)
    except optuna.exceptions.UpdateFinishedTrialError:  # failed as stale between the check and the write
        frozen = study._storage.get_trial(trial._trial_id)
    if error is not None and not isinstance(error, catch):
        raise error
    return frozen
