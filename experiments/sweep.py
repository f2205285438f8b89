"""``draftgym sweep CONFIG``: an Optuna study over the config space, on storage that any number of workers share.

Config -> study (storage, seeded sampler, pruner, the config as written enqueued as trial 0) -> workers -> the
best trial exported as a config (``best.toml``, runnable with ``draftgym run``) with a table and a plot.

- **Space and converter**: ``experiments.space`` (``sample(trial)`` in well-conditioned coordinates,
  ``to_overrides`` from parameters to config); a trial's config is file < trial < ``--set``.
- **Objective**: ``experiments.objective`` (live decoding, the replay env, or the analytic toy); one value per
  prompt goes to ``trial.report`` and the pruner (Wilcoxon signed-rank or median) may stop the trial there (not
  at the last prompt: that would save nothing); a pruned trial shows the mean of the prompts it ran.
- **Storage**: an embedded SQLite file in the run directory by default; ``--storage postgresql://...`` (any Optuna
  RDB URL) for workers on several machines. Every worker writes a heartbeat; a RUNNING trial whose worker was
  killed is failed once silent for ``sweep.grace_s`` and its slot is run again. The run directory records its
  storage and study (``settings.json``) and refuses a rerun on other ones; in-memory SQLite is refused.
- **Workers**: each loops "fail stale trials; stop when ``sweep.n_trials`` trials are finished (complete or pruned);
  wait while the rest are running; else take a trial", under a file lock (``sweep_recovery.recovery_lock``: SQLite
  has no row locks, so two workers could take one queued trial), then runs it (``sweep_trial``). A trial that finds
  ``n_trials`` unfailed trials ahead of it (a race between workers of several machines at the end) marks itself
  FAIL (``surplus``) before evaluating anything, so the study finishes with exactly ``n_trials`` finished trials.
  ``--workers N`` starts N such processes here (sampler seeds ``(sweep.seed, i)``); on another machine, run the same
  command with the same ``--storage`` and another seed (``--set sweep.seed=K``), so that its sampler draws other
  points. Rerunning the command resumes the study.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from tqdm import tqdm

from env.files import Appending, atomic_write_text, jsonl_lines
from experiments.args import output_dir
from experiments.config import Config, ConfigError, load_config, to_toml
from experiments.space import default_params, sample, to_overrides, tuned_method
from experiments.sweep_checks import (
    check_inputs,
    check_resumed,
    input_digests,
    timing_allocator,
    timing_machine,
)
from experiments.sweep_recovery import (
    ORPHANED,
    fail_orphaned_trials,
    in_memory,
    lock_file,
    recovery_lock,
    retry_callback,
    sqlite_file,
)
from experiments.sweep_table import FINISHED, format_trials, trial_row, trial_value
from experiments.sweep_trial import run_trial, take_trial


class StorageError(ValueError):
    """Storage that cannot be opened or reached; the message names the URL (password hidden)."""


class SurplusTrial(Exception):
    """This trial would exceed ``n_trials``; it is recorded as FAIL and not evaluated."""


SECRET_PARAMS = ("password", "passwd", "pwd")  # query parameters that carry a password (``?password=...``)


def mask(url: str) -> str:
    """The URL with its password hidden: that of its credentials and that of a ``password`` query parameter. A
    string SQLAlchemy does not read as a URL is shown only when nothing in it could be a password."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        u = make_url(url)
        secret = {k: "***" for k in u.query if k.lower() in SECRET_PARAMS}
        if u.password is None and not secret:
            return url  # nothing to hide: as given (rendering would quote an '@' of an SQLite path)
        shown = (u.update_query_dict(secret) if secret else u).render_as_string(hide_password=True)
        return shown.replace("=%2A%2A%2A", "=***")  # (the query is quoted)
    except (ArgumentError, ValueError, TypeError):
        if "@" in url or any(k in url.lower() for k in SECRET_PARAMS):
            return url.partition("://")[0] + "://***" if "://" in url else "***"
        return url


def open_storage(url: str, cfg: Config) -> Any:
    """An Optuna RDB storage with heartbeats; unreachable or malformed storage is one ``StorageError`` line."""
    import optuna
    import sqlalchemy.exc

    if in_memory(url):  # each connection (each worker, the export) would see its own empty database
        raise StorageError(
            f"storage {mask(url)} is an in-memory SQLite database, which no other connection sees and which is lost "
            "when the command ends (the study could not be exported or resumed); give a file "
            "(sqlite:///path/study.db) or leave --storage out"
        )
    url = _driver(url)
    engine: dict[str, Any] = {"pool_pre_ping": True}
    if url.startswith("sqlite"):
        engine["connect_args"] = {"timeout": 120}
    elif url.startswith("postgresql"):
        engine["connect_args"] = {"connect_timeout": 10}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            # A trial whose worker died (heartbeat silent for grace_s) is failed and its parameters enqueued
            # again (at most 3 times), so that a kill loses no point of the search, the config as written included.
            return optuna.storages.RDBStorage(
                url,
                heartbeat_stale_trial_callback=retry_callback(),
                engine_kwargs=engine,
                heartbeat_interval=cfg.sweep.heartbeat_s,
                grace_period=cfg.sweep.grace_s,
            )
    except (sqlalchemy.exc.SQLAlchemyError, ImportError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise StorageError(f"cannot open storage {mask(url)}: {first}") from err
    except RuntimeError as err:  # Optuna's check of the tables' schema version
        raise StorageError(
            f"cannot open storage {mask(url)}: its tables have a schema that Optuna {optuna.__version__} does not "
            "read; if an older Optuna made them, upgrade them with `optuna storage upgrade --storage URL` (else "
            "use the Optuna that made them, or another storage)"
        ) from err


def storage_identity(url: str, out: Path) -> str:
    """How a sweep folder names its study's storage (``settings.json``): its own ``study.db`` by that name (the
    folder may move), another SQLite file by its absolute path, any other URL with its password hidden."""
    db = sqlite_file(url)
    if db is None:
        return mask(url)
    return "study.db" if db == (out / "study.db").resolve() else str(db)


def _driver(url: str) -> str:
    """SQLAlchemy 2.1 maps ``postgresql://`` to psycopg 3; use psycopg2 when only that one is installed."""
    import importlib.util

    find = importlib.util.find_spec
    if url.startswith("postgresql://") and find("psycopg") is None and find("psycopg2") is not None:
        return "postgresql+psycopg2://" + url.removeprefix("postgresql://")
    return url


def _sampler(cfg: Config, worker: int) -> Any:
    import optuna

    from experiments.sweep_sampler import HistorySeededSampler

    def make(seed: int) -> Any:
        if cfg.sweep.sampler == "random":
            return optuna.samplers.RandomSampler(seed=seed)
        return optuna.samplers.TPESampler(
            seed=seed, n_startup_trials=min(10, max(2, cfg.sweep.n_trials // 3))
        )

    # seeded per trial from the study's history: a killed and resumed study draws an uninterrupted one's points
    return HistorySeededSampler(make, cfg.sweep.seed, worker)


def _pruner(cfg: Config) -> Any:
    import optuna

    if cfg.sweep.pruner == "wilcoxon":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.pruners.WilcoxonPruner(p_threshold=0.1, n_startup_steps=2)
    if cfg.sweep.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=1)
    return optuna.pruners.NopPruner()


def open_study(cfg: Config, url: str, *, worker: int = 0, create: bool = True) -> Any:
    """Create (or load) the study; the creator enqueues the config as written and records it in the study, so
    that a worker started with another config is refused instead of mixing results."""
    import optuna

    storage = open_storage(url, cfg)
    name = cfg.sweep.study_name or cfg.name
    machine, alloc = (
        timing_machine(cfg),
        timing_allocator(cfg),
    )  # (a bad DRAFTGYM_MALLOC: before any study is made)
    study = optuna.create_study(
        storage=storage,
        study_name=name,
        direction="maximize",
        load_if_exists=True,
        sampler=_sampler(cfg, worker),
        pruner=_pruner(cfg),
    )
    stored = study.user_attrs.get("config")
    if stored is None and create:
        # the config attribute marks a created study: set it last, so that a creator killed in between leaves a
        # study whose next worker enqueues the config as written (once: skip_if_exists)
        study.enqueue_trial(default_params(cfg), user_attrs={"default": True}, skip_if_exists=True)
        study.set_user_attr("inputs", input_digests(cfg))
        if machine:
            study.set_user_attr("machine", machine)
        if alloc:
            study.set_user_attr("allocator", alloc)
        study.set_user_attr("config", to_toml(cfg))
    elif stored is not None:
        check_resumed(study, cfg, f"study {name!r} in {mask(url)}")
    return study


def counts(study: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in study.get_trials(deepcopy=False):
        out[t.state.name] = out.get(t.state.name, 0) + 1
    return out


def finished(study: Any) -> int:
    c = counts(study)
    return sum(c.get(s, 0) for s in FINISHED)


# ------------------------------------------------------------------------------------------------ one worker


def work(
    config: str, sets: list[str], url: str, out: Path, *, worker: int = 0, progress: bool = True
) -> None:
    """Run trials until the study has ``sweep.n_trials`` finished ones (this worker's share is whatever is left)."""
    import optuna
    import sqlalchemy.exc

    from experiments.objective import EVALUATORS

    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    base = load_config(config, sets=sets)
    n = base.sweep.n_trials
    study = open_study(base, url, worker=worker)
    evaluator = EVALUATORS[base.sweep.backend]()
    evaluator.progress = progress  # live decoding shows a bar over each trial's prompts
    me = f"{socket.gethostname()}:{os.getpid()}"
    from env.machine import cpu_label

    cpu = cpu_label()  # each trial names the machine it was measured on
    log = out / "trials.jsonl"

    def objective(trial: Any) -> float:
        live = (
            optuna.trial.TrialState.COMPLETE,
            optuna.trial.TrialState.PRUNED,
            optuna.trial.TrialState.RUNNING,
            optuna.trial.TrialState.WAITING,
        )
        ahead = sum(1 for t in study.get_trials(deepcopy=False, states=live) if t.number < trial.number)
        if ahead >= n:
            trial.set_user_attr("surplus", True)
            raise SurplusTrial(f"trial {trial.number}: {n} trials are already finished or running")
        trial.set_user_attr("cpu", cpu)

        def report(step: int, value: float, n_steps: int) -> None:
            trial.report(value, step)
            # never at the last prompt: stopping there saves nothing (the trial is complete)
            if step < n_steps - 1 and trial.should_prune():
                raise optuna.TrialPruned(f"pruned at prompt {step}")

        try:
            params = sample(trial, base)
            cfg = load_config(config, trial=to_overrides(base, params), sets=sets)  # file < trial < --set
            trial.set_user_attr("method", tuned_method(cfg))
            result = evaluator(cfg, params, report)
        except KeyboardInterrupt:  # the trial is failed; marked so the next start retries its point first
            study._storage.set_trial_system_attr(trial._trial_id, ORPHANED, True)
            raise
        for k, v in result.items():
            if k != "value":
                trial.set_user_attr(k, v)
        return float(result["value"])

    def record(t: Any) -> None:  # after the storage has the trial's final state
        if t.state.name in FINISHED:
            line = {
                "number": t.number,
                "state": t.state.name,
                "value": trial_value(t),  # a pruned trial: the mean of the prompts it ran
                "params": t.params,
                "method": t.user_attrs.get("method"),
                "worker": me,
            }
            with recovery_lock(lock), Appending(log) as fh:  # one writer at a time: no line torn by another
                fh.write(json.dumps(line) + "\n")

    out.mkdir(parents=True, exist_ok=True)
    lock = lock_file(url, out)
    with recovery_lock(lock):  # a torn last line (a worker killed mid-write) is cut before this one appends
        jsonl_lines(log, repair=True)
    bar = tqdm(total=n, desc=f"sweep {study.study_name}", disable=not progress)
    try:
        while True:
            # One worker at a time (SQLite has no row locks) fails and retries dead trials, counts, and takes its
            # next trial: two workers never take the same queued one.
            trial = None
            with recovery_lock(lock):
                optuna.storages.fail_stale_trials(study)
                fail_orphaned_trials(study, base.sweep.grace_s)
                c = counts(study)
                done = sum(c.get(s, 0) for s in FINISHED)
                if done < n and done + c.get("RUNNING", 0) < n:
                    trial = take_trial(study, me)
            bar.n = min(n, done)
            bar.refresh()
            if done >= n:
                break
            if trial is None:
                time.sleep(min(1.0, base.sweep.heartbeat_s))  # the rest are running (or about to be failed)
                continue
            record(run_trial(study, trial, objective, catch=(SurplusTrial,)))
            bar.n = min(n, finished(study))
            bar.refresh()
    except sqlalchemy.exc.OperationalError as err:
        raise StorageError(f"lost storage {mask(url)}: {str(err).strip().splitlines()[0]}") from err
    finally:
        bar.close()


# ------------------------------------------------------------------------------------------------ many workers


WORKERS_PER_CORE = 4  # --workers at most this many per CPU core of the machine they start on


def spawn(args: Any, url: str, out: Path, n_workers: int, progress: bool) -> None:
    """Start ``n_workers`` worker processes on this machine and follow the study until they end."""
    base = load_config(args.config, sets=args.set or [])
    study = open_study(base, url)
    logs = out / "workers"
    logs.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    bar = None
    try:  # from the first worker on: Ctrl-C or SIGTERM at any point stops the workers started so far
        for i in range(n_workers):
            cmd = [sys.executable, "-m", "experiments", "sweep", args.config, "--storage", url, "--out", str(out),
                   "--worker-id", str(i)]  # fmt: skip
            for s in args.set or []:
                cmd += ["--set", s]
            with (logs / f"worker-{i}.log").open("a") as fh:
                procs.append(subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT))
        atomic_write_text(
            out / "workers.json", json.dumps({"pids": [p.pid for p in procs], "storage": mask(url)})
        )
        bar = tqdm(
            total=base.sweep.n_trials,
            desc=f"sweep {study.study_name} ({n_workers} workers)",
            disable=not progress,
        )
        while any(p.poll() is None for p in procs):
            bar.n = min(base.sweep.n_trials, finished(study))
            bar.refresh()
            time.sleep(1.0)
    except (
        BaseException
    ):  # Ctrl-C, SIGTERM, a worker that could not start: the others stop, and are waited for
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        raise
    finally:
        if bar is not None:
            bar.close()
    bad = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
    if bad and finished(study) < base.sweep.n_trials:
        i, rc = bad[0]
        tail = (logs / f"worker-{i}.log").read_text().strip().splitlines()[-1:] or ["(no output)"]
        raise StorageError(
            f"worker {i} exited with {rc}: {tail[0]} (log: {logs}/worker-{i}.log); rerun to resume"
        )
    for i, rc in bad:
        print(f"draftgym sweep: worker {i} exited with {rc}; the others finished the study", file=sys.stderr)


# ------------------------------------------------------------------------------------------------ results


def export(config: str, sets: list[str], url: str, out: Path) -> dict[str, Any]:
    """best.toml (the best trial's resolved config), sweep.json (every trial), sweep.md (table), history plot."""
    from experiments import plots

    base = load_config(config, sets=sets)
    study = open_study(base, url, create=False)
    trials = [trial_row(t) for t in study.get_trials(deepcopy=False)]
    complete = [t for t in trials if t["state"] == "COMPLETE"]
    if not complete:
        raise ConfigError(f"study {study.study_name!r} has no complete trial yet; nothing to export")
    best = max(complete, key=lambda t: t["value"])
    best_cfg = load_config(config, trial=to_overrides(base, best["params"]), sets=sets)
    header = (
        f"Best trial {best['number']} of study {study.study_name!r}: {base.sweep.objective} = "
        f"{best['value']:.4f} ({base.sweep.backend} backend)\n"
        f"Exported by: draftgym sweep {config}\nRun it: draftgym run {out / 'best.toml'}"
    )
    atomic_write_text(out / "best.toml", to_toml(best_cfg, header=header))
    table = format_trials(trials, base)
    result = {
        "study": study.study_name,
        "storage": mask(url),
        "objective": base.sweep.objective,
        "backend": base.sweep.backend,
        "n_trials": base.sweep.n_trials,
        "states": counts(study),
        "best": best,
        "trials": trials,
    }
    atomic_write_text(out / "sweep.json", json.dumps(result, indent=2))
    atomic_write_text(out / "sweep.md", f"# Sweep {study.study_name}\n\n```\n{table}\n```\n")
    machine = study.user_attrs.get("machine")  # live tokens/s: the creator's CPU, which every worker matched
    alloc = study.user_attrs.get("allocator")  # ... and its C allocator's setting
    machine = (
        f"{machine}, allocator {alloc}" if isinstance(machine, str) and isinstance(alloc, str) else machine
    )
    note = f"measured on {machine}" if isinstance(machine, str) else (
        "live: each trial timed on its worker's machine, against its own AR loop" if base.sweep.backend == "live"
        else ""
    )  # fmt: skip
    result["plots"] = [str(plots.sweep_history(trials, out / "plots" / "history.png", note=note))]
    result["table"] = table
    return result


# ------------------------------------------------------------------------------------------------ command line


def _study_of_results(out: Path, storage: Any, name: str, url: str) -> None:
    """A folder holding a sweep's results (``trials.jsonl``, ``sweep.json``) resumes only from a storage that holds
    its study: a deleted or emptied ``study.db`` started a new study whose trials were appended to the old ones' and
    whose best replaced the old best."""
    import optuna
    import sqlalchemy.exc

    held = [n for n in ("trials.jsonl", "sweep.json") if (out / n).is_file() and (out / n).stat().st_size]
    try:
        known = optuna.study.get_all_study_names(storage=storage) if held else []
    except sqlalchemy.exc.SQLAlchemyError as err:  # (a connection lost since it opened)
        raise StorageError(f"storage {mask(url)} cannot be read ({type(err).__name__})") from None
    if held and name not in known:
        raise StorageError(
            f"{out} holds the results of study {name!r} ({', '.join(held)}), but the storage {mask(url)} has no such "
            "study (a deleted or emptied study.db?): a new one would be mixed with them; restore the storage or "
            "use another --out"
        )


def cmd_sweep(args: Any) -> int:
    import optuna

    from env.files import other_command
    from experiments.args import same_settings
    from experiments.errors import UserError
    from experiments.runner import check_run_dir, prepare_run_dir

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sets = args.set or []
    base = load_config(args.config, sets=sets)
    if args.worker_id is None:  # checks before any folder is made
        if args.workers < 1:
            raise ConfigError(f"--workers must be >= 1, got {args.workers}")
        cores = os.cpu_count() or 1
        if args.workers > WORKERS_PER_CORE * cores:  # each a Python process with its own model or trace
            raise ConfigError(
                f"--workers {args.workers}: at most {WORKERS_PER_CORE * cores} on this machine "
                f"({WORKERS_PER_CORE} per CPU core, {cores} cores); run more on other machines with the same --storage"
            )
        if args.storage:
            open_storage(args.storage, base)  # a storage that cannot be opened fails first
        # a missing trace, cost model or workload, a --set of a swept key: refused before the run folder is written
        check_inputs(base, sets)
    out = output_dir(args.out or f"runs/sweep-{base.name}")
    url = args.storage or f"sqlite:///{(out / 'study.db').resolve()}"
    progress = not args.json
    if args.worker_id is not None:  # a worker started by --workers: run trials, nothing else
        work(args.config, sets, url, out, worker=args.worker_id, progress=False)
        return 0
    ignore = ("sweep.n_trials", "sweep.seed")
    check_run_dir(base, out, ignore=ignore)  # another config is refused first, before the storage is recorded
    other = other_command(
        out, None, "sweep"
    )  # another command's folder: before the study's SQLite file is made
    if other:
        raise UserError(other)
    # the run directory's own SQLite file, before the run directory is written (a --storage was opened above)
    storage = open_storage(url, base)
    # the folder's trials.jsonl and results belong to one study: a rerun on other storage would mix two
    study = {"storage": storage_identity(url, out), "study": base.sweep.study_name or base.name}
    same_settings(out, study, started=(out / "config.toml").is_file(), command="sweep")
    _study_of_results(out, storage, study["study"], url)
    prepare_run_dir(base, out, ignore=ignore)
    if args.workers == 1:
        work(args.config, sets, url, out, progress=progress)
    else:
        spawn(args, url, out, args.workers, progress)
    result = export(args.config, sets, url, out)
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "table"}))
    else:
        print(result["table"])
        print(f"\nbest config: {out / 'best.toml'} (draftgym run {out / 'best.toml'}); study in {mask(url)}")
    return 0


def register(sub: Any) -> None:
    from experiments.args import nonnegative_int, positive_int
    from experiments.runner import add_config_args

    p = sub.add_parser("sweep", help="an Optuna study over tree shapes or policy hyper-parameters")
    add_config_args(p, out_default="runs/sweep-<name>")
    p.add_argument(
        "--storage",
        default=None,
        help="Optuna RDB URL shared by all workers, e.g. postgresql://user:pw@host/db "
        "(default: sqlite file study.db in the run directory)",
    )
    p.add_argument(
        "--workers", type=positive_int, default=1, help="worker processes to start on this machine"
    )
    p.add_argument("--worker-id", type=nonnegative_int, default=None, help=argparse_suppress())
    p.set_defaults(func=cmd_sweep)


def argparse_suppress() -> str:
    import argparse

    return argparse.SUPPRESS
