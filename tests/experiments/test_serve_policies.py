"""``draftgym serve-train`` and ``draftgym evaluate --serve`` end to end in replay (no model: ``--no-live``) on a
saved synthetic trace of two categories, priced by the H200 roofline model: the policy files, the documented JSON
rows, and one-line errors for bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from experiments.cli import main
from tests.env.conftest import make_trace

COST = "roofline:h200/llama-3.1-8b"
SAVED = {"bucket-ucb", "fitted-table", "linucb", "predictor", "smartspec", "trt-auto", "turbospec"}
KINDS = {"static", "schedule", "heuristic", "bandit", "predictor", "oracle"}


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    t = make_trace(seed=0, prompts=8, max_new=40)
    t.header["prompts"]["categories"] = ["a"] * 4 + ["b"] * 4  # the split holds out one of each
    return t.save(tmp_path_factory.mktemp("trace") / "serve.npz")


def _train_argv(trace_path, out, *extra):
    return ["serve-train", "--trace", str(trace_path), "--batch-cost", COST, "--timesteps", "0",
            "--test-per-category", "1", "--requests", "4", "--max-new-tokens", "20", "--out", str(out), *extra]  # fmt: skip


@pytest.fixture(scope="module")
def trained(trace_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("serve-train")
    with threadpool_limits(1):  # LinUCB solves small systems each step: BLAS threads only contend on 2 cores
        assert main(_train_argv(trace_path, out)) == 0
    return out


def test_serve_train_writes_the_policy_files(trained, trace_path):
    from env.serve_env import feature_names
    from policies.base import load_policy

    assert {p.stem for p in trained.glob("*.zip")} == SAVED  # --timesteps 0: no PPO
    report = json.loads((trained / "train.json").read_text())
    assert set(report["saved"]) == SAVED and report["batch_cost"].startswith("roofline:h200/llama-3.1-8b")
    assert report["train_prompts"] == 6 and report["test_prompts"] == 2
    assert set(report["static_train_goodput"]) == {"1", "2", "4", "8", "16"}
    kinds = {}
    for path in trained.glob("*.zip"):
        p = load_policy(path)
        kinds[path.stem] = p.kind
        assert p.features == tuple(feature_names(16))
        assert p.meta["split"]["test_per_category"] == 1 and len(p.meta["split"]["test"]) == 2
        assert p.meta["name"] == path.stem and p.meta["max_new_tokens"] == 20
    assert kinds == {"bucket-ucb": "bandit", "fitted-table": "schedule", "linucb": "bandit", "predictor": "predictor",
                     "smartspec": "heuristic", "trt-auto": "schedule", "turbospec": "heuristic"}  # fmt: skip
    assert (
        report["predictor"]["episodes"] == 16
        and load_policy(trained / "predictor.zip").shrink == (report["predictor"]["shrink"])
    )
    bandit = load_policy(trained / "bucket-ucb.zip")
    assert bandit.counts.sum() > 0  # trained in replay


def _eval_argv(trained, trace_path, tmp_path, loads="1,4,mixed", *extra):
    return ["evaluate", "--serve", *sorted(str(p) for p in trained.glob("*.zip")), "--trace", str(trace_path),
            "--batch-cost", COST, "--no-live", "--episodes", "2", "--requests", "4", "--loads", loads,
            "--out", str(tmp_path / "eval"), *extra]  # fmt: skip


def test_evaluate_serve_writes_the_documented_rows(trained, trace_path, tmp_path, capsys):
    from env.serve_env import DEFAULT_ARMS, obs_size
    from policies.base import load_policy

    f = tmp_path / "serve.json"
    with threadpool_limits(1):
        assert main(_eval_argv(trained, trace_path, tmp_path, "1,4,mixed", "--json", str(f))) == 0
    printed = capsys.readouterr().out
    assert "roofline:h200/llama-3.1-8b (simulated)" in printed and "oracle" in printed
    data = json.loads(f.read_text())
    assert data == json.loads((tmp_path / "eval" / "evaluate.json").read_text())
    rows = data["rows"]
    names = [f"static:{a}" for a in DEFAULT_ARMS] + sorted(SAVED) + ["oracle"]
    assert len(rows) == 3 * len(names)
    for r in rows:
        assert set(r) == {
            "policy",
            "kind",
            "load",
            "replay_goodput",
            "live_goodput",
            "live_runs",
            "live_passes",
            "replay_goodput_live_stream",
            "act_s",
        }
        # a policy that observes is charged its act, timed; a static arm (served as an engine) and the oracle not
        assert (r["act_s"] is None) == (r["kind"] in ("static", "oracle"))
        assert r["act_s"] is None or 0 < r["act_s"] < 0.1
        assert (
            r["kind"] in KINDS
            and r["live_goodput"] is None
            and r["live_runs"] is None
            and r["live_passes"] is None
        )  # --no-live
        assert np.isfinite(r["replay_goodput"]) and r["replay_goodput"] > 0
    assert {r["load"] for r in rows} == {"1", "4", "mixed"}
    for load in ("1", "4", "mixed"):
        assert sorted(r["policy"] for r in rows if r["load"] == load) == sorted(names)
    cell = {(r["policy"], r["load"]): r for r in rows}
    assert all(r["kind"] == "static" for (p, _), r in cell.items() if p.startswith("static:"))
    assert cell[("oracle", "1")]["kind"] == "oracle" and cell[("smartspec", "4")]["kind"] == "heuristic"
    # the same request streams for everyone: at concurrency 1 a batch table is the static arm it picks at one row
    table = load_policy(trained / "fitted-table.zip")
    one_row = np.zeros(obs_size(16), np.float32)
    one_row[0] = 1 / 16
    arm = table.arm_names[table.act(one_row)]
    # ... less what serving a policy live adds to each step, which replay charges it (and not a static arm)
    assert cell[("fitted-table", "1")]["replay_goodput"] < cell[(f"static:{arm}", "1")]["replay_goodput"]
    assert "replay charges each policy that observes its live overhead" in printed
    assert data["policy_priced"] == {"on": True, "book": False}  # a roofline model has no bookkeeping figure
    with threadpool_limits(1):  # unpriced: the very same goodput
        assert main(_eval_argv(trained, trace_path, tmp_path, "1", "--no-policy-cost", "--json", str(f))) == 0
    unpriced = {(r["policy"], r["load"]): r for r in json.loads(f.read_text())["rows"]}
    assert unpriced[("fitted-table", "1")]["replay_goodput"] == cell[(f"static:{arm}", "1")]["replay_goodput"]
    assert unpriced[("fitted-table", "1")]["act_s"] is None
    assert "replay charges the policies nothing" in capsys.readouterr().out
    s = data["settings"]
    assert s["simulated"] is True and s["live"] is False and s["loads"] == ["1", "4", "mixed"]
    assert (
        s["episodes"] == 2
        and s["requests"] == 4
        and s["max_new_tokens"] == 20
        and len(s["test_prompts"]) == 2
    )
    assert data["best_static_overall"] in DEFAULT_ARMS and set(data["best_static_per_load"]) == {
        "1",
        "4",
        "mixed",
    }
    assert data["trained_on_evaluated"] == {} and "not held out" not in printed
    assert data["built_under_other_cost"] == {} and "built under" not in printed


def test_evaluate_serve_says_when_a_policy_was_trained_on_the_evaluated_prompts(
    trained, trace_path, tmp_path, capsys
):
    """Another split than the policies' own (here every prompt): each policy fitted on prompts is flagged, in the
    table and the JSON; the rules that read none (trt-auto, smartspec, turbospec) are not."""
    with threadpool_limits(1):
        argv = _eval_argv(trained, trace_path, tmp_path, "1", "--test-per-category", "4")
        assert main(argv) == 0
    printed = capsys.readouterr().out
    data = json.loads((tmp_path / "eval" / "evaluate.json").read_text())
    seen, n_test = data["trained_on_evaluated"], len(data["settings"]["test_prompts"])
    assert (
        set(seen) == SAVED - {"trt-auto", "smartspec", "turbospec"}
        and len(set(seen.values())) == 1
        and 0 < seen["linucb"] <= n_test
    )
    assert (
        f"note: linucb was trained on {seen['linucb']} of the {n_test} prompts evaluated here (not held out)!"
        in printed
    )


@pytest.mark.parametrize(
    "loads, needle", [("1,heavy", "--loads: unknown load 'heavy'"), ("ramp", "unknown load")]
)
def test_a_bad_load_is_one_line_and_exit_2(trained, trace_path, tmp_path, capsys, loads, needle):
    assert main(_eval_argv(trained, trace_path, tmp_path, loads)) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("loads", ["99", "poisson@x"])
def test_a_load_the_env_refuses_is_one_line_and_exit_2(trained, trace_path, tmp_path, capsys, loads):
    assert main(_eval_argv(trained, trace_path, tmp_path, loads)) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1


def test_a_missing_trace_or_bad_cost_model_is_one_line(trained, trace_path, tmp_path, capsys):
    argv = _train_argv(tmp_path / "nope.npz", tmp_path / "o")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "nope.npz" in err and len(err.strip().splitlines()) == 1
    argv = _train_argv(trace_path, tmp_path / "o")
    argv[argv.index(COST)] = "roofline:tpu/llama-3.1-8b"
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "unknown accelerator 'tpu'" in err and len(err.strip().splitlines()) == 1


def test_serve_train_with_a_smaller_batch(trace_path, tmp_path):
    """The bandit per batch size keeps one bucket per load level of the max batch (it had 1..16 whatever the max
    batch: at 64 rows, rows 9 to 64 shared one bandit)."""
    from policies.base import load_policy

    with threadpool_limits(1):
        assert main(_train_argv(trace_path, tmp_path / "small", "--max-batch", "4")) == 0
    assert load_policy(tmp_path / "small" / "bucket-ucb.zip").buckets.tolist() == [1, 2, 4]


def test_evaluate_serve_says_when_a_policy_was_built_under_another_cost_model(
    trained, trace_path, tmp_path, capsys
):
    """Policies trained, fitted or deciding (SmartSpec: its own cost curve) under the H200 roofline, evaluated under
    the H100's: each is flagged in the table and the JSON (the same cost model flags none: the rows test)."""
    with threadpool_limits(1):
        argv = _eval_argv(trained, trace_path, tmp_path, "1")
        argv[argv.index(COST)] = "roofline:h100-sxm/llama-3.1-8b"
        assert main(argv) == 0
    printed = capsys.readouterr().out
    data = json.loads((tmp_path / "eval" / "evaluate.json").read_text())
    other = data["built_under_other_cost"]
    assert set(other) == SAVED and set(other.values()) == {"roofline:h200/llama-3.1-8b (simulated)"}
    assert (
        "note: smartspec was built under the cost model roofline:h200/llama-3.1-8b (simulated), evaluated under "
        "roofline:h100-sxm/llama-3.1-8b (simulated)" in printed
    )


def test_serve_train_killed_in_ppo_resumes_with_ppo_only(trace_path, tmp_path, monkeypatch, capsys):
    """The fitted policies are saved before PPO starts; killed during PPO, a rerun trains PPO and keeps the rest;
    killed during the per-row PPO, a rerun trains that one only; a finished run is not trained again; a rerun with
    other settings is refused in one line. The predictor, trained before PPO, is trained once."""
    import policies.serve_predictor as serve_predictor
    import policies.serving as serving
    from policies.base import load_policy
    from policies.rl_rows import SB3RowPolicy

    out, calls = tmp_path / "st", []
    real = serving.train_serve_ppo

    def killed(*a, **k):
        raise KeyboardInterrupt

    def counted(*a, **k):
        calls.append((k["timesteps"], k.get("rows", False)))
        return real(*a, **k)

    def rows_killed(*a, **k):
        if k.get("rows"):
            raise KeyboardInterrupt
        return counted(*a, **k)

    def stems():
        return {p.stem for p in out.glob("*.zip")}

    fits, fit = [], serve_predictor.train_serve_predictor
    monkeypatch.setattr(
        serve_predictor, "train_serve_predictor", lambda *a, **k: fits.append(1) or fit(*a, **k)
    )

    argv = [x if x != "0" else "2048" for x in _train_argv(trace_path, out)]  # --timesteps 2048
    with threadpool_limits(1):
        monkeypatch.setattr(serving, "train_serve_ppo", killed)
        assert main(argv) == 130  # interrupted
        assert stems() == SAVED  # the fitted ones, before PPO
        monkeypatch.setattr(serving, "train_serve_ppo", rows_killed)
        assert main(argv) == 130 and calls == [(2048, False)]  # PPO trained, the per-row one interrupted
        assert stems() == SAVED | {"ppo"}
        monkeypatch.setattr(serving, "train_serve_ppo", counted)
        assert main(argv) == 0 and calls == [(2048, False), (2048, True)]  # PPO kept, the per-row one trained
        assert stems() == SAVED | {"ppo", "ppo-rows"}
        assert isinstance(load_policy(out / "ppo-rows.zip"), SB3RowPolicy)
        report = json.loads((out / "train.json").read_text())
        assert set(report["saved"]) == SAVED | {"ppo", "ppo-rows"}
        assert report["ppo_timesteps"] == report["ppo_rows_timesteps"] == 2048
        assert main(argv) == 0 and len(calls) == 2  # finished: neither trained again
        assert json.loads((out / "train.json").read_text())["ppo_rows_timesteps"] == 2048
        (
            out / "train.json"
        ).unlink()  # a kill between a policy file and train.json: the policy file alone decides
        assert main(argv) == 0 and len(calls) == 2 and len(fits) == 1
        again = json.loads((out / "train.json").read_text())
        assert again["ppo_timesteps"] == again["ppo_rows_timesteps"] == 2048
        assert main([*argv, "--predictor-episodes", "0"]) == 0  # none asked for: the earlier one goes
        assert stems() == SAVED - {"predictor"} | {"ppo", "ppo-rows"} and len(fits) == 1
        assert "predictor" not in json.loads((out / "train.json").read_text())
        capsys.readouterr()
        other = list(argv)
        other[other.index("--requests") + 1] = "5"
        assert main(other) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and "requests" in err[0], err


def test_the_act_timings_are_kept_per_policy_file_and_cpu_and_a_damaged_entry_is_timed_again(
    trained, trace_path, tmp_path
):
    f = tmp_path / "serve.json"
    argv = _eval_argv(trained, trace_path, tmp_path, "1", "--json", str(f))
    with threadpool_limits(1):
        assert main(argv) == 0
    cache = tmp_path / "eval" / "policy_act.json"
    kept = json.loads(cache.read_text())
    assert set(kept) == SAVED and all(" @ " in e["key"] and 0 < e["act_s"] < 0.1 for e in kept.values())
    first = {r["policy"]: r["act_s"] for r in json.loads(f.read_text())["rows"]}
    kept["smartspec"]["act_s"] = 5.0  # another file's timing: refused by its key
    kept["smartspec"]["key"] = "another file @ another CPU"
    kept["linucb"]["act_s"] = True  # not a number of seconds
    kept["trt-auto"]["act_s"] = 1.0  # as written: a rerun replays with it
    cache.write_text(json.dumps(kept))
    with threadpool_limits(1):
        assert main(argv) == 0
    again = {r["policy"]: r["act_s"] for r in json.loads(f.read_text())["rows"]}
    assert again["trt-auto"] == 1.0 and again["fitted-table"] == first["fitted-table"]  # kept
    assert again["smartspec"] < 0.1 and again["linucb"] < 0.1  # timed again


def test_serve_train_on_a_menu_without_plain_decoding_makes_no_turbospec(trace_path, tmp_path):
    """TurboSpec prices arms against a plain step: on a menu without ``none`` it is left out, the rest is made."""
    with threadpool_limits(1):
        assert main(_train_argv(trace_path, tmp_path / "nd", "--arms", "ngram-d2,ngram-d5")) == 0
    stems = {p.stem for p in (tmp_path / "nd").glob("*.zip")}
    assert "smartspec" in stems and "turbospec" not in stems and "fitted-table" in stems


@pytest.mark.parametrize("command", ["evaluate", "serve-bench"])
def test_a_per_sequence_policy_is_not_served_a_batch(tmp_path, capsys, command):
    """A policy of ``draftgym train`` (one sequence's observation) given where a serving policy is read: evaluate
    --serve served it for minutes, reading nothing of the batch; serve-bench refused it. Both: one line, no folder."""
    from importlib import resources

    path = str(resources.files("policies") / "data" / "exp3.zip")
    out = tmp_path / "o"
    if command == "evaluate":
        argv = ["evaluate", "--serve", path, "--loads", "1", "--out", str(out)]
    else:
        argv = ["serve-bench", "--policy", path, "--concurrency", "1", "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"draftgym {command}: error: {path} is not a serving policy (draftgym "
                                        "serve-train makes them): it observes 23 values, where a serving policy "
                                        "for a max batch of 16 observes 105"]  # fmt: skip
    assert not out.exists()


@pytest.mark.parametrize("command", ["evaluate", "serve-bench"])
def test_a_serving_policy_whose_max_batch_is_out_of_range_is_named(trained, tmp_path, capsys, command):
    """Its meta's max batch of 5000 was refused by evaluate without naming the file, and served by serve-bench."""
    from policies.base import load_policy

    pol = load_policy(trained / "linucb.zip")
    pol.meta = {**pol.meta, "max_batch": 5000}
    pol.save(tmp_path / "p.zip")
    out = tmp_path / "o"
    if command == "evaluate":
        argv = ["evaluate", "--serve", str(tmp_path / "p.zip"), "--loads", "1", "--out", str(out)]
    else:
        argv = ["serve-bench", "--policy", str(tmp_path / "p.zip"), "--concurrency", "1", "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and "p.zip: its meta.max_batch must be an integer in [1, 4096], got 5000" in err
    ), err
    assert not out.exists()


def test_serve_train_refuses_a_folder_of_policies_it_did_not_write(trace_path, trained, tmp_path, capsys):
    """A folder of .zip policies and no settings.json was taken as an earlier serve-train run: the files it makes
    were replaced and the others deleted."""
    import shutil

    out = tmp_path / "mine"
    out.mkdir()
    shutil.copy(trained / "linucb.zip", out / "linucb.zip")
    before = (out / "linucb.zip").read_bytes()
    assert main(_train_argv(trace_path, out)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a serve-train folder" in err, err
    assert (out / "linucb.zip").read_bytes() == before and sorted(p.name for p in out.iterdir()) == [
        "linucb.zip"
    ]


def test_evaluate_serve_refuses_a_serve_train_folder(trained, tmp_path, capsys):
    """``evaluate --serve --out`` a serve-train folder replaced its settings.json, and serve-train no longer resumed
    there."""
    settings = (trained / "settings.json").read_bytes()
    assert main(["evaluate", "--serve", "--no-live", "--batch-cost", COST, "--out", str(trained),
                 str(trained / "linucb.zip")]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is draftgym serve-train's folder" in err, err
    assert (trained / "settings.json").read_bytes() == settings


def test_serve_train_refuses_a_max_batch_whose_linucb_would_not_fit_before_any_work(
    trace_path, tmp_path, capsys
):
    """--max-batch 4096 ran 30 s and grew to 5 GB before LinUCB asked numpy for 27 GiB."""
    assert main(_train_argv(trace_path, tmp_path / "big", "--max-batch", "4096")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "LinUCB" in err and "at most --max-batch" in err, err
    assert not (tmp_path / "big").exists()


@pytest.mark.parametrize(
    "extra, says",
    [(["--arms", "none,ngram-d3-k2-b4"], "is a tree"), (["--max-new-tokens", "1000"], "must be in 2..40")],
)
def test_serve_train_refuses_a_tree_arm_or_too_many_new_tokens_before_its_folder(
    trace_path, tmp_path, capsys, extra, says
):
    """Both were refused once settings.json was written: a folder holding only that file was left."""
    assert main([*_train_argv(trace_path, tmp_path / "o"), *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err
    assert not (tmp_path / "o").exists()
