"""The kill -9 matrix: every ``draftgym`` command that writes results as it goes (``record``, ``train``,
``train-drafter``, ``sweep``, ``run``), killed with SIGKILL (its whole process group) at a random point while it
writes them and then run again, ends with exactly the results of an uninterrupted run.

Each case runs the real command line in a subprocess, at the tiniest settings that still do real work: once into
A, uninterrupted (timing when its first partial result appears and when it ends); then into B, killed once its
first partial result exists plus a random fraction (seeded ``random.Random``) of the time A took from there to its
end; then into B again, to the end. What "exactly the results" means, per command:

- ``record``: every array of the trace, its header (but ``created``, a timestamp, and ``provenance``, which names
  the command) and nothing left beside it.
- ``train``: each saved policy's parameters, learned state (the payload bytes), training meta (but
  ``train_seconds``) and actions on fixed observations. The policies are bandits and a ridge predictor, whose
  training is deterministic and is simply redone by the rerun. stable-baselines3 training is left out: it resumes
  from its last checkpoint (``tests/policies/test_rl.py``) but not to the same weights, since its RNG and env
  states are not checkpointed.
- ``train-drafter``: the head's tensors, its JSON (but CPU minutes and timestamps) and the distillation data. The
  budget is in steps (``--steps``, a checkpoint after every step): a CPU-minute budget ends, and sets the
  learning-rate schedule, at a time no two runs share. It is killed while it trains (after its first checkpoint):
  resuming the data, one file per batch of prompts, is skipping the files there.
- ``sweep`` (analytic backend with a simulated time per prompt): the finished trials in order (state, parameters,
  value, intermediate values, method), the best trial and the exported best config. The killed trial is failed
  and its point retried, so B holds a FAIL trial more and its trial numbers shift by one.
- ``run``: the records, sorted by (method, prompt), but their wall times; the summary rows but throughputs and
  speedups (both wall-clock); the online policies' saved states.

The subprocesses run torch on one thread (``OMP_NUM_THREADS=1``): on a shared 2-core machine two threads per
process spin against each other's load (up to 10x slower). A and B run alike, so the comparison is unaffected.
``DRAFTGYM_KILL_SEED`` moves the kill points (default 0).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
SEED = os.environ.get("DRAFTGYM_KILL_SEED", "0")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
POLL_S = 0.02
TIMEOUT_S = 300
KILL_WINDOW = (0.1, 0.7)  # fractions of A's time from its first partial result to its end: lands mid-run

RUN_TOML = """name = "kill-run"
methods = ["ar", "ngram-d4", "policy:ucb", "policy:thompson"]
[model]
dtype = "fp32"   # greedy exactness is defined in fp32
device = "cpu"
[workload]
limit = 2
[decode]
max_new_tokens = 8
warmup = false
# online bandits: they learn from prompt to prompt (rewards from the shipped fp32 cost model: deterministic)
[policies.ucb]
kind = "ucb1"
arms = ["none", "ngram-d2", "ngram-d4", "ngram-d8"]
params = { c = 1.0, scale = 13.0 }
[policies.thompson]
kind = "thompson"
arms = ["none", "ngram-d2", "ngram-d4", "ngram-d8"]
params = { scale = 13.0 }
"""

TRAIN_TOML = """name = "kill-train"
seed = 0
[policies.ucb1]
kind = "ucb1"
arms = ["none", "ngram-d2", "ngram-d4", "ngram-d8"]
params = { scale = 1.0, c = 0.3 }
train = { test_per_category = 1, total_timesteps = 1500 }
[policies.thompson]
kind = "thompson"
arms = ["none", "ngram-d2", "ngram-d4", "ngram-d8"]
params = { scale = 0.3 }
train = { test_per_category = 1, total_timesteps = 1500 }
[policies.predictor]
kind = "predictor"
arms = ["none", "ngram-d2", "ngram-d4", "ngram-d8"]
params = { model = "ridge", alpha = 1.0 }
train = { test_per_category = 1 }
"""

SWEEP_TOML = """name = "kill-sweep"
methods = ["ar", "ngram-d8"]
[workload]
limit = 3
[sweep]
n_trials = 6
backend = "analytic"
analytic_prompt_s = 0.15   # a trial lasts long enough to be killed in
heartbeat_s = 1
grace_s = 2
"""


def _exact(a: Any) -> tuple[str, tuple[int, ...], bytes]:
    """An array (numpy or torch) as a value that ``==`` compares bit for bit."""
    a = np.ascontiguousarray(a.numpy() if hasattr(a, "numpy") else a)
    return str(a.dtype), tuple(a.shape), a.tobytes()


def _without(d: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k not in keys}


# ---------------------------------------------------------------------------------------------- record


def _record_results(out: Path) -> dict[str, Any]:
    from env.trace import load_trace

    t = load_trace(out / "trace.npz")
    arrays = {k: _exact(getattr(t, k)) for k in ("prompt_tokens", "prompt_off", "traj", "traj_off", "feat")}
    for name, tree in t.trees.items():
        arrays.update({f"{name}/{k}": _exact(getattr(tree, k)) for k in ("off", "tokens", "parents")})
    return {
        "header": _without(t.header, "created", "provenance"),
        "arrays": arrays,
        "files": sorted(os.listdir(out)),
    }


# ---------------------------------------------------------------------------------------------- train


def _train_results(out: Path) -> dict[str, Any]:
    from policies import load_policy
    from policies.base import read_policy

    result = {}
    for path in sorted((out / "policies").glob("*.zip")):
        header, files = read_policy(path)
        obs = np.random.default_rng(0).random((16, header.obs_size)).astype(np.float32)
        policy = load_policy(path)
        result[path.name] = {
            "header": (
                header.type,
                header.kind,
                header.arms,
                header.obs_size,
                header.params,
                header.features,
            ),
            "meta": _without(header.meta, "train_seconds"),
            "payload": files,
            "actions": [policy.act(o) for o in obs],
        }
    return result


# ---------------------------------------------------------------------------------------------- train-drafter


def _drafter_results(out: Path) -> dict[str, Any]:
    from safetensors import safe_open

    def tensors(path: Path) -> dict[str, Any]:
        with safe_open(str(path), framework="pt") as fh:
            return {"meta": fh.metadata(), **{k: _exact(fh.get_tensor(k)) for k in sorted(fh.keys())}}

    meta = json.loads((out / "head.json").read_text())
    training = _without(meta["training"], "train_cpu_minutes", "data_cpu_minutes")
    training["data"] = _without(training["data"], "cpu_s")
    return {
        "head": tensors(out / "head.safetensors"),
        "meta": {**_without(meta, "created", "training"), "training": training},
        "data": {p.name: tensors(p) for p in sorted((out / "work").glob("part-*.safetensors"))},
    }


# ---------------------------------------------------------------------------------------------- sweep


def _sweep_results(out: Path) -> dict[str, Any]:
    from experiments.config import load_config

    s = json.loads((out / "sweep.json").read_text())
    keys = ("state", "params", "value", "intermediate", "method", "default")
    finished = [{k: t[k] for k in keys} for t in s["trials"] if t["state"] in ("COMPLETE", "PRUNED")]
    return {
        "trials": finished,
        "best": _without(s["best"], "number"),
        "states": _without(s["states"], "FAIL"),
        "best_config": load_config(out / "best.toml"),
    }


# ---------------------------------------------------------------------------------------------- run


def _run_results(out: Path) -> dict[str, Any]:
    from policies.base import read_policy

    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    # timings differ, and so do the timing sessions (a killed and rerun folder's records come from two)
    records = sorted(
        (_without(r, "wall_s", "session") for r in records), key=lambda r: (r["method"], r["prompt_id"])
    )
    summary = json.loads((out / "summary.json").read_text())
    from experiments.bench_summary import TIMED_FIELDS as timed

    notes = [n for n in summary.get("notes", []) if "session" not in n]
    states = {}
    for path in sorted((out / "policies").glob("*.zip")):
        header, files = read_policy(path)
        last = _without(header.meta.get("run_record", {}), "wall_s", "session")
        states[path.name] = {"payload": files, "params": header.params, "last_record": last}
    return {
        "records": records,
        "summary": {
            **summary,
            "summary": [_without(row, *timed) for row in summary["summary"]],
            "notes": notes,
        },
        "policy_states": states,
        "plots": sorted(p.name for p in (out / "plots").glob("*.png")),
    }


# ---------------------------------------------------------------------------------------------- the matrix


@dataclass(frozen=True)
class Case:
    argv: Callable[[Path, Path], list[str]]  # (folder of the configs, output folder) -> arguments of draftgym
    started: Callable[[Path], bool]  # its first partial result is in the output folder
    results: Callable[[Path], Any]  # what defines its results, comparable with ==


CASES = {
    "record": Case(
        lambda cfg, out: [
            "record",
            "--limit",
            "2",
            "--max-new-tokens",
            "16",
            "--out",
            str(out / "trace.npz"),
        ],
        lambda out: (out / "trace.npz.parts" / "00000.npz").is_file() or (out / "trace.npz").is_file(),
        _record_results,
    ),
    "train": Case(
        lambda cfg, out: ["train", str(cfg / "train.toml"), "--out", str(out)],
        lambda out: any((out / "policies").glob("*.zip")),
        _train_results,
    ),
    "train-drafter": Case(
        lambda cfg, out: [
            "train-drafter",
            "eagle",
            "--per-category",
            "2",
            "--exclude-per-category",
            "0",
            "--prefill-per-category",
            "0",
            "--max-new-tokens",
            "8",
            "--window",
            "64",
            "--train-window",
            "32",
            "--draft-vocab",
            "512",
            "--steps",
            "6",
            "--save-every-s",
            "0",
            "--work",
            str(out / "work"),
            "--out",
            str(out / "head"),
        ],  # fmt: skip
        lambda out: (out / "work" / "train-state-eagle.pt").is_file(),  # killed while it trains
        _drafter_results,
    ),
    "sweep": Case(
        lambda cfg, out: ["sweep", str(cfg / "sweep.toml"), "--out", str(out)],
        lambda out: (out / "trials.jsonl").is_file() and (out / "trials.jsonl").stat().st_size > 0,
        _sweep_results,
    ),
    "run": Case(
        lambda cfg, out: ["run", str(cfg / "run.toml"), "--out", str(out)],
        lambda out: (out / "records.jsonl").is_file() and (out / "records.jsonl").stat().st_size > 0,
        _run_results,
    ),
}
MODEL = pytest.mark.model  # the commands that load the embedded model


def _start(argv: list[str], log: Path) -> subprocess.Popen:
    with log.open("ab") as err:  # a file, not a pipe: a pipe nobody reads would block the command
        return subprocess.Popen([sys.executable, "-m", "experiments", *argv, "--json"], cwd=ROOT, env=ENV,
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)  # fmt: skip


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _run_to_end(argv: list[str], out: Path, case: Case, log: Path) -> tuple[float, float]:
    """Run a command to its end; returns (seconds until its first partial result, seconds in all)."""
    t0 = time.monotonic()
    proc, first = _start(argv, log), None
    try:
        while proc.poll() is None:
            if first is None and case.started(out):
                first = time.monotonic() - t0
            assert time.monotonic() - t0 < TIMEOUT_S, f"{argv[0]} ran over {TIMEOUT_S} s"
            time.sleep(POLL_S)
    finally:
        _stop(proc)
    total = time.monotonic() - t0
    assert proc.returncode == 0, log.read_text()[-3000:]
    return (total if first is None else first), total


@pytest.mark.slow
@pytest.mark.parametrize(
    "command",
    [pytest.param("record", marks=MODEL), "train", pytest.param("train-drafter", marks=MODEL), "sweep",
     pytest.param("run", marks=MODEL)],
)  # fmt: skip
def test_killed_and_rerun_ends_with_the_uninterrupted_results(command, tmp_path):
    case = CASES[command]
    (tmp_path / "run.toml").write_text(RUN_TOML)
    (tmp_path / "train.toml").write_text(TRAIN_TOML)
    (tmp_path / "sweep.toml").write_text(SWEEP_TOML)
    a, b, log = tmp_path / "A", tmp_path / "B", tmp_path / "stderr.log"
    first, total = _run_to_end(case.argv(tmp_path, a), a, case, log)

    delay = random.Random(f"{SEED}:{command}").uniform(*KILL_WINDOW) * (total - first)
    for attempt, scale in enumerate((1.0, 0.25, 0.0)):  # ended before its kill (a faster run): again, sooner
        b = tmp_path / f"B{attempt}"
        proc, t0 = _start(case.argv(tmp_path, b), log), time.monotonic()
        try:
            while proc.poll() is None and not case.started(b):
                assert time.monotonic() - t0 < TIMEOUT_S, f"{command} wrote no result in {TIMEOUT_S} s"
                time.sleep(POLL_S)
            time.sleep(delay * scale)
            killed = proc.poll() is None
        finally:
            _stop(proc)
        print(f"draftgym {command}: killed {delay * scale:.2f} s after its first result: {killed}")
        if killed:
            break
    assert killed, f"draftgym {command} finished before every kill"

    _run_to_end(case.argv(tmp_path, b), b, case, log)
    assert case.results(b) == case.results(a)


# ---------------------------------------------------------------------------------------------- narrow kill points
# Moments too short for a random kill to find, reached on purpose (in-process: the model loads once).


@pytest.mark.model
def test_run_killed_between_a_policy_state_and_its_record(tmp_path, fp32_model, monkeypatch):
    """The online policy's state after a prompt is saved with that prompt's record, before the record is
    appended; killed in between, the rerun appends the record from the state instead of decoding the prompt again
    with a policy that already learned from it."""
    import experiments.methods as methods
    from experiments.config import load_config
    from experiments.runner import run

    cfg = load_config(None, text=RUN_TOML)
    run(cfg, tmp_path / "A", progress=False, loaded=fp32_model)
    real = methods.save_policy_states

    def killed_after_the_state(decoders, state_dir, method):
        real(decoders, state_dir, method)
        if method == "policy:thompson":
            raise KeyboardInterrupt

    monkeypatch.setattr(methods, "save_policy_states", killed_after_the_state)
    with pytest.raises(KeyboardInterrupt):
        run(cfg, tmp_path / "B", progress=False, loaded=fp32_model)
    assert "policy:thompson" not in (tmp_path / "B" / "records.jsonl").read_text()
    monkeypatch.undo()
    run(cfg, tmp_path / "B", progress=False, loaded=fp32_model)
    assert _run_results(tmp_path / "B") == _run_results(tmp_path / "A")


@pytest.mark.model
def test_record_killed_before_its_parts_were_deleted(tmp_path, fp32_model, monkeypatch):
    """Killed after the trace was saved, before its parts were deleted (or after the end): the rerun returns the
    trace as it is; another recording into the same file is refused, naming the settings that differ."""
    import env.trace_record as trace_mod
    from env.trace import TraceError, load_trace
    from env.trace_record import record
    from env.workloads import load_workload

    prompts, out = load_workload(None)[:1], tmp_path / "trace.npz"

    def killed(parts_dir):
        raise KeyboardInterrupt

    monkeypatch.setattr(trace_mod, "_remove_parts", killed)
    with pytest.raises(KeyboardInterrupt):
        record(fp32_model, prompts, ["ngram"], out, max_new_tokens=6, progress=False)
    assert out.is_file() and (tmp_path / "trace.npz.parts").is_dir()
    monkeypatch.undo()
    saved = _record_results(tmp_path)
    for _ in range(2):  # after the kill, then after the end
        record(fp32_model, prompts, ["ngram"], out, max_new_tokens=6, progress=False)
        assert _record_results(tmp_path) == {**saved, "files": ["trace.npz"]}
    with pytest.raises(TraceError, match="other settings.*max_new_tokens"):
        record(fp32_model, prompts, ["ngram"], out, max_new_tokens=7, progress=False)
    again = record(fp32_model, prompts, ["ngram"], out, max_new_tokens=7, progress=False, overwrite=True)
    assert again.max_new_tokens == 7 == load_trace(out).max_new_tokens


@pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used with Study.optimize")
def test_orphaned_sweep_trials_are_failed_and_retried_at_once(tmp_path):
    """A RUNNING trial whose worker of this machine is gone, or which never named its worker and is older than
    ``grace_s``, is failed without waiting for its heartbeat to go stale, and its point is queued again (without
    the dead worker's name); a trial of a live worker is left alone."""
    import socket

    from experiments.config import load_config
    from experiments.space import sample
    from experiments.sweep import open_study
    from experiments.sweep_recovery import fail_orphaned_trials

    cfg = load_config(None, text=SWEEP_TOML)
    study = open_study(cfg, f"sqlite:///{tmp_path / 'study.db'}")
    gone = subprocess.run([sys.executable, "-c", "print(__import__('os').getpid())"], capture_output=True)
    host = socket.gethostname()
    dead = study.ask()  # trial 0: the config as written
    dead.set_user_attr("worker", f"{host}:{int(gone.stdout)}")
    params = sample(dead, cfg)
    nameless = study.ask()  # killed before it named its worker
    alive = study.ask()
    alive.set_user_attr("worker", f"{host}:{os.getppid()}")

    assert fail_orphaned_trials(study, grace_s=3600) == [dead.number]
    assert fail_orphaned_trials(study, grace_s=0) == [nameless.number]
    trials = {t.number: t for t in study.get_trials()}
    states = [trials[n].state.name for n in (dead.number, nameless.number, alive.number)]
    assert states == ["FAIL", "FAIL", "RUNNING"]
    retries = {t.system_attrs["failed_trial"]: t for t in trials.values() if t.state.name == "WAITING"}
    assert retries[dead.number].params == params and "worker" not in retries[dead.number].user_attrs
    assert retries[dead.number].user_attrs["default"] and retries[nameless.number].params == {}


@pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used with Study.optimize")
def test_sweep_interrupted_in_a_trial_retries_its_point_first(tmp_path, monkeypatch):
    """Ctrl-C inside a trial: Optuna fails it; the trial is marked orphaned, so the next start queues its point
    again and measures it first — the config as written is not lost, and the study draws what an uninterrupted
    one draws."""
    import optuna

    import experiments.objective as objective
    from experiments.sweep import work

    (tmp_path / "sweep.toml").write_text(
        SWEEP_TOML.replace("analytic_prompt_s = 0.15", "analytic_prompt_s = 0")
    )
    cfg, url = str(tmp_path / "sweep.toml"), f"sqlite:///{tmp_path / 'study.db'}"
    real = objective.EVALUATORS["analytic"]

    class Interrupted:
        def __init__(self) -> None:
            self.progress = False

        def __call__(self, *a: Any) -> dict[str, Any]:
            raise KeyboardInterrupt

    monkeypatch.setitem(objective.EVALUATORS, "analytic", Interrupted)
    with pytest.raises(KeyboardInterrupt):
        work(cfg, [], url, tmp_path / "B", progress=False)
    monkeypatch.setitem(objective.EVALUATORS, "analytic", real)
    work(cfg, [], url, tmp_path / "B", progress=False)
    work(cfg, [], f"sqlite:///{tmp_path / 'a.db'}", tmp_path / "A", progress=False)

    def done(db: str) -> list[tuple[bool, dict[str, Any]]]:
        study = optuna.load_study(study_name="kill-sweep", storage=f"sqlite:///{tmp_path / db}")
        ok = [t for t in study.get_trials() if t.state.name == "COMPLETE"]
        return [(bool(t.user_attrs.get("default")), t.params) for t in sorted(ok, key=lambda t: t.number)]

    b, a = done("study.db"), done("a.db")
    assert sum(d for d, _ in b) == 1 and b[0][0]  # the config as written, measured first after the interrupt
    assert b == a
