"""The train/held-out split of ``draftgym serve-train`` (``experiments.serve_train``), in replay on a saved synthetic
trace of two categories of four prompts (``--test-per-category 1``: one of each held out): every replayed server it
builds (the fitted policies', the bandits', the predictor's, PPO's) serves training prompts only, and between them all
of them; every policy file, ``train.json`` and ``settings.json`` record the split ``policies.split`` draws; the rules
that read no prompt say so; and a rerun with another split is refused in one line."""

from __future__ import annotations

import json

import pytest
from threadpoolctl import threadpool_limits

import env.serve_env
import policies.serving
from env.trace import load_trace
from experiments.cli import main
from policies.split import trace_split
from tests.env.conftest import make_trace

COST = "roofline:h200/llama-3.1-8b"
RULES = {"trt-auto", "smartspec", "turbospec"}  # decide from the cost model alone: fitted on no prompt


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    t = make_trace(seed=0, prompts=8, max_new=40)
    t.header["prompts"]["categories"] = ["a"] * 4 + ["b"] * 4
    return t.save(tmp_path_factory.mktemp("trace") / "serve.npz")


def _argv(trace_path, out, *extra):
    return ["serve-train", "--trace", str(trace_path), "--batch-cost", COST, "--timesteps", "0",
            "--test-per-category", "1", "--requests", "4", "--max-new-tokens", "20", "--predictor-episodes", "2",
            "--out", str(out), "--json", *extra]  # fmt: skip


@pytest.fixture
def served_prompts(monkeypatch):
    """The prompts of each replayed server (``env.serve_env.ServeSim``) built from now on."""
    seen = []

    class Recorded(env.serve_env.ServeSim):
        def __init__(self, *a, **k):
            seen.append(list(k["prompt_ids"]))
            super().__init__(*a, **k)

    monkeypatch.setattr(env.serve_env, "ServeSim", Recorded)
    return seen


def test_serve_train_replays_training_prompts_only_and_records_the_split(
    trace_path, tmp_path, served_prompts
):
    from policies.base import load_policy

    split = trace_split(load_trace(trace_path), 1, 0)
    assert len(split.train) == 6 and len(split.test) == 2  # one of each category held out
    out = tmp_path / "st"
    with threadpool_limits(1):
        assert main(_argv(trace_path, out)) == 0
    assert len(served_prompts) > 3
    assert all(set(p) <= set(split.train) for p in served_prompts)
    assert set().union(*served_prompts) == set(split.train)

    report = json.loads((out / "train.json").read_text())
    assert (report["train_prompts"], report["test_prompts"]) == (6, 2)
    assert json.loads((out / "settings.json").read_text())["split"] == split.as_dict()
    saved = {p.stem: load_policy(p).meta for p in out.glob("*.zip")}
    assert set(saved) == set(report["saved"]) and "predictor" in saved
    for name, meta in saved.items():
        assert meta["split"] == split.as_dict(), name
        assert meta.get("fitted_on_prompts", True) is (name not in RULES), name


def test_ppo_replays_training_prompts_only(trace_path, tmp_path, served_prompts, monkeypatch):
    """Every server but the predictor's (which fits on parts of them) serves all the training prompts; PPO's
    vectorized replay too: built, then a kill (its training is the resume test's)."""
    split = trace_split(load_trace(trace_path), 1, 0)

    def built_then_killed(make_env, *a, **k):
        make_env()
        raise KeyboardInterrupt

    out = tmp_path / "st"
    monkeypatch.setattr(policies.serving, "train_serve_ppo", built_then_killed)
    argv = _argv(trace_path, out, "--predictor-episodes", "0")
    argv[argv.index("--timesteps") + 1] = "64"
    with threadpool_limits(1):
        assert main(argv) == 130
    assert len(served_prompts) > 3  # the fitted policies', the bandits', and last PPO's
    assert all(sorted(p) == sorted(split.train) for p in served_prompts)


@pytest.mark.parametrize("extra", [["--test-per-category", "2"], ["--seed", "3"]])
def test_a_rerun_with_another_split_is_refused_in_one_line(trace_path, tmp_path, capsys, extra):
    out = tmp_path / "st"
    with threadpool_limits(1):
        assert main(_argv(trace_path, out, "--predictor-episodes", "0")) == 0
        files = _written(out)
        capsys.readouterr()
        assert main([*_argv(trace_path, out, "--predictor-episodes", "0"), *extra]) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and "other settings" in err[0] and "split" in err[0], err
    assert _written(out) == files


def _written(out):
    """What serve-train wrote: the policy files, train.json and settings.json."""
    return {p.name: p.read_bytes() for p in [*out.glob("*.zip"), out / "train.json", out / "settings.json"]}


def test_a_predictor_trained_on_another_split_is_trained_again(trace_path, tmp_path, capsys):
    """A folder whose settings.json predates the split's entry (not compared): its predictor, of another split,
    is not kept."""
    from policies.base import load_policy

    out = tmp_path / "st"
    with threadpool_limits(1):
        assert main(_argv(trace_path, out)) == 0
        settings = json.loads((out / "settings.json").read_text())
        del settings["split"]
        (out / "settings.json").write_text(json.dumps(settings))
        argv = _argv(trace_path, out)
        argv[argv.index("--test-per-category") + 1] = "2"
        assert main(argv) == 0
    split = trace_split(load_trace(trace_path), 2, 0)
    assert load_policy(out / "predictor.zip").meta["split"] == split.as_dict()
