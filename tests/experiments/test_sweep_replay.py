"""The sweep's replay backend: tree shapes and policy hyper-parameters scored on a recorded trace (here the
synthetic trace of the policies tests, whose n-gram drafter is right for long stretches), with no model."""

from __future__ import annotations

import json

import pytest

from experiments.cli import main


@pytest.fixture(scope="module")
def trace_files(tmp_path_factory):
    from tests.policies.synthetic import synthetic_cost_model, synthetic_trace

    folder = tmp_path_factory.mktemp("replay")
    trace = synthetic_trace(num_prompts=6, length=48).save(folder / "trace.npz")
    cost = synthetic_cost_model().save(folder / "cost.json")
    return str(trace), str(cost)


def _config(tmp_path, trace_files, body: str):
    trace, cost = trace_files
    path = tmp_path / "replay.toml"
    path.write_text(
        f'name = "replay"\n{body}\n[decode]\nmax_new_tokens = 48\n'
        f'[sweep]\nbackend = "replay"\nn_trials = 6\ntrace = "{trace}"\ncost_model = "{cost}"\nmax_topk = 1\n'
    )
    return path


def test_tree_sweep_on_replay(tmp_path, trace_files, capsys):
    cfg = _config(tmp_path, trace_files, 'methods = ["ar", "ngram-d2"]')
    assert main(["sweep", str(cfg), "--out", str(tmp_path / "out"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["states"].get("COMPLETE", 0) + result["states"].get("PRUNED", 0) == 6
    default = next(t for t in result["trials"] if t["default"])
    assert default["method"] == "ngram-d2" and len(default["intermediate"]) == 6  # one value per prompt
    assert result["best"]["value"] >= default["value"] > 0


def test_policy_sweep_on_replay(tmp_path, trace_files, capsys):
    body = (
        'methods = ["ar", "policy:ucb"]\n[policies.ucb]\nkind = "ucb1"\n'
        'arms = ["none", "ngram-d2", "ngram-d8"]\nparams = { c = 0.5, scale = 9.0 }'
    )
    cfg = _config(tmp_path, trace_files, body)
    assert (
        main(["sweep", str(cfg), "--out", str(tmp_path / "out"), "--json", "--set", "sweep.n_trials=3"]) == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert [t["params"] for t in result["trials"] if t["default"]] == [{"c": 0.5}]
    assert "c = " in (tmp_path / "out" / "best.toml").read_text()


def test_a_replay_sweep_scores_the_workloads_categories_only(tmp_path, trace_files, capsys):
    """``workload.categories`` (and ``per_category``) were ignored on the replay backend: every prompt was scored."""
    cfg = _config(tmp_path, trace_files, 'methods = ["ar", "ngram-d2"]\n[workload]\ncategories = ["copy"]\n')
    assert (
        main(["sweep", str(cfg), "--out", str(tmp_path / "out"), "--json", "--set", "sweep.n_trials=1"]) == 0
    )
    trial = json.loads(capsys.readouterr().out)["trials"][0]
    assert len(trial["intermediate"]) == 3  # the three "copy" prompts of six
    assert main(["sweep", str(cfg), "--out", str(tmp_path / "o2"), "--json", "--set", "sweep.n_trials=1",
                 "--set", "workload.per_category=2", "--set", "workload.categories=[]"]) == 0  # fmt: skip
    assert len(json.loads(capsys.readouterr().out)["trials"][0]["intermediate"]) == 4  # two of each
    rc = main(["sweep", str(cfg), "--out", str(tmp_path / "o3"), "--set", "workload.categories=['qa']"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "workload.categories ['qa']" in err and "copy" in err, err
    assert not (tmp_path / "o3").exists()
