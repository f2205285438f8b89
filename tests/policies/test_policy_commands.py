"""``draftgym train`` and ``draftgym evaluate --no-live`` on the synthetic trace, through the command line."""

from __future__ import annotations

import json

import pytest

from experiments.cli import main

ARMS = '["none", "ngram-d2", "ngram-d4", "ngram-d8", "ngram-d16"]'


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from tests.policies.synthetic import synthetic_cost_model, synthetic_trace

    d = tmp_path_factory.mktemp("cmd")
    synthetic_trace().save(d / "trace.npz")
    synthetic_cost_model().save(d / "cost.json")
    train = f'trace = "{d / "trace.npz"}", cost_model = "{d / "cost.json"}", test_per_category = 4'
    cfg = f"""
name = "synth"
[policies.static]
kind = "static"
arms = {ARMS}
train = {{ {train} }}
[policies.ucb]
kind = "ucb1"
arms = {ARMS}
params = {{ scale = 4.0 }}
train = {{ {train}, total_timesteps = 500 }}
[policies.pred]
kind = "predictor"
arms = {ARMS}
params = {{ model = "ridge" }}
train = {{ {train} }}
[policies.ppo]
kind = "sb3"
arms = {ARMS}
params = {{ algo = "ppo", n_steps = 32 }}
train = {{ {train}, total_timesteps = 1024, n_envs = 8, eval_freq = 512, checkpoint_freq = 512, draft_features = true }}
"""
    (d / "cfg.toml").write_text(cfg)
    return d


def test_train_then_evaluate(files, capsys):
    assert main(["train", str(files / "cfg.toml"), "--out", str(files / "run"), "--json"]) == 0
    trained = json.loads(capsys.readouterr().out)["policies"]
    assert [p["policy"] for p in trained] == ["static", "ucb", "pred", "ppo"]
    paths = [files / "run" / "policies" / f"{p['policy']}.zip" for p in trained]
    assert all(p.is_file() for p in paths)
    assert (files / "run" / "train" / "ppo" / "tb").is_dir()
    out = files / "eval.json"
    assert main(["evaluate", *map(str, paths), "--no-live", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "oracle:per-step-greedy" in table and "static:" in table
    rows = json.loads(out.read_text())["rows"]
    kinds = {r["policy"]: r["kind"] for r in rows}
    assert kinds["ucb"] == "bandit" and kinds["pred"] == "predictor" and kinds["ppo"] == "rl"
    assert sum(k == "oracle" for k in kinds.values()) == 4
    assert all(r["live_speedup"] is None and r["replay_speedup"] > 0.9 for r in rows)
    assert set(rows[0]) >= {"policy", "kind", "replay_speedup", "live_speedup"}
    res = json.loads(out.read_text())
    assert len(res["settings"]["test_prompts"]) == 8  # 4 per category, held out from every training above
    from policies import load_policy

    assert load_policy(paths[3]).obs_size == load_policy(paths[2]).obs_size + 2  # ppo sees the draft features
    pred = next(r for r in rows if r["policy"] == "pred")
    assert pred["replay_speedup"] > rows[0]["replay_speedup"]  # beats the best static arm on held-out prompts


def test_a_rerun_keeps_the_policies_already_trained_with_its_settings(files, capsys):
    """A run killed at its third policy trained the first two again on the rerun; a saved policy of the same
    settings (its config table, the seed, the trace's and cost model's bytes) is kept now, another is retrained."""
    out = files / "rerun"
    cfg = str(files / "cfg.toml")
    assert main(["train", cfg, "--out", str(out), "--policy", "ucb", "--policy", "pred", "--json"]) == 0
    first = {p["policy"]: p for p in json.loads(capsys.readouterr().out)["policies"]}
    before = {n: (out / "policies" / f"{n}.zip").read_bytes() for n in ("ucb", "pred")}
    assert main(["train", cfg, "--out", str(out), "--policy", "ucb", "--policy", "pred", "--json"]) == 0
    again = {p["policy"]: p for p in json.loads(capsys.readouterr().out)["policies"]}
    assert again["ucb"]["kept"] and again["pred"]["kept"] and not first["ucb"].get("kept")
    assert main(["train", cfg, "--out", str(out), "--policy", "ucb", "--policy", "ucb", "--json"]) == 0
    assert [p["policy"] for p in json.loads(capsys.readouterr().out)["policies"]] == ["ucb"]  # once
    assert again["ucb"]["train_replay_speedup"] == first["ucb"]["train_replay_speedup"]
    assert all((out / "policies" / f"{n}.zip").read_bytes() == before[n] for n in before)
    assert main(["train", cfg, "--out", str(out), "--policy", "ucb", "--set", "policies.ucb.params.scale=2.0",
                 "--json"]) == 0  # fmt: skip
    assert not json.loads(capsys.readouterr().out)["policies"][0].get("kept")


def test_user_errors_are_one_line(files, tmp_path, capsys):
    bad = tmp_path / "bad.zip"
    bad.write_bytes(b"not a zip")
    assert main(["evaluate", str(bad), "--no-live"]) == 2
    err = capsys.readouterr().err
    assert "not a readable draftgym policy file" in err and err.count("\n") == 1
    assert main(["train", str(files / "cfg.toml"), "--policy", "nope"]) == 2
    assert "no [policies.nope]" in capsys.readouterr().err
    cfg = tmp_path / "c.toml"
    cfg.write_text('[policies.x]\nkind = "hf_schedule"\narms = ["ngram-d4", "none"]\n'
                   f'train = {{ trace = "{files / "trace.npz"}", cost_model = "{files / "cost.json"}" }}\n')  # fmt: skip
    assert main(["train", str(cfg), "--out", str(tmp_path / "r")]) == 2
    assert "'none' first" in capsys.readouterr().err


def test_a_policy_trained_on_evaluated_prompts_is_flagged_and_left_out_of_the_summary(
    files, tmp_path, capsys
):
    """The held-out prompts are the first policy's; a later one whose training split holds some of them is flagged
    in its row (as before) and no longer ranked as the best learned policy of the summary."""
    from policies import load_policy

    out = tmp_path / "run"
    assert (
        main(["train", str(files / "cfg.toml"), "--out", str(out), "--policy", "ucb", "--policy", "pred"])
        == 0
    )
    ucb, pred = (out / "policies" / f"{n}.zip" for n in ("ucb", "pred"))
    leaky = load_policy(pred)
    split = leaky.meta["split"]
    leaky.meta = {**leaky.meta, "split": {**split, "train": split["train"] + split["test"][:3]}}
    leaky.save(tmp_path / "leaky.zip")
    capsys.readouterr()
    res = tmp_path / "eval.json"
    assert main(["evaluate", str(ucb), str(tmp_path / "leaky.zip"), "--no-live", "--json", str(res)]) == 0
    assert "trained on 3 test prompts!" in capsys.readouterr().out
    data = json.loads(res.read_text())
    row = next(r for r in data["rows"] if r["policy"] == "leaky")
    assert row["leaked"] == 3 and row["replay_speedup"] > next(r for r in data["rows"] if r["policy"] == "ucb")[
        "replay_speedup"]  # fmt: skip
    assert data["summary"]["replay"]["best"] == "ucb"


@pytest.mark.parametrize("split", [{"train": ["a"]}, {"test": ["a"]}, {"train": ["a"], "test": None}])
def test_a_policy_file_whose_split_lacks_a_side_is_one_line(files, tmp_path, capsys, split):
    from policies import load_policy

    out = tmp_path / "run"
    assert main(["train", str(files / "cfg.toml"), "--out", str(out), "--policy", "static"]) == 0
    pol = load_policy(out / "policies" / "static.zip")
    pol.meta = {**pol.meta, "split": split}
    pol.save(tmp_path / "odd.zip")
    capsys.readouterr()
    assert main(["evaluate", str(tmp_path / "odd.zip"), "--no-live"]) == 2
    err = capsys.readouterr().err
    assert "split." in err and err.count("\n") == 1 and "Traceback" not in err


def test_a_train_out_never_replaces_an_input_or_another_file(files, tmp_path, capsys):
    """``train.out`` naming the trace, the cost model, the config or a file that is no policy is refused before any
    training, the file intact; an earlier policy there is replaced as before."""
    text = (files / "cfg.toml").read_text()
    cfg = tmp_path / "c.toml"
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    for target in (files / "trace.npz", files / "cost.json", cfg, notes, str(tmp_path / "folder") + "/"):
        cfg.write_text(text.replace("total_timesteps = 500 }", f'total_timesteps = 500, out = "{target}" }}'))
        before = {p: p.read_bytes() for p in (files / "trace.npz", files / "cost.json", cfg, notes)}
        assert main(["train", str(cfg), "--out", str(tmp_path / "run"), "--policy", "ucb"]) == 2
        err = capsys.readouterr().err
        assert "policies.ucb.train.out" in err and err.count("\n") == 1, err
        assert all(p.read_bytes() == b for p, b in before.items())
    mine = tmp_path / "ucb.zip"
    cfg.write_text(text.replace("total_timesteps = 500 }", f'total_timesteps = 500, out = "{mine}" }}'))
    for _ in range(2):  # the second run finds its own earlier policy there
        assert main(["train", str(cfg), "--out", str(tmp_path / "run"), "--policy", "ucb", "--json"]) == 0
        capsys.readouterr()
    from policies.archive import is_policy_zip

    assert is_policy_zip(mine)


def test_an_rl_run_does_not_resume_from_checkpoints_of_another_menu(files, tmp_path, capsys):
    """Another menu of the same size keeps the network's shapes, but its actions mean other arms: refused."""
    cfg = str(files / "cfg.toml")
    out = tmp_path / "rl"
    small = ["--set", "policies.ppo.train.total_timesteps=512"]
    assert main(["train", cfg, "--out", str(out), "--policy", "ppo", *small, "--json"]) == 0
    capsys.readouterr()
    other = '["none", "ngram-d2", "ngram-d4", "ngram-d8", "ngram-d12"]'
    assert main(["train", cfg, "--out", str(out), "--policy", "ppo", *small, "--set",
                 f"policies.ppo.arms={other}", "--set", "policies.ppo.train.total_timesteps=1024"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "other settings" in err and "arms" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("field", ["trace", "cost_model", "arms"])
def test_every_policys_inputs_are_read_before_any_trains(field, tmp_path, capsys, monkeypatch):
    """A second policy's bad trace or cost model, or arms its trace did not record, failed the run after the first
    policy's training."""
    import experiments.policy_train as pt

    (tmp_path / "bad.npz").write_text("not a trace")
    (tmp_path / "bad.json").write_text("[" * 100_000)
    bad = tmp_path / ("bad.npz" if field == "trace" else "bad.json")
    b = ('arms = ["none", "ngram-d2", "suffix-d3"]' if field == "arms"
         else f'arms = ["none", "ngram-d2"]\ntrain = {{ {field} = "{bad}" }}')  # fmt: skip
    (tmp_path / "c.toml").write_text(f"""
name = "two"
[policies.a]
kind = "ucb1"
arms = ["none", "ngram-d2"]
[policies.b]
kind = "ucb1"
{b}
""")
    monkeypatch.setattr(pt, "train_policy", lambda *a, **k: pytest.fail("a policy trained first"))
    assert main(["train", str(tmp_path / "c.toml"), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ("suffix" if field == "arms" else str(bad)) in err, err


def test_train_refuses_to_train_over_the_state_a_run_learned_online(files, tmp_path, capsys):
    """``run`` keeps its online policies' state in the folder's ``policies/``, where ``train`` saves by default:
    a train there replaced it, and the run's resume went on from a state it never had."""
    from policies.bandits import UCB1

    run = tmp_path / "run"
    (run / "policies").mkdir(parents=True)
    learned = UCB1(["none", "ngram-d2", "ngram-d4", "ngram-d8", "ngram-d16"])
    learned.meta = {"run_learned": ["1"]}
    learned.save(run / "policies" / "ucb.zip")
    before = (run / "policies" / "ucb.zip").read_bytes()
    assert main(["train", str(files / "cfg.toml"), "--policy", "ucb", "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "learned online" in err and "ucb.zip" in err, err
    assert (run / "policies" / "ucb.zip").read_bytes() == before


def test_evaluate_json_never_replaces_the_trace_or_cost_model_a_policy_file_names(files, tmp_path, capsys):
    """Without --trace or --cost-model, evaluate reads the files the policy names; ``--json`` naming its cost model
    (a JSON file, as results are) replaced it with the result rows."""
    import shutil

    from policies.bandits import UCB1

    cost = shutil.copy(files / "cost.json", tmp_path / "cost.json")
    p = UCB1(json.loads(ARMS))
    p.meta = {"trace": str(files / "trace.npz"), "cost_model": str(cost)}
    p.save(tmp_path / "u.zip")
    before = (tmp_path / "cost.json").read_bytes()
    assert main(["evaluate", "--no-live", str(tmp_path / "u.zip"), "--json", str(cost)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cost.json" in err, err
    assert (tmp_path / "cost.json").read_bytes() == before


def test_train_again_after_a_run_keeps_the_state_the_run_learned(files, tmp_path, capsys):
    """A policy trained with these settings is kept by a rerun of train (nothing written), the state a run learned
    from it included: train, run, train again is no error."""
    from policies.base import load_policy

    run = tmp_path / "run"
    assert main(["train", str(files / "cfg.toml"), "--policy", "ucb", "--out", str(run), "--json"]) == 0
    path = run / "policies" / "ucb.zip"
    p = load_policy(path)
    p.meta = {**p.meta, "run_learned": ["1"]}  # as run saves the state it learned back
    p.save(path)
    before = path.read_bytes()
    assert main(["train", str(files / "cfg.toml"), "--policy", "ucb", "--out", str(run), "--json"]) == 0
    assert path.read_bytes() == before


@pytest.mark.parametrize(
    "argv, says",
    [
        (
            ["--serve", "--cost-model", "x.json"],
            "--cost-model is not read by evaluate --serve (its batch cost",
        ),
        (
            ["--serve", "--limit", "5"],
            "--limit is not read by evaluate --serve\n",
        ),  # (no word of a cost model)
        (["--no-live", "--batch-cost", "x.json"], "--batch-cost is read by evaluate --serve only"),
        (["--no-live", "--loads", "abc"], "--loads is read by evaluate --serve only"),
        (["--no-live", "--episodes", "5"], "--episodes is read by evaluate --serve only"),
    ],
)
def test_an_option_of_the_other_mode_of_evaluate_is_refused(argv, says, capsys):
    """Each was ignored without a word (the run went on with the defaults)."""
    assert main(["evaluate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err


def test_a_trace_recorded_again_is_refused_before_any_policy_is_retrained(files, tmp_path, capsys):
    """A trace recorded again under the same name: ``train`` retrained ucb on it and wrote its file, then refused
    ppo's folder (started on the old trace), leaving one folder with policies of two traces."""
    import shutil

    from tests.policies.synthetic import synthetic_trace

    for name in ("trace.npz", "cost.json"):
        shutil.copy(files / name, tmp_path / name)
    cfg = tmp_path / "cfg.toml"
    cfg.write_text((files / "cfg.toml").read_text().replace(str(files), str(tmp_path)))
    out = tmp_path / "run"
    argv = ["train", str(cfg), "--out", str(out), "--policy", "ucb", "--policy", "ppo", "--json",
            "--set", "policies.ppo.train.total_timesteps=512"]  # fmt: skip
    assert main(argv) == 0
    capsys.readouterr()
    ucb = out / "policies" / "ucb.zip"
    before = ucb.read_bytes()
    synthetic_trace(seed=1).save(tmp_path / "trace.npz")  # recorded again: other contents, same name
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "train/ppo holds results run with other settings (trace:" in err and err.count("\n") == 1, err
    assert ucb.read_bytes() == before
