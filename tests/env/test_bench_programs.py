"""The ``python -m env.*`` benchmark programs (``bench_draft``, ``bench_batch``, ``bench_forward``, ``fidelity``):
a bad name or path is one line and exit code 2 before the model loads; rows are printed and written to ``--json``
as they are measured, so that an error or a kill mid-run keeps them. The measurements are stubbed: these tests
check the programs' handling, not the timings."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from tests.env.conftest import _one_line_error


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--drafters", "eagle,bogus"], "unknown drafter 'bogus'"),
        (["--drafters", "ngram"], "ngram does not draft rows together"),
        (["--drafters", "early_exit", "--vocab", "8"], "early_exit takes no vocab option"),
        (["--rows", "1,x"], "--rows must be a comma list"),
        (["--max-depth", "2"], "--max-depth: must be in [3, 256]"),
        (["--max-depth", "100000"], "--max-depth: must be in [3, 256]"),  # it ran on for minutes
        (["--max-depth", "256", "--topk", "64"], "--max-depth and --topk: tree nodes must be <= 4096"),
        (["--rows", "1,5000"], "--rows: at most 4096 rows, got 5000"),
        (["--topk", "1,65"], "--topk: at most 64 branches a node, got 65"),
        (["--draft", "eagle"], "unrecognized arguments: --draft"),  # no abbreviations
        (["--json", "{tmp}"], "is a directory, not a file"),
        (["--json", "/proc/draftgym-bench.json"], "cannot write there"),
    ],
)
def test_bench_draft_refuses_bad_input_before_loading(args, expected, no_model, tmp_path, capsys):
    from env.bench_draft import main

    code = main([a.replace("{tmp}", str(tmp_path)) for a in args])
    _one_line_error(capsys, code, expected)


def test_bench_draft_keeps_the_rows_measured_before_an_error(monkeypatch, tmp_path, capsys):
    import env.bench_draft as bd
    import env.model
    from drafters import DrafterError

    monkeypatch.setattr(
        env.model, "load_model", lambda *a, **k: SimpleNamespace(model_id="m", device="cpu", max_context=8192)
    )
    calls = []

    def measure(loaded, drafter, rows, *a):
        calls.append(drafter)
        if len(calls) == 2:
            raise DrafterError("no eagle3 head for this target")
        return {"drafter": drafter, "rows": rows, "forward_ms": 2.0, "expansion_ms": 1.0,
                "expansion_vs_forward": 0.5}  # fmt: skip

    monkeypatch.setattr(bd, "measure", measure)
    out = tmp_path / "sub" / "draft.json"
    code = bd.main(["--drafters", "eagle,eagle3", "--rows", "1", "--topk", "1", "--json", str(out)])
    captured = capsys.readouterr()
    assert code == 2 and captured.err.strip().endswith("no eagle3 head for this target")
    assert "| eagle | default | 1 | 1 | 2.00 | 1.00 | 50.0% |" in captured.out
    doc = json.loads(out.read_text())
    assert [r["drafter"] for r in doc["rows"]] == ["eagle"] and doc["complete"] is False


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--draft", "ngram-d3"], "ngram does not draft rows together"),
        (["--draft", "bogus-d3"], "unknown drafter 'bogus'"),
        (["--rows", "0"], "--rows must be a comma list of integers >= 1"),
        (["--json", "{tmp}"], "is a directory, not a file"),
        (["--serve", str(10**12)], "--serve: must be in [0, 65536]"),  # it built 10^12 requests
        (["--serve", "-1"], "--serve: must be in [0, 65536], got -1"),
        (["--rows", "1,5000"], "--rows: at most 4096 rows, got 5000"),
    ],
)
def test_bench_batch_refuses_bad_input_before_loading(args, expected, no_model, tmp_path, capsys):
    from env.bench_batch import main

    code = main([a.replace("{tmp}", str(tmp_path)) for a in args])
    _one_line_error(capsys, code, expected)


def test_bench_batch_writes_each_row_as_it_is_measured(monkeypatch, tmp_path, capsys):
    """A kill (here an interrupt) after the first batch size keeps its row in the JSON."""
    import env.bench_batch as bb
    import env.model

    monkeypatch.setattr(
        env.model, "load_model", lambda *a, **k: SimpleNamespace(dtype=torch.float32, max_context=8192)
    )
    monkeypatch.setattr(bb, "raw_forward", lambda *a: None)
    monkeypatch.setattr(bb, "engine_step", lambda *a: None)
    timings = iter([[1.0, 2.0]])

    def interleaved(fns, reps):
        for t in timings:
            return t
        raise KeyboardInterrupt

    monkeypatch.setattr(bb, "_interleaved_ms", interleaved)
    out = tmp_path / "batch.json"
    code = bb.main(["--rows", "1,4", "--json", str(out)])
    captured = capsys.readouterr()
    assert code == 130 and "interrupted" in captured.err
    assert "    1      1.0        2.0          0.50" in captured.out
    doc = json.loads(out.read_text())
    assert [r["rows"] for r in doc["rows"]] == [1] and doc["complete"] is False


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--weights", "dense,bogus"], "unknown weight format 'bogus'"),
        (["--q", "1,-4"], "--q must be a comma list"),
        (["--json", "{tmp}"], "is a directory, not a file"),
        (["--comp"], "unrecognized arguments: --comp"),
    ],
)
def test_bench_forward_refuses_bad_input_before_loading(args, expected, no_model, tmp_path, capsys):
    from env.bench_forward import main

    code = main([a.replace("{tmp}", str(tmp_path)) for a in args])
    _one_line_error(capsys, code, expected)


def test_bench_forward_prints_and_writes_each_row_as_it_is_measured(monkeypatch, tmp_path, capsys):
    import env.bench_forward as bf
    import env.model

    class Loaded(SimpleNamespace):
        def replace(self, **k):
            return Loaded(**{**vars(self), **k})

    monkeypatch.setattr(env.model, "load_model", lambda *a, **k: Loaded(device=torch.device("cpu"),
                                                                           dtype=torch.float32, max_context=8192))  # fmt: skip
    monkeypatch.setattr(bf, "hf_forward", lambda *a: None)
    monkeypatch.setattr(bf, "engine_forward", lambda *a: None)
    timings = iter([[3.0, 1.5]])

    def interleaved(fns, reps):
        assert len(fns) == 2
        for t in timings:
            return t
        raise RuntimeError("a bug mid-run")

    monkeypatch.setattr(bf, "_interleaved_ms", interleaved)
    out = tmp_path / "fwd.json"
    with pytest.raises(RuntimeError, match="a bug mid-run"):  # a bug keeps its traceback
        bf.main(["--q", "1,8", "--weights", "dense", "--json", str(out)])
    assert "| q=1 | 3.0 | 1.5 |" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["table"] == [{"q": 1, "hf": 3.0, "lean-dense": 1.5}] and doc["complete"] is False


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--json", "{tmp}"], "is a directory, not a file"),
        (["--save-cost-model", "{tmp}/cm.json"], "only with --calibrate"),
        (["--trace", "{tmp}/missing.npz"], "missing.npz"),
        (["--prompts", "0"], "--prompts: must be >= 1"),
    ],
)
def test_fidelity_refuses_bad_input_before_loading(args, expected, no_model, tmp_path, capsys):
    from env.fidelity import main

    code = main([a.replace("{tmp}", str(tmp_path)) for a in args])
    _one_line_error(capsys, code, expected)


def test_fidelity_writes_the_summary_after_each_prompt(monkeypatch, tmp_path, capsys):
    import env.fidelity as fid

    def run(prompts, trace, cost_model, seed, on_prompt=None):
        on_prompt({"prompts": 1, "rows": [{"prompt": "p0"}], "complete": False})
        raise KeyboardInterrupt  # killed during the second prompt

    monkeypatch.setattr(fid, "run", run)
    out = tmp_path / "fidelity.json"
    assert fid.main(["--json", str(out)]) == 130
    assert json.loads(out.read_text())["rows"] == [{"prompt": "p0"}]


@pytest.mark.parametrize(
    "program, args, expected",
    [
        ("bench_env", ["--seconds", "-1"], "--seconds must be in (0, 3600]"),
        ("bench_env", ["--batch", "0"], "--batch: must be >= 1"),
        ("bench_env", ["--json", "{tmp}"], "is a directory, not a file"),
        ("bench_env", ["--batch", "99999999999999"], "num_envs must be in 1..16777216"),
        ("bench_serve_env", ["--envs", "4,x"], "--envs must be a comma list"),
        ("bench_serve_env", ["--cost", "{tmp}/none.json"], "does not exist"),
        ("bench_serve_env", ["--loads", "1,sideways"], "sideways"),
        ("bench_serve_env", ["--json", "{tmp}"], "is a directory, not a file"),
        # huge counts: an allocation's traceback ("array is too big") or minutes building what never runs
        ("bench_serve_env", ["--steps", str(1 << 62)], "--steps: must be in [1, 1048576]"),
        ("bench_serve_env", ["--envs", "4,100000"], "--envs: at most 65536 servers, got 100000"),
        ("bench_serve_env", ["--loads", ",,"], "--loads: names no load"),  # was: the default loads, silently
        ("bench_device_step", ["--rows", str(10**12)], "--rows: must be in [1, 4096]"),
        ("exactness", ["--workload", "{tmp}/none.jsonl"], "does not exist"),
        ("exactness", ["--arms", "ngram-d4,bogus-d2"], "unknown drafter 'bogus'"),
        ("exactness", ["--concurrency", "0"], "--concurrency: must be >= 1"),
        ("bench_device_step", ["--depths", "0,x"], "--depths must be a comma list"),
        ("bench_device_step", ["--depths", "4,40"], "--depths: at most 31, got 40"),
        ("bench_device_step", ["--rows", "0"], "--rows: must be in [1, 4096]"),
        ("bench_device_step", ["--json", "{tmp}"], "is a directory, not a file"),
        ("bench_device_step", ["--attention-merge", "fast"], "invalid choice: 'fast'"),
    ],
)
def test_the_other_env_programs_refuse_bad_input_in_one_line(
    program, args, expected, no_model, tmp_path, capsys
):
    """``bench_env``, ``bench_serve_env`` and ``exactness`` answered these with a traceback (a directory as
    ``--json`` after the whole measurement, a missing cost model or workload file)."""
    import importlib

    main = importlib.import_module(f"env.{program}").main
    code = main([a.replace("{tmp}", str(tmp_path)) for a in args])
    _one_line_error(capsys, code, expected)


@pytest.mark.model
def test_fidelity_runs_and_the_live_text_equals_the_trace():
    """``python -m env.fidelity`` ended in an AttributeError at its first prompt (it read a field the step object
    no longer has); n-gram arms replay exactly, so the live greedy text equals the recorded trajectory."""
    from env.fidelity import run

    out = run(prompts=1, max_new_tokens=8, progress=False)
    assert out["prompts"] == 1 and out["steps"] >= 1
    assert out["greedy_text_equal"] == 1 and out["tokens_exact"] == 1.0, out


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--qui"], "unrecognized arguments: --qui"),  # no abbreviations
        (["--json", "{tmp}"], "is a directory, not a file"),
        (["--json", "/proc/draftgym-bench.json"], "cannot write in /proc"),  # found before, not after the run
        (["--threads", "0"], "must be an integer in [1, 4096]"),
        (["--threads", "100000"], "must be an integer in [1, 4096]"),  # torch crashed on it
        (["--json", "{tmp}/questions.jsonl"], "exists and is not a JSON file; not overwritten"),
        (["--walk-warps", "4,3"], "must be a comma list of 1, 2, 4, 8, 16 or 32"),
        (["--greedy-settings", "4096:1024:4"], "must be a comma list of CHUNK:BLOCK:WARPS:WALK_WARPS"),
        (["--greedy-settings", "4096:8192:4:8"], "got '4096:8192:4:8'"),  # a block larger than its chunk
        (["--walk-warps", "4", "--greedy-settings", "4096:1024:4:8"], "give one"),
        (["--json", "{tmp}/" + "a" * 300 + ".json"], "File name too long"),  # a traceback
        (
            ["--json", "{tmp}/fifo.json"],
            "is not a regular file (a device, FIFO or socket)",
        ),  # would be replaced
    ],
)
def test_kernels_bench_refuses_bad_input_before_it_runs(args, expected, tmp_path, capsys, monkeypatch):
    """It took abbreviations and found a directory as ``--json`` only after the whole benchmark (a traceback)."""
    import kernels.bench as kb

    monkeypatch.setattr(
        kb, "run", lambda *a, **k: pytest.fail("the benchmark ran before its arguments were checked")
    )
    (tmp_path / "questions.jsonl").write_text('{"question_id": 1}\n{"question_id": 2}\n')
    os.mkfifo(tmp_path / "fifo.json")
    with pytest.raises(SystemExit) as exit_:
        kb.main([a.replace("{tmp}", str(tmp_path)) for a in args])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err, err


def test_bench_device_step_times_each_stage_and_writes_json(tmp_path, capsys, monkeypatch):
    """``python -m env.bench_device_step`` on a tiny random-weight shape, two rows: a row per depth with the step and
    its four stages, printed and written to ``--json`` with its provenance (the attention's merge included)."""
    from env.bench_device_step import main

    triton_attention = pytest.importorskip(
        "kernels.triton_attention", reason="the merge setting needs Triton"
    )
    monkeypatch.setattr(triton_attention, "MERGE", triton_attention.MERGE)  # restored after the test
    out = tmp_path / "step.json"
    code = main(["--model", "random:llama-tiny", "--depths", "0,3", "--rows", "2", "--context", "40", "--steps", "2",
                 "--reps", "2", "--attention-merge", "rows", "--json", str(out)])  # fmt: skip
    assert code == 0 and triton_attention.MERGE == "rows"
    doc = json.loads(out.read_text())
    assert [r["depth"] for r in doc["rows"]] == [0, 3] and doc["provenance"]["rows"] == 2
    assert doc["provenance"]["attention_merge"] == "rows"
    assert all(
        r[f"{k}_ms"] > 0 for r in doc["rows"] for k in ("step", "draft", "forward", "verify", "commit")
    )
    assert "| 3 |" in capsys.readouterr().out


def test_the_prefill_rows_run_the_lm_head_as_decoding_does():
    """Both prefill paths end the way decoding's prefill does, with the LM head at the prompt's last position only:
    the HF one had computed logits at every position (about 20% more work at 250 tokens than ``generate``'s
    prefill), the engine's none."""
    from env.batch import BatchTarget
    from env.bench_forward import engine_prefill, hf_prefill
    from env.model import load_model

    loaded, calls = load_model("random:llama-tiny", dtype="fp32", device="cpu"), []
    hook = loaded.model.lm_head.register_forward_hook(
        lambda m, i, o: calls.append(("hf", tuple(o.shape[:-1])))
    )
    try:
        hf_prefill(loaded, 20)()
    finally:
        hook.remove()
    assert calls == [("hf", (1, 1))]
    calls.clear()
    orig = BatchTarget.head

    def head(self, h):
        calls.append(("engine", tuple(h.shape[:-1])))
        return orig(self, h)

    BatchTarget.head = head
    try:
        engine_prefill(loaded, 20)()
    finally:
        BatchTarget.head = orig
    assert calls == [("engine", ())]


@pytest.mark.parametrize("dtype", ["auto", "fp32"])
def test_exactness_fails_a_wrong_token_whenever_it_loaded_fp32(dtype, monkeypatch, tmp_path):
    """``--dtype auto`` loads fp32 on a CPU without native bf16, where the contract is identical ids: it passed a
    wrong token there (the exit code read the flag, not the dtype loaded)."""
    import env.model
    import env.serving
    from env.exactness import main as exactness

    monkeypatch.setattr(env.model, "cpu_has_bf16", lambda: False)
    load = env.model.load_model
    monkeypatch.setattr(env.model, "load_model", lambda model=None, **k: load("random:llama-tiny", **k))
    serve = env.serving.serve

    def one_wrong_token(*a, **k):  # stands in for an engine bug
        out = serve(*a, **k)
        out[0].token_ids[-1] += 1
        return out

    monkeypatch.setattr(env.serving, "serve", one_wrong_token)
    work = tmp_path / "w.jsonl"
    work.write_text('{"question_id": 1, "category": "writing", "turns": ["Say hi."]}\n')
    args = ["--workload", str(work), "--max-new-tokens", "3", "--arms", "none", "--dtype", dtype]
    assert exactness(args) == 1


def test_kernels_bench_writes_each_row_as_it_is_measured(tmp_path, monkeypatch):
    """A kill midway keeps the rows measured (``complete`` false); a finished run says it is complete."""
    import json

    import kernels.bench as kb

    calls = []

    def fake_time(fn, *a, **k):  # a killed run: the fourth timing never returns
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return 10.0 + len(calls), 5

    monkeypatch.setattr(kb, "time_call", fake_time)
    out = tmp_path / "bench.json"
    with pytest.raises(KeyboardInterrupt):
        kb.main(["--quick", "--json", str(out)])
    doc = json.loads(out.read_text())
    assert doc["complete"] is False and [r["median_us"] for r in doc["rows"]] == [11.0, 12.0, 13.0]
    assert doc["provenance"]["command"].startswith("python -m kernels.bench --quick")
    row = dict(mode="greedy", B=1, N=8, V=49152, impl="torch", median_us=9.0, reps=3)

    def finished(dtype, quick, on_row=None):
        on_row([row])
        return [row]

    monkeypatch.setattr(kb, "run", finished)
    assert kb.main(["--quick", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["complete"] is True and doc["rows"] == [row]


@pytest.mark.parametrize(
    "program, args",
    [
        (
            "bench_forward",
            ["--model", "random:llama-tiny", "--weights", "dense", "--context", "9000", "--q", "1"],
        ),
        (
            "bench_forward",
            ["--model", "random:llama-tiny", "--weights", "dense", "--context", "8", "--prefill", "9000"],
        ),
        ("bench_batch", ["--rows", "1", "--context", "9000"]),
    ],
)
def test_a_context_past_the_models_is_refused_before_the_first_row(
    program, args, tmp_path, capsys, monkeypatch
):
    """The model's context was found too short by the first prefill, after the table's head was printed."""
    import importlib

    import env.model

    real = env.model.load_model
    monkeypatch.setattr(env.model, "load_model", lambda *a, **k: real("random:llama-tiny", dtype="fp32"))
    code = importlib.import_module(f"env.{program}").main([*args, "--dtype", "fp32", "--reps", "1"])
    got = capsys.readouterr()
    assert code == 2 and got.err.count("\n") == 1, got.err
    assert "positions exceed the model's context of 8192" in got.err and got.out == "", got
