"""What a sweep (and the report of one) refuses before it starts, in one line and exit code 2, losing no result: a
``--set`` of a key every trial sets, an analytic sweep of a policy, a simulated prompt time past an hour, storage of
another Optuna schema, a resumed replay study on another cost model, and a report ``--out`` that names a result
file. And what it repairs: a torn last line of ``trials.jsonl``; and what it hides: every password of a storage URL.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import optuna
import pytest

from experiments.cli import main
from experiments.config import ConfigError, load_config

TREE = """name = "g"
methods = ["ar", "ngram-d4"]
[workload]
limit = 2
[sweep]
n_trials = 2
backend = "analytic"
max_topk = 2
pruner = "none"
"""

POLICY = """name = "gp"
methods = ["ar", "policy:ucb"]
[policies.ucb]
kind = "ucb1"
arms = ["none", "ngram-d4"]
params = { c = 0.5 }
[workload]
limit = 2
[sweep]
n_trials = 2
backend = "{backend}"
pruner = "none"
"""


def _write(tmp_path: Path, text: str, name: str = "c.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _one_line_error(capsys, rc: int, *needles: str) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1, err
    assert "Traceback" not in err and all(n in lines[0] for n in needles), err
    return lines[0]


# ------------------------------------------------------------------------------------------------ --set of a swept key


@pytest.mark.parametrize(
    ("text", "item", "key"),
    [
        (TREE, 'methods=["ar", "ngram-d6"]', "methods"),
        (TREE, "sweep.method=ngram-d4", "sweep.method"),
        (
            TREE.replace("[sweep]\n", '[sweep]\nmethod = "ngram-d4"\n'),
            "sweep.method=ngram-d4",
            "sweep.method",
        ),
        (POLICY.replace("{backend}", "live"), "policies.ucb.params.c=1.0", "policies.ucb.params.c"),
        (POLICY.replace("{backend}", "live"), "policies.ucb.params={ c = 1.0 }", "policies.ucb.params.c"),
    ],
    ids=["methods", "sweep.method-unset", "sweep.method", "policy-param", "policy-params-table"],
)
def test_a_set_of_a_key_each_trial_sets_is_refused_before_the_study(tmp_path, capsys, text, item, key):
    """file < trial < --set: a --set of a swept key overrode every trial (all ran one method under differing
    params, or failed). It is refused before any folder or study is made."""
    out = tmp_path / "run"
    rc = main(["sweep", str(_write(tmp_path, text)), "--out", str(out), "--set", item])
    _one_line_error(capsys, rc, f"--set {item}", f"sets {key}", "config file")
    assert not out.exists()


def test_a_set_of_another_key_still_applies_to_every_trial(tmp_path, capsys):
    from experiments.sweep_checks import check_sets

    cfg = load_config(None, text=POLICY.replace("{backend}", "live"))
    check_sets(cfg, ["policies.ucb.arms=['none', 'ngram-d8']", "sweep.n_trials=3", "methods=['policy:ucb']"])
    out = tmp_path / "run"
    assert main(["sweep", str(_write(tmp_path, TREE)), "--out", str(out), "--set", "sweep.max_topk=1"]) == 0
    logged = [json.loads(ln) for ln in (out / "trials.jsonl").read_text().splitlines()]
    assert all(r["params"].get("ngram.topk", 1) == 1 for r in logged) and len(logged) == 2


# ------------------------------------------------------------------------------------------------ analytic policy


def test_an_analytic_sweep_of_a_policy_is_refused_before_any_trial(tmp_path, capsys):
    """It was refused by trial 0 only, which failed (and one more failed trial on every rerun)."""
    out = tmp_path / "run"
    text = POLICY.replace("{backend}", "analytic")
    rc = main(["sweep", str(_write(tmp_path, text)), "--out", str(out), "--json"])
    assert not out.exists()  # no study, no failed trial
    _one_line_error(capsys, rc, "sweep.backend = 'analytic'", "policy:ucb")


def test_an_analytic_sweep_of_tokens_per_s_is_refused_before_any_trial(tmp_path, capsys):
    """The closed form has no seconds: it scored the speedup and labelled it tokens/s."""
    out = tmp_path / "run"
    text = TREE.replace("[sweep]\n", '[sweep]\nobjective = "tokens_per_s"\n')
    rc = main(["sweep", str(_write(tmp_path, text)), "--out", str(out), "--json"])
    assert not out.exists()
    _one_line_error(capsys, rc, "sweep.objective = 'tokens_per_s' needs seconds")


# ------------------------------------------------------------------------------------------------ analytic_prompt_s


def test_a_simulated_prompt_time_past_an_hour_is_refused(tmp_path, capsys):
    """1e300 s reached time.sleep, which raised OverflowError in trial 0."""
    with pytest.raises(ConfigError, match=r"sweep.analytic_prompt_s must be <= 3600"):
        load_config(None, text=TREE.replace("[sweep]\n", "[sweep]\nanalytic_prompt_s = 1e300\n"))
    out = tmp_path / "run"
    rc = main(
        ["sweep", str(_write(tmp_path, TREE)), "--out", str(out), "--set", "sweep.analytic_prompt_s=1e300"]
    )
    _one_line_error(capsys, rc, "sweep.analytic_prompt_s")
    assert not out.exists()


# ------------------------------------------------------------------------------------------------ storage


def test_storage_of_another_optuna_schema_is_one_line(tmp_path, capsys):
    """Optuna's schema check raised a RuntimeError: a traceback."""
    db = tmp_path / "run" / "study.db"
    db.parent.mkdir()
    optuna.create_study(storage=f"sqlite:///{db}", study_name="other")
    with sqlite3.connect(db) as con:
        con.execute("update alembic_version set version_num = 'v0.0.0.old'")
    before = db.read_bytes()
    rc = main(["sweep", str(_write(tmp_path, TREE)), "--out", str(db.parent)])
    _one_line_error(capsys, rc, f"cannot open storage sqlite:///{db}", "optuna storage upgrade")
    assert db.read_bytes() == before and sorted(p.name for p in db.parent.iterdir()) == ["study.db"]


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://u:secret@db.example:5432/s", "postgresql://u:***@db.example:5432/s"),
        ("postgresql://u@db.example/s?password=secret", "postgresql://u@db.example/s?password=***"),
        ("postgresql://u:secret@h/s?sslcert=/certs/a@b.pem", "postgresql://u:***@h/s?sslcert="),
        ("mysql+pymysql://u@h/s?PWD=secret&charset=utf8", "mysql+pymysql://u@h/s?PWD=***&charset=utf8"),
        ("sqlite:////tmp/a@b/study.db", "sqlite:////tmp/a@b/study.db"),
        ("nosuchdb://x/y", "nosuchdb://x/y"),
        ("not a url u:secret@h", "***"),
    ],
)
def test_mask_hides_every_password_of_a_storage_url(url, shown):
    """A ?password= stayed visible, and an '@' in the query cut the URL at the wrong place."""
    from experiments.sweep import mask

    masked = mask(url)
    assert "secret" not in masked and masked.startswith(shown), masked
    if "sslcert" in url:
        assert "h/s?" in masked  # the host and database survive an '@' in the query


# ------------------------------------------------------------------------------------------------ cost model digest


@pytest.fixture()
def replay_files(tmp_path):
    from tests.policies.synthetic import synthetic_cost_model, synthetic_trace

    trace = synthetic_trace(num_prompts=3, length=24).save(tmp_path / "trace.npz")
    cost = synthetic_cost_model().save(tmp_path / "cost.json")
    return Path(trace), Path(cost)


def test_a_resumed_replay_study_refuses_another_cost_model(tmp_path, replay_files):
    """The study recorded the trace's digest, not the cost model's: a calibrated file rewritten under the same path
    put trials of two cost models in one study."""
    from experiments.sweep import open_study

    trace, cost = replay_files
    path = _write(tmp_path, TREE.replace('backend = "analytic"', f'backend = "replay"\ntrace = "{trace}"\n'
                                         f'cost_model = "{cost}"'))  # fmt: skip
    url = f"sqlite:///{tmp_path / 's.db'}"
    study = open_study(load_config(path), url)
    open_study(load_config(path), url)  # the same files: resumes
    data = json.loads(cost.read_text())
    cost.write_text(json.dumps({**data, "context_ref": 256}))
    with pytest.raises(ConfigError, match="cost_model_sha256 changed since"):
        open_study(load_config(path), url)
    # a study from before the cost model was recorded compares what it recorded, and resumes
    inputs = dict(study.user_attrs["inputs"])
    del inputs["cost_model_sha256"]
    optuna.load_study(study_name="g", storage=url).set_user_attr("inputs", inputs)
    open_study(load_config(path), url)


def test_a_replay_study_on_the_shipped_cost_model_records_its_digest(tmp_path):
    from env.cost import default_cost_model_path
    from env.files import file_digest
    from experiments.sweep_checks import input_digests

    cfg = load_config(None, text=TREE.replace('backend = "analytic"', 'backend = "replay"'))
    assert input_digests(cfg)["cost_model_sha256"] == file_digest(default_cost_model_path())
    assert input_digests(load_config(None, text=TREE))["cost_model_sha256"] is None  # not read: not compared


# ------------------------------------------------------------------------------------------------ trials.jsonl


def test_a_torn_last_line_of_the_trial_log_is_cut_before_appending(tmp_path):
    """A worker killed mid-write left a torn line, and the next worker's line was appended to it: two lines lost."""
    from experiments.sweep import work

    out = tmp_path / "run"
    out.mkdir()
    good = json.dumps(
        {"number": 7, "state": "COMPLETE", "value": 1.0, "params": {}, "method": "x", "worker": "w"}
    )
    (out / "trials.jsonl").write_text(good + '\n{"number": 99, "sta')
    work(str(_write(tmp_path, TREE)), [], f"sqlite:///{tmp_path / 's.db'}", out, progress=False)
    lines = (out / "trials.jsonl").read_text().splitlines()
    rows = [json.loads(ln) for ln in lines]  # every line whole
    assert lines[0] == good and [r["number"] for r in rows[1:]] == [0, 1]


# ------------------------------------------------------------------------------------------------ report --out


@pytest.fixture()
def sweep_dir(tmp_path):
    out = tmp_path / "sw"
    assert main(["sweep", str(_write(tmp_path, TREE)), "--out", str(out), "--json"]) == 0
    return out


@pytest.mark.parametrize(
    "name",
    ["trials.jsonl", "sweep.json", "study.db", "config.toml", "best.toml", "sweep.md", "provenance.jsonl"],
)
def test_report_refuses_an_out_that_is_a_result_file(sweep_dir, capsys, name):
    """``report RUN --out RUN/records.jsonl`` replaced the run's records by the report."""
    capsys.readouterr()
    target = sweep_dir / name
    before = target.read_bytes()
    rc = main(["report", str(sweep_dir), "--out", str(target)])
    _one_line_error(capsys, rc, str(target), "not overwritten")
    assert target.read_bytes() == before


def test_report_refuses_an_out_that_is_a_run_s_records(tmp_path, capsys):
    from tests.experiments.test_report import _fake_run

    run = _fake_run(tmp_path, "r", 20.0)
    for name in ("records.jsonl", "summary.json", "summary.md"):
        before = (run / name).read_bytes()
        rc = main(["report", str(run), "--out", str(run / name)])
        _one_line_error(capsys, rc, str(run / name))
        assert (run / name).read_bytes() == before
    (run / "summary.json").unlink()  # a killed run: refused before the report would make it (nothing written)
    rc = main(["report", str(run), "--out", str(run / "summary.json")])
    _one_line_error(capsys, rc, str(run / "summary.json"))
    assert not (run / "summary.json").exists()
    (run / "notes.md").write_text("my notes\n")
    _one_line_error(capsys, main(["report", str(run), "--out", str(run / "notes.md")]), "not overwritten")
    # an earlier report (the default out, or one named by --out) is written over
    for _ in range(2):
        assert main(["report", str(run)]) == 0
        assert main(["report", str(run), "--out", str(tmp_path / "r.md")]) == 0
    assert (run / "report.md").read_text().startswith("# draftgym report")


# ------------------------------------------------------------------------------------------------ tuned method


def test_only_a_plain_arm_or_a_policy_is_tuned(tmp_path, capsys):
    """Every method was parsed as an arm: ``device:lookup-d4`` or ``ngram-d4@int8``, valid for ``run``, made a
    sweep fail with "unknown drafter 'device:lookup'"."""
    from experiments.space import tuned_method

    for extra in ("device:lookup-d4", "ngram-d6@int8", "hf_greedy"):
        text = TREE.replace('"ngram-d4"]', f'"ngram-d4", "{extra}"]')
        assert tuned_method(load_config(None, text=text)) == "ngram-d4"
    text = TREE.replace('"ngram-d4"]', '"ngram-d4", "device:lookup-d4"]')
    assert main(["sweep", str(_write(tmp_path, text)), "--out", str(tmp_path / "run"), "--json"]) == 0
    capsys.readouterr()
    text = TREE.replace('"ngram-d4"]', '"ngram-d4@int8"]').replace(
        "[sweep]\n", '[sweep]\nmethod = "ngram-d4@int8"\n'
    )
    rc = main(["sweep", str(_write(tmp_path, text, "w.toml")), "--out", str(tmp_path / "run2")])
    _one_line_error(capsys, rc, "sweep.method 'ngram-d4@int8' is not a method a sweep tunes")


def test_another_commands_folder_is_refused_before_the_study_is_made_in_it(tmp_path, capsys):
    """The refusal came after the study's SQLite file was made: a 112 KB ``study.db`` stayed in a bench folder,
    or in a run's folder while the run wrote it."""
    folder = tmp_path / "bench"
    folder.mkdir()
    settings = json.dumps({"command": "bench", "model": "m", "new_tokens": 8})
    (folder / "settings.json").write_text(settings)
    rc = main(["sweep", str(_write(tmp_path, TREE)), "--out", str(folder)])
    _one_line_error(capsys, rc, "is draftgym bench's folder; draftgym sweep writes one of its own")
    assert sorted(p.name for p in folder.iterdir()) == ["settings.json"]


@pytest.mark.parametrize(
    ("backend", "objective", "compared"),
    [
        ("live", "tokens_per_s", True),
        ("live", "speedup", False),
        ("live", "tau", False),
        ("analytic", "tau", False),
        ("replay", "tokens_per_s", False),  # decided by the backend alone
        ("analytic", "tokens_per_s", False),
    ],
)
def test_only_live_tokens_per_second_ties_a_study_to_its_machine(backend, objective, compared):
    """speedup is each worker's ratio to its own AR loop, tau and the other backends are deterministic: a worker
    on another machine joins their studies."""
    from experiments.sweep_checks import timing_machine

    cfg = load_config(
        None,
        text=f'methods = ["ar", "ngram-d4"]\n[sweep]\nbackend = "{backend}"\nobjective = "{objective}"\n',
    )
    assert (timing_machine(cfg) is not None) is compared
