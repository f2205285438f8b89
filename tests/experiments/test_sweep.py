"""``draftgym sweep`` on shared storage: several worker processes record every trial exactly once, and a study whose
workers are killed (SIGKILL, mid-trial) resumes and finishes with exactly ``n_trials`` complete trials.

Runs on an SQLite file and on a real PostgreSQL server (``DRAFTGYM_TEST_PG_URL``, set by ``.ci/run`` through
``.ci/postgres.sh``). The objective is the analytic backend with a simulated per-prompt time, so that trials last
long enough to be killed mid-way and the test needs no model.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest

from experiments.config import load_config

PG_ENV = "DRAFTGYM_TEST_PG_URL"


@pytest.fixture(params=["sqlite", "postgresql"])
def storage(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'shared.db'}"
    url = os.environ.get(PG_ENV)
    if not url:
        pytest.skip(f"{PG_ENV} is unset: start a server with `source .ci/postgres.sh` (.ci/run does)")
    return url


def _config(tmp_path: Path, n: int, prompt_s: float = 0.3) -> tuple[Path, str]:
    study = f"t-{uuid.uuid4().hex[:8]}"
    path = tmp_path / f"{study}.toml"
    path.write_text(
        f'name = "{study}"\nmethods = ["ar", "ngram-d8"]\n[workload]\nlimit = 3\n'
        f'[sweep]\nn_trials = {n}\nbackend = "analytic"\nmax_topk = 2\npruner = "none"\n'
        f"heartbeat_s = 1\ngrace_s = 3\nanalytic_prompt_s = {prompt_s}\n"
    )
    return path, study


def _sweep(cfg: Path, url: str, out: Path, *extra: str) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "experiments",
        "sweep",
        str(cfg),
        "--storage",
        url,
        "--out",
        str(out),
        "--json",
    ]
    return subprocess.Popen([*cmd, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _trials(url: str, study: str) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=study, storage=url).get_trials(deepcopy=False)


def _check_exactly_once(url: str, study: str, out: Path, n: int) -> list[optuna.trial.FrozenTrial]:
    trials = _trials(url, study)
    numbers = [t.number for t in trials]
    assert sorted(numbers) == list(range(len(trials)))  # every trial once, numbered without gaps
    complete = {t.number: t for t in trials if t.state.name == "COMPLETE"}
    assert len(complete) == n, {t.number: t.state.name for t in trials}
    assert not [t for t in trials if t.state.name in ("RUNNING", "WAITING")]
    # the config as written ran once: as trial 0, or as its retry when trial 0's worker was killed
    default = [t for t in complete.values() if t.user_attrs.get("default")]
    assert len(default) == 1 and default[0].user_attrs["method"] == "ngram-d8", default
    assert default[0].number == 0 or trials[0].state.name == "FAIL"
    logged = [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines()]
    assert len({row["number"] for row in logged}) == len(logged)  # no trial logged twice
    for row in logged:  # what the workers ran is what storage holds
        t = complete[row["number"]]
        assert (row["params"], row["value"]) == (t.params, t.value)
    best = load_config(out / "best.toml")
    assert best.methods[-1] == max(complete.values(), key=lambda t: t.value).user_attrs["method"]
    return trials


@pytest.mark.slow
def test_two_workers_record_every_trial_once(storage, tmp_path):
    cfg, study = _config(tmp_path, n=8, prompt_s=0.3)
    out = tmp_path / "run"
    p = _sweep(cfg, storage, out, "--workers", "2")
    stdout, stderr = p.communicate(timeout=600)
    assert p.returncode == 0, stderr
    states = json.loads(stdout)["states"]
    assert states["COMPLETE"] == 8 and set(states) <= {"COMPLETE", "FAIL"}
    trials = _check_exactly_once(storage, study, out, 8)
    # a FAIL is a surplus trial (two workers each starting the last one), which evaluated nothing
    assert all(t.user_attrs.get("surplus") for t in trials if t.state.name == "FAIL")
    assert len({t.user_attrs["worker"] for t in trials}) == 2, "one worker took every trial"


def _wait_for(pred, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = pred()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_killed_workers_leave_a_study_that_resumes(storage, tmp_path):
    n = 6
    cfg, study = _config(tmp_path, n=n, prompt_s=0.4)
    out = tmp_path / "run"
    parent = _sweep(cfg, storage, out, "--workers", "2")
    pids = _wait_for(lambda: (out / "workers.json").is_file() and json.loads((out / "workers.json").read_text())["pids"],
                     300, "workers.json")  # fmt: skip

    def running_of(pid: int):
        try:
            trials = _trials(storage, study)
        except KeyError:  # the study is not created yet
            return None
        return next((t for t in trials if t.state.name == "RUNNING" and t.user_attrs.get("worker", "").endswith(f":{pid}")), None)  # fmt: skip

    def mid_trial(
        pid: int,
    ):  # a trial with one of its 3 prompts done: 0.8 s of work left, so the kill lands in it
        t = running_of(pid)
        return t if t is not None and len(t.intermediate_values) == 1 else None

    victim = _wait_for(lambda: mid_trial(pids[0]), 300, "a trial of worker 0 half done")
    os.kill(pids[0], signal.SIGKILL)  # worker 0 dies mid-trial
    done_before = sum(t.state.name == "COMPLETE" for t in _trials(storage, study))
    _wait_for(lambda: sum(t.state.name == "COMPLETE" for t in _trials(storage, study)) > done_before, 300,
              "worker 1 to go on")  # fmt: skip
    if parent.poll() is None:  # then the whole machine "dies": the parent and the other worker too
        os.kill(pids[1], signal.SIGKILL)
        parent.kill()
    parent.communicate(timeout=60)

    again = _sweep(cfg, storage, out, "--workers", "2")  # the same command resumes the study
    stdout, stderr = again.communicate(timeout=600)
    assert again.returncode == 0, stderr
    trials = _check_exactly_once(storage, study, out, n)
    dead = next(t for t in trials if t.number == victim.number)
    assert dead.state.name == "FAIL"  # the killed trial is failed (heartbeat) and not counted ...
    retried = [
        t for t in trials if t.system_attrs.get("failed_trial") == victim.number and t.number != dead.number
    ]
    assert "COMPLETE" in [t.state.name for t in retried]  # ... but its parameters are run again
    # the killed trial's parameters are run again (it may have died before suggesting them all; the retry then
    # suggests the rest)
    assert all(t.params[k] == v for t in retried for k, v in dead.params.items())


def test_unreachable_storage_is_one_line(tmp_path):
    cfg, _ = _config(tmp_path, n=1)
    for url, needle in [
        (
            "postgresql+psycopg2://u:secret@127.0.0.1:1/db",
            "cannot open storage postgresql+psycopg2://u:***@127.0.0.1:1/db",
        ),
        ("nosuchdb://x/y", "cannot open storage nosuchdb://x/y"),
    ]:
        r = subprocess.run([sys.executable, "-m", "experiments", "sweep", str(cfg), "--storage", url, "--out",
                            str(tmp_path / "o")], capture_output=True, text=True, timeout=300)  # fmt: skip
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr
        assert "secret" not in r.stderr


def test_sweep_exports_the_best_trial_and_refuses_another_config(tmp_path):
    from experiments.cli import main

    cfg, study = _config(tmp_path, n=5, prompt_s=0.0)
    out = tmp_path / "run"
    url = f"sqlite:///{tmp_path / 's.db'}"
    assert main(["sweep", str(cfg), "--storage", url, "--out", str(out), "--json"]) == 0
    trials = _check_exactly_once(url, study, out, 5)
    table = (out / "sweep.md").read_text()
    assert "(config as written)" in table and (out / "plots" / "history.png").is_file()
    # Raising n_trials extends the same study; changing anything else is refused, naming the key.
    assert (
        main(["sweep", str(cfg), "--storage", url, "--out", str(out), "--json", "--set", "sweep.n_trials=6"])
        == 0
    )
    assert len([t for t in _trials(url, study) if t.state.name == "COMPLETE"]) == 6 > len(trials) - 1
    assert (
        main(
            ["sweep", str(cfg), "--storage", url, "--out", str(tmp_path / "o2"), "--set", "sweep.max_topk=3"]
        )
        == 2
    )


def test_live_sweep_loads_the_configured_weight_format(monkeypatch):
    """The live backend loads the target in the config's weight format, and a change of format reloads it."""
    import env.model
    from experiments.config import load_config
    from experiments.objective import LiveEvaluator

    calls = []
    monkeypatch.setattr(env.model, "load_model", lambda *a, **k: calls.append(k) or object())
    monkeypatch.setattr(LiveEvaluator, "_warmup", lambda self, cfg: None)
    ev = LiveEvaluator()
    for w in ("int4", "int4", "dense"):
        ev._model(load_config(None, text=f'methods = ["ar"]\n[model]\nweights = "{w}"\n'))
    assert [c["weights"] for c in calls] == ["int4", "dense"]


def test_a_study_refuses_a_workload_edited_since_it_was_created(tmp_path):
    """A resumed study compared only the config: a workload (or trace) edited under the same path put trials of two
    data sets in one study. The study records their digests and refuses other files in one line."""
    from experiments.config import ConfigError
    from experiments.sweep import open_study

    work = tmp_path / "q.jsonl"
    work.write_text('{"question_id": 1, "category": "qa", "turns": ["What is 2+2?"]}\n')
    path = tmp_path / "c.toml"
    path.write_text(f'name = "w"\nmethods = ["ar", "ngram-d8"]\n[workload]\npath = "{work}"\n'
                    '[sweep]\nn_trials = 2\nbackend = "analytic"\n')  # fmt: skip
    url = f"sqlite:///{tmp_path / 's.db'}"
    open_study(load_config(path), url)
    open_study(load_config(path), url)  # the same files: resumes
    work.write_text('{"question_id": 1, "category": "qa", "turns": ["What is 3+3?"]}\n')
    with pytest.raises(ConfigError, match="workload_sha256 changed since"):
        open_study(load_config(path), url)


def _live_study(tmp_path: Path, objective: str, name: str) -> Path:
    """A config of a live sweep of ``objective`` named ``name``."""
    path = tmp_path / f"{name}.toml"
    path.write_text(f'name = "{name}"\nmethods = ["ar", "ngram-d8"]\n'
                    f'[sweep]\nn_trials = 2\nbackend = "live"\nobjective = "{objective}"\n')  # fmt: skip
    return path


def test_a_live_tokens_per_s_study_refuses_a_worker_on_another_cpu(tmp_path, monkeypatch):
    """Live tokens per second are absolute timings: a study of them records its creator's CPU and refuses a worker
    on another one in one line; a speedup study (each worker's own ratio) takes workers of any machine."""
    import env.machine
    from experiments.config import ConfigError
    from experiments.sweep import open_study

    url = f"sqlite:///{tmp_path / 's.db'}"
    tps, ratio = _live_study(tmp_path, "tokens_per_s", "tps"), _live_study(tmp_path, "speedup", "ratio")
    monkeypatch.setattr(env.machine, "cpu_label", lambda: "CPU A (family 1 model 1; avx512_bf16)")
    assert open_study(load_config(tps), url).user_attrs["machine"].startswith("CPU A")
    open_study(load_config(ratio), url)
    open_study(load_config(tps), url)  # the same machine: joins
    monkeypatch.setattr(env.machine, "cpu_label", lambda: "CPU B (family 2 model 2; no native bf16)")
    with pytest.raises(ConfigError, match=r"measured on CPU A .* this worker runs on CPU B") as err:
        open_study(load_config(tps), url)
    assert "\n" not in str(err.value)
    assert "machine" not in open_study(load_config(ratio), url).user_attrs  # speedup: any machine


def test_a_live_tokens_per_s_study_refuses_a_worker_under_another_allocator(tmp_path, monkeypatch):
    """The C allocator's setting changes a forward's time (env.allocator): a live tokens/s study records its
    creator's (``DRAFTGYM_MALLOC``) and refuses a worker under another in one line; a bad value is one line too; a
    study that predates the record takes any worker; a speedup study records none."""
    import optuna

    from experiments.config import ConfigError
    from experiments.sweep import open_study

    url = f"sqlite:///{tmp_path / 's.db'}"
    tps, ratio = _live_study(tmp_path, "tokens_per_s", "tps"), _live_study(tmp_path, "speedup", "ratio")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    for var in (
        "GLIBC_TUNABLES",
        "MALLOC_MMAP_THRESHOLD_",
        "MALLOC_TRIM_THRESHOLD_",
        "MALLOC_TOP_PAD_",
        "MALLOC_ARENA_MAX",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("DRAFTGYM_MALLOC", "keep")
    assert open_study(load_config(tps), url).user_attrs["allocator"] == "keep"
    open_study(load_config(tps), url)  # the same setting: joins
    assert "allocator" not in open_study(load_config(ratio), url).user_attrs
    monkeypatch.setenv("DRAFTGYM_MALLOC", "system")
    with pytest.raises(ConfigError, match=r"allocator 'keep'; this worker runs with 'system'") as err:
        open_study(load_config(tps), url)
    assert "\n" not in str(err.value) and "the creator's setting" in str(err.value)
    monkeypatch.setenv("DRAFTGYM_MALLOC", "keep")  # the same setting, another arena count: refused too
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    with pytest.raises(
        ConfigError, match=r"allocator 'keep'; this worker runs with 'keep; MALLOC_ARENA_MAX=2'"
    ):
        open_study(load_config(tps), url)
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    monkeypatch.setenv("DRAFTGYM_MALLOC", "system")
    open_study(load_config(ratio), url)  # speedup: each worker's own ratio
    monkeypatch.setenv("DRAFTGYM_MALLOC", "jemalloc")
    with pytest.raises(ConfigError, match=r"DRAFTGYM_MALLOC='jemalloc': valid values are keep, system"):
        open_study(load_config(tps), url)
    with pytest.raises(
        ConfigError, match=r"DRAFTGYM_MALLOC='jemalloc'"
    ):  # a new study: refused before it is made
        open_study(load_config(_live_study(tmp_path, "tokens_per_s", "fresh")), url)
    assert "fresh" not in {s.study_name for s in optuna.get_all_study_summaries(url)}
    monkeypatch.setenv("DRAFTGYM_MALLOC", "system")
    optuna.load_study(study_name="tps", storage=url).set_user_attr(
        "allocator", None
    )  # as before it was recorded
    open_study(load_config(tps), url)


def test_a_live_sweep_samples_the_ar_baseline_with_the_tuned_methods_seed(monkeypatch):
    """Under sampling, each prompt's AR baseline ran with the default seed while the tuned method ran with
    ``seed + i``: the two sides of a prompt's speedup drew from different random streams (``run`` seeds every
    method of a prompt alike)."""
    import env.decoder
    import experiments.bench
    import experiments.methods
    from experiments.config import load_config
    from experiments.objective import LiveEvaluator

    calls = []

    def run_method(method, loaded, decoders, ids, max_new, *, sampling, seed=0):
        calls.append((method, seed, sampling.temperature))
        return [5, 6, 7], 0.5, 3, 1.5, []

    monkeypatch.setattr(experiments.bench, "run_method", run_method)
    monkeypatch.setattr(experiments.methods, "make_decoders", lambda cfg, loaded: {})
    monkeypatch.setattr(env.decoder, "chat_prompt", lambda tok, text: [1, 2])
    monkeypatch.setattr(LiveEvaluator, "_model", lambda self, cfg: SimpleNamespace(tokenizer=None))
    cfg = load_config(None, text='seed = 7\nmethods = ["ar", "ngram-d4"]\n[workload]\nlimit = 3\n'
                                 '[decode]\ntemperature = 0.8\n[sweep]\nbackend = "live"\n')  # fmt: skip
    out = LiveEvaluator()(cfg, {}, lambda *a: None)
    assert out["per_prompt"] == [1.0, 1.0, 1.0]
    ar = [s for m, s, _ in calls if m == "ar"]
    tuned = [s for m, s, _ in calls if m != "ar"]
    assert ar == tuned == [7, 8, 9] and {t for *_, t in calls} == {0.8}
    # with the baseline kept from trial to trial, it runs once per prompt and seed, on the first trial only
    calls.clear()
    kept = replace(cfg, sweep=replace(cfg.sweep, ar_every_trial=False))
    ev = LiveEvaluator()
    for _ in range(2):
        ev(kept, {}, lambda *a: None)
    assert [s for m, s, _ in calls if m == "ar"] == [7, 8, 9]
    assert [s for m, s, _ in calls if m != "ar"] == [7, 8, 9, 7, 8, 9]
