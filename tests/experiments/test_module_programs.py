"""The ``python -m experiments.*`` study programs (``offline_tau``, ``suffix_turns``, ``head_eval``,
``serve_fidelity``, ``vocab_order``, ``bench_allocator``) answer bad input as ``draftgym`` does: one line naming the problem, exit code
2, before the model loads. ``head_eval`` and ``serve_fidelity`` ended in a traceback or wrote ``--json`` only at the
end (a directory there lost the measurement)."""

from __future__ import annotations

import importlib
import json

import pytest


@pytest.fixture
def no_model(monkeypatch):
    import env.model

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(env.model, "load_model", refuse)
    import subprocess

    monkeypatch.setattr(subprocess, "run", refuse)  # bench_allocator loads it in processes of its own


@pytest.mark.parametrize(
    "program, args, expected",
    [
        ("offline_tau", ["{tmp}/none", "builtin"], "records.jsonl"),
        ("offline_tau", ["{tmp}", "builtin", "0"], "must be >= 1"),
        ("suffix_turns", ["--workload", "x.jsonl", "--out", "{tmp}/o", "--batch", "0"], "must be >= 1"),
        (
            "suffix_turns",
            ["--workload", "x.jsonl", "--arms", "ngram-d3,suffix-d3,ngram-d3", "--out", "{tmp}/o"],
            "lists ngram-d3 more than once",
        ),
        ("head_eval", ["--data", "{tmp}/none"], "no distillation data"),
        (
            "head_eval",
            ["--data", "{tmp}/none", "--weights", ""],
            "no distillation data",
        ),  # "": the default head
        ("head_eval", ["--data", "{tmp}", "--json", "{tmp}"], "is a directory, not a file"),
        ("head_eval", ["--data", "{tmp}", "--levels", "0"], "must be in [1, 64]"),
        (
            "head_eval",
            ["--data", "{tmp}", "--levels", "1000000"],
            "must be in [1, 64]",
        ),  # it ran on for minutes
        (
            "head_eval",
            ["--data", "{tmp}", "--heads", "eagle3,eagle3", "--weights", "{tmp}/a.safetensors"],
            "no head file",
        ),
        ("head_eval", ["--data", "{tmp}", "--heads", "early_exit"], "not a head this evaluation scores"),
        ("serve_fidelity", ["--batch-cost", "{tmp}/none.json"], "does not exist"),
        (
            "serve_fidelity",
            ["--arm", "ngram-d99"],
            "arm ngram-d99 is larger than the trees the trace recorded",
        ),
        ("serve_fidelity", ["--arms", "none,eagle3-d1"], "has no calibration for drafter 'eagle3'"),
        ("serve_fidelity", ["--arms", ","], "--arms names no arm"),
        ("serve_fidelity", ["--loads", ","], "--loads names no load"),
        ("serve_fidelity", ["--json", "{tmp}"], "is a directory, not a file"),
        ("serve_fidelity", ["--requests", str(10**18)], "--requests: must be in [1, 65536]"),  # after warm-up
        ("vocab_order", ["{tmp}/head.safetensors", "--kind", "zzz"], "invalid choice: 'zzz'"),
        ("bench_allocator", ["--load", "99"], "the concurrency must be in 1..16"),
        ("bench_allocator", ["--arm", "eagle3-d1"], "--arm 'eagle3-d1' is not in the menu"),
        ("bench_allocator", ["--menu", "none,eagle3-d1"], "has no calibration for drafter 'eagle3'"),
        ("bench_allocator", ["--menu", ","], "--menu names no arm"),
        ("bench_allocator", ["--trace", "{tmp}/none.npz"], "does not exist"),
        ("bench_allocator", ["--rounds", "0"], "must be >= 1"),
        ("bench_allocator", ["--json", "{tmp}"], "is a directory, not a file"),
        ("vocab_order", ["{tmp}/head.safetensors", "--rows", "0"], "must be >= 1"),
        ("vocab_order", ["{tmp}/head.safetensors"], "no head file"),
        ("vocab_order", [""], "'' names no head file"),  # a traceback (Path("").with_suffix)
        ("vocab_order", ["/"], "'/' names no head file"),
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


@pytest.mark.parametrize("out", ["{h}/head.json", "{h}/head.safetensors", "{data}/rows.json"])
def test_head_eval_json_is_none_of_the_files_it_reads(out, no_model, tmp_path, capsys):
    """``--json`` naming the head's description (JSON, so it passed) replaced it with the rows; the next evaluation
    refused the head. The head files and anything inside the data folders are refused before any work."""
    from experiments.head_eval import main

    (tmp_path / "h").mkdir()
    (tmp_path / "data").mkdir()
    for suffix in (".safetensors", ".json"):
        (tmp_path / "h" / f"head{suffix}").write_text("{}")
    out = out.format(h=tmp_path / "h", data=tmp_path / "data")
    args = [
        "--data",
        str(tmp_path / "data"),
        "--heads",
        "eagle",
        "--weights",
        str(tmp_path / "h" / "head.safetensors"),
    ]
    code = main([*args, "--json", out])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "is also an input" in err if "/h/" in out else "which this command reads" in err, err
    assert all((tmp_path / "h" / f"head{s}").read_text() == "{}" for s in (".safetensors", ".json"))


@pytest.mark.parametrize("program", ["suffix_turns", "offline_tau"])
def test_a_fifo_input_is_refused_not_read_for_ever(program, no_model, tmp_path, capsys):
    """A FIFO as the workload (suffix_turns) or as a bench run's records.jsonl (offline_tau) blocked for ever."""
    import os

    main = importlib.import_module(f"experiments.{program}").main
    if program == "suffix_turns":
        fifo = tmp_path / "q.jsonl"
        argv = ["--workload", str(fifo), "--out", str(tmp_path / "o")]
    else:
        fifo = tmp_path / "records.jsonl"
        argv = [str(tmp_path), "builtin"]
    os.mkfifo(fifo)
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"{fifo} is not a regular file (a FIFO, a device or a socket)" in err, err


def test_suffix_turns_refuses_an_empty_out(no_model, tmp_path, capsys, monkeypatch):
    """``Path("")`` is the current folder: answers.json and turns.json were written there."""
    from experiments.suffix_turns import main

    monkeypatch.chdir(tmp_path)
    w = tmp_path / "w.jsonl"
    w.write_text("".join(json.dumps({"question_id": i, "category": "writing", "turns": [f"Say hi {i}.", "Now bye."]})
                         + "\n" for i in (1, 2)))  # fmt: skip
    assert main(["--workload", str(w), "--out", ""]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--out is given an empty value" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.jsonl"]


def test_suffix_turns_checks_its_result_file_before_answering(no_model, tmp_path, capsys):
    """``OUT/turns.json`` a folder failed the run after every answer was generated."""
    from experiments.suffix_turns import main

    q = tmp_path / "q.jsonl"
    q.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": ["Hi.", "And?"]}) + "\n")
    (tmp_path / "o" / "turns.json").mkdir(parents=True)
    code = main(["--workload", str(q), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "turns.json is not a regular file" in err, err


def test_bench_allocator_refuses_a_setting_its_processes_would_refuse(no_model, monkeypatch, capsys):
    """Checked once before any process starts, not as each measuring process's failure."""
    from env.allocator import glibc_mallopt
    from experiments.bench_allocator import main

    if glibc_mallopt() is None:
        pytest.skip("no glibc mallopt here: the program refuses that first")

    monkeypatch.setenv("DRAFTGYM_WIDE_MATMUL", "x")
    assert main(["--load", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "DRAFTGYM_WIDE_MATMUL='x'" in err, err


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


@pytest.fixture
def stub_fidelity(monkeypatch):
    """serve_fidelity without the model and the serving: only its checks and its ``--json`` run."""
    import env.model
    import experiments.serve_fidelity as sf

    monkeypatch.setattr(env.model, "load_model", lambda *a, **k: None)
    monkeypatch.setattr("experiments.serve_live.warm_up", lambda *a, **k: None)
    from env.serve_sim import default_serve_trace

    model = default_serve_trace().header["model"]  # the embedded model's fingerprint, as the bundled trace's
    monkeypatch.setattr("env.trace.model_fingerprint", lambda loaded: dict(model))
    zero = dict(prefill_s=0, steps=0, step_s=0, forward_s=0, draft_s=0, wall_s=0, tokens=0)
    monkeypatch.setattr(sf, "diagnose", lambda cost, arm, load, loaded, req, **kw: {
        "load": load, "arm": arm, "requests": req, "replay": zero, "live": {**zero, "other_s": 0, "bookkeeping_s": 0}})  # fmt: skip
    return sf


def _batch_cost(tmp_path, **changes):
    import json

    from env.batch_cost import default_batch_cost_path

    doc = {**json.loads(default_batch_cost_path().read_text()), **changes}
    path = tmp_path / "bc.json"
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("flag", ["--batch-cost", "jsonl"])
def test_serve_fidelity_does_not_overwrite_its_input(flag, stub_fidelity, tmp_path, capsys):
    """``--json`` naming the ``--batch-cost`` file (or a JSONL) was overwritten by the first row."""
    bc = _batch_cost(tmp_path)
    out = bc if flag == "--batch-cost" else tmp_path / "question.jsonl"
    out.write_text(out.read_text() if flag == "--batch-cost" else '{"a": 1}\n{"a": 2}\n')
    before = out.read_bytes()
    code = stub_fidelity.main(["--batch-cost", str(bc), "--json", str(out), "--loads", "1"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert ("is also an input" if flag == "--batch-cost" else "is not a JSON file") in err, err
    assert out.read_bytes() == before
    other = tmp_path / "o.json"
    assert stub_fidelity.main(["--batch-cost", str(bc), "--json", str(other), "--loads", "1"]) == 0


@pytest.mark.parametrize(
    "cost, expected",
    [
        ("roofline:h100-sxm/llama-3.1-8b", "(simulated) prices another machine"),
        ({"model_id": "some-other-model"}, "calibrated for some-other-model (bfloat16/dense)"),
        ({"weights": "int4"}, "calibrated for smollm2-135m-instruct (bfloat16/int4)"),
    ],
)
def test_serve_fidelity_refuses_a_cost_model_of_another_target(cost, expected, no_model, tmp_path, capsys):
    """The live side serves the embedded model, dense, in the cost model's dtype; a roofline model or one calibrated
    for another model or weight format made the printed replay-vs-live gap meaningless."""
    from experiments.serve_fidelity import main

    spec = cost if isinstance(cost, str) else str(_batch_cost(tmp_path, **cost))
    code = main(["--batch-cost", spec, "--loads", "1"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and expected in err, err


def test_serve_fidelity_serves_the_target_in_the_cost_models_dtype(
    stub_fidelity, monkeypatch, tmp_path, capsys
):
    """A cost model measured in fp32 (a CPU without native bf16) is compared with an fp32 target, not refused."""
    import env.model

    seen = []
    monkeypatch.setattr(env.model, "load_model", lambda *a, **k: seen.append(k["dtype"]))
    for dtype in ("float32", "bfloat16"):
        assert (
            stub_fidelity.main(["--batch-cost", str(_batch_cost(tmp_path, dtype=dtype)), "--loads", "1"]) == 0
        )
    assert seen == ["float32", "bfloat16"]


def test_serve_fidelity_refuses_a_trace_it_cannot_compare(stub_fidelity, monkeypatch, tmp_path, capsys):
    """A trace with no held-out prompt is refused before the model loads (it failed after the warm-up, with a
    message about steps); a trace of another model once the target is loaded (it was compared, meaninglessly)."""
    import env.model
    from tests.env.conftest import make_trace

    few = tmp_path / "few.npz"
    make_trace(seed=1, prompts=1).save(few)
    monkeypatch.setattr(env.model, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    assert stub_fidelity.main(["--trace", str(few), "--arms", "none,ngram-d2", "--loads", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no held-out prompt" in err, err
    other = tmp_path / "other.npz"
    make_trace(seed=1, prompts=10).save(other)  # recorded for a toy model, not the embedded one
    monkeypatch.setattr(env.model, "load_model", lambda *a, **k: None)
    monkeypatch.setattr("env.trace.model_fingerprint", lambda loaded: {"model_id": "smollm2-135m-instruct"})
    assert stub_fidelity.main(["--trace", str(other), "--arms", "none,ngram-d2", "--loads", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the trace was recorded for model" in err, err


def test_serve_fidelity_takes_the_shipped_cost_model(stub_fidelity, capsys):
    assert stub_fidelity.main(["--loads", "1"]) == 0
    assert "cost model: measured" in capsys.readouterr().out
