"""``draftgym oracle-gap`` on the bundled trace: the n-gram features (no look-ahead), the table's consistency with
the oracle and the best static arm, and one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from env.trace import load_trace
from experiments.cli import main
from experiments.oracle_gap import NGRAM_FEATURES, measure, ngram_features


@pytest.fixture(scope="module")
def trace():
    return load_trace()


def test_ngram_features_are_bounded_and_agree_with_the_guess(trace):
    f = ngram_features(trace)
    assert f.shape == (trace.traj.shape[0], len(NGRAM_FEATURES))
    assert (f >= 0).all() and (f <= 1).all()
    p = 0
    traj, off = trace.trajectory(p), int(trace.traj_off[p])
    assert f[off, 3] == 1.0  # the first token came from the prompt's forward pass: no guess
    for j in range(1, len(traj)):
        tokens, parents = trace.trees["ngram"].at(off + j - 1)  # the tree proposed right after token j - 1
        children = [int(tokens[i]) for i in range(len(tokens)) if parents[i] == 0]
        assert f[off + j, 3] == float(not children)  # ngram_no_guess
        assert f[off + j, 2] == float(bool(children) and children[0] == traj[j])  # ngram_hit_root
    assert f[:, 2].sum() > 0  # the built-in answers do copy from their prompts
    streak = 0  # column 0: consecutive right guesses up to the root, / 16, capped
    for t in range(len(trace.trajectory(p))):
        streak = streak + 1 if f[trace.traj_off[p] + t, 2] == 1 else 0
        assert f[trace.traj_off[p] + t, 0] == pytest.approx(min(streak, 16) / 16)


def test_ngram_features_do_not_look_ahead(trace):
    """Changing the tokens after position t leaves every feature at positions <= t unchanged."""
    from dataclasses import replace

    p, t = 1, 20
    traj = trace.traj.copy()
    a, b = trace.traj_off[p] + t + 1, trace.traj_off[p + 1]
    traj[a:b] = np.random.default_rng(0).integers(0, 49152, b - a)
    before, after = ngram_features(trace), ngram_features(replace(trace, traj=traj, cache={}))
    assert np.array_equal(before[: trace.traj_off[p] + t + 1], after[: trace.traj_off[p] + t + 1])
    assert not np.array_equal(before[a:b], after[a:b])


def test_measure_rows_sit_between_the_static_arm_and_the_oracle(trace):
    res = measure(trace, test_per_category=1, progress=False)
    assert len(res["rows"]) == 8
    assert {(r["features"], r["model"], r["fit"]) for r in res["rows"]} == {
        (f, m, w)
        for f in ("position", "position+ngram")
        for m in ("ridge", "gbdt")
        for w in ("train", "in-sample")
    }
    base, oracle = res["best_static"]["replay_speedup"], res["oracle"]["replay_speedup"]
    optimal = res["optimal"]["replay_speedup"]  # the least-time plan: no policy can beat it in replay
    assert optimal >= oracle > base > 0.5
    for r in res["rows"]:
        assert 0.5 < r["replay_speedup"] <= optimal + 1e-9
        assert r["recovered"] == pytest.approx((r["replay_speedup"] - base) / (oracle - base))
    # fitted on the held-out prompts themselves, the trees (a flexible fit) beat the static arm
    trees = next(
        r for r in res["rows"] if (r["features"], r["model"], r["fit"]) == ("position", "gbdt", "in-sample")
    )
    assert trees["replay_speedup"] > base
    assert len(res["test_prompts"]) == 6 and res["train_prompts"] == 6


def test_cli_writes_json_and_rejects_bad_input(tmp_path, capsys):
    out = tmp_path / "gap.json"
    assert main(["oracle-gap", "--test-per-category", "1", "--json", str(out)]) == 0
    assert "per-step greedy oracle" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert np.isfinite([r["replay_speedup"] for r in rows]).all()
    assert main(["oracle-gap", "--arms", "none,bogus-d2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("draftgym oracle-gap: error:") and "bogus" in err and "\n" not in err
    assert json.loads(out.read_text())["provenance"]
    assert main(["oracle-gap", "--test-per-category", "0"]) == 2
    assert "--test-per-category" in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["truncated", "missing_array", "bad_offsets", "not_a_file"])
def test_cli_names_a_damaged_trace_in_one_line(damage, tmp_path, capsys):
    from env.trace import default_trace_path

    src = default_trace_path()
    bad = tmp_path / "bad.npz"
    if damage == "truncated":
        bad.write_bytes(src.read_bytes()[:5000])
    elif damage in ("missing_array", "bad_offsets"):
        with np.load(src, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        if damage == "missing_array":
            del arrays["traj_off"]
        else:
            arrays["traj_off"] = arrays["traj_off"] + 3
        np.savez(bad, **arrays)
    else:
        bad = tmp_path / "nowhere.npz"
    assert main(["oracle-gap", "--trace", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("draftgym oracle-gap: error:") and str(bad) in err and "\n" not in err


@pytest.mark.parametrize("target", ["jsonl", "cost_model"])
def test_cli_json_keeps_a_jsonl_and_its_cost_model(target, tmp_path, capsys):
    """A JSONL (its first byte ``{``) counted as an earlier JSON result, and ``--json`` destroyed it."""
    from env.cost import default_cost_model_path

    cm = tmp_path / "cm.json"
    cm.write_bytes(default_cost_model_path().read_bytes())
    out = cm if target == "cost_model" else tmp_path / "question.jsonl"
    if target == "jsonl":
        out.write_text('{"question_id": 1}\n{"question_id": 2}\n')
    before = out.read_bytes()
    code = main(["oracle-gap", "--cost-model", str(cm), "--test-per-category", "1", "--json", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err, err
    assert ("is not a JSON file" if target == "jsonl" else "is also an input") in err, err
    assert out.read_bytes() == before


def _cut(trace, lengths, categories):
    """``trace`` with prompt p's trajectory cut to ``lengths[p]`` tokens, and these categories."""
    from env.trace import Trace, TreeArrays

    keep = np.concatenate(
        [np.arange(trace.traj_off[p], trace.traj_off[p] + n) for p, n in enumerate(lengths)]
    )
    tree = trace.trees["ngram"]
    parts = [tree.at(int(g)) for g in keep]
    off = np.concatenate([[0], np.cumsum([len(t) for t, _ in parts])]).astype(np.int64)
    header = {**trace.header, "prompts": {**trace.header["prompts"], "categories": categories}}
    return Trace(header=header, prompt_tokens=trace.prompt_tokens, prompt_off=trace.prompt_off,
                 traj=trace.traj[keep], traj_off=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                 feat=trace.feat[keep], trees={"ngram": TreeArrays(off, np.concatenate([t for t, _ in parts]),
                                                                    np.concatenate([q for _, q in parts]))})  # fmt: skip


def test_prompts_without_a_step_to_take_leave_nothing_to_fit_in_one_line():
    """Training prompts that end after their first token are not scored: with none left, one line, no traceback."""
    from experiments.oracle_gap import OracleGapError
    from tests.env.conftest import make_trace, toy_cost_model

    trace = _cut(make_trace(seed=0, prompts=4, max_new=40), [1, 20, 1, 20], ["a", "a", "b", "b"])
    with pytest.raises(OracleGapError, match="no test or no training prompt with a step to take"):
        measure(trace, ["none", "ngram-d2", "ngram-d4"], toy_cost_model(), test_per_category=1, seed=0)
