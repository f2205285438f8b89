"""The ``python -m experiments.*`` study programs (``offline_tau``, ``suffix_turns``, ``head_eval``,
``serve_fidelity``, ``vocab_order``) answer bad input as ``draftgym`` does: one line naming the problem, exit code
2, before the model loads. ``head_eval`` and ``serve_fidelity`` ended in a traceback or wrote ``--json`` only at the
end (a directory there lost the measurement)."""

from __future__ import annotations

import importlib

import pytest


@pytest.fixture
def no_model(monkeypatch):
    import env.model

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(env.model, "load_model", refuse)


@pytest.mark.parametrize(
    "program, args, expected",
    [
        ("offline_tau", ["{tmp}/none", "builtin"], "records.jsonl"),
        ("offline_tau", ["{tmp}", "builtin", "0"], "must be >= 1"),
        ("suffix_turns", ["--workload", "x.jsonl", "--out", "{tmp}/o", "--batch", "0"], "must be >= 1"),
        ("head_eval", ["--data", "{tmp}/none"], "no distillation data"),
        ("head_eval", ["--data", "{tmp}", "--json", "{tmp}"], "is a directory, not a file"),
        ("head_eval", ["--data", "{tmp}", "--levels", "0"], "must be >= 1"),
        (
            "head_eval",
            ["--data", "{tmp}", "--heads", "eagle3,eagle3", "--weights", "{tmp}/a.safetensors"],
            "no head file",
        ),
        ("head_eval", ["--data", "{tmp}", "--heads", "early_exit"], "not a head this evaluation scores"),
        ("serve_fidelity", ["--batch-cost", "{tmp}/none.json"], "does not exist"),
        ("serve_fidelity", ["--arm", "ngram-d99"], "unknown arm 'ngram-d99'"),
        ("serve_fidelity", ["--loads", ","], "--loads names no load"),
        ("serve_fidelity", ["--json", "{tmp}"], "is a directory, not a file"),
        ("vocab_order", ["{tmp}/head.safetensors", "--rows", "0"], "must be >= 1"),
        ("vocab_order", ["{tmp}/head.safetensors"], "no head file"),
        ("vocab_order", ["{tmp}/head.safetensors", "--exclude-per-category", "-1"], "must be >= 0"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_before_the_model_loads(
    program, args, expected, no_model, tmp_path, capsys
):
    main = importlib.import_module(f"experiments.{program}").main
    code = main([a.replace("{tmp}", str(tmp_path)) for a in args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err and expected in err, err
    assert err.startswith(f"python -m experiments.{program}: error: "), err


def test_vocab_order_checks_the_workload_before_the_model_loads(no_model, tmp_path, capsys):
    from experiments.vocab_order import main

    for suffix in (".safetensors", ".json"):
        (tmp_path / f"head{suffix}").write_bytes(b"{}")
    code = main([str(tmp_path / "head.safetensors"), "--workload", str(tmp_path / "none.jsonl")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "none.jsonl does not exist" in err, err


def test_head_eval_reads_the_held_out_prompts_a_head_records(tmp_path):
    """A corpus folder grows across runs; the split of what it holds now may fall on prompts a head trained on.
    A head's JSON records the ids it held out, and head_eval scores those (none recorded: the folder's split)."""
    import json

    from experiments.head_eval import _heldout_ids

    head = tmp_path / "h.safetensors"
    head.with_suffix(".json").write_text(json.dumps({"training": {"heldout_ids": ["p3", "p9"]}}))
    assert _heldout_ids(head) == {"p3", "p9"}
    head.with_suffix(".json").write_text(json.dumps({"training": {}}))
    assert _heldout_ids(head) is None
    head.with_suffix(".json").write_text("{{{")
    assert _heldout_ids(head) is None
