"""A drafter head retrained or swapped under its file name between two runs into one folder is refused by every
command whose results it decides, naming the head (``drafter_head.NAME``: ``experiments.records.head_identity``):
``bench`` and ``serve-bench`` (their settings), a live ``sweep`` (its study's input files), ``record`` (its trace
header's ``heads``). Before, only ``run`` checked: the others reused the old head's results beside the new one's."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

import experiments.bench as bench
from experiments.errors import UserError
from tests.experiments.test_bench_folder import _loaded
from tests.experiments.test_bench_sessions import PROMPTS, _stub_generation


@pytest.fixture(scope="module")
def tiny():
    from env.model import load_model

    return load_model("random:llama-tiny", dtype="fp32", device="cpu")


def test_method_drafters_and_head_identity(tmp_path, monkeypatch):
    from drafters.heads import cache_heads_dir, head_name
    from experiments.records import head_identity, method_drafters

    assert method_drafters(
        ["ar", "hf_greedy", "llama_cpp", "ngram-d3", "eagle-d2-k2@int8", "policy:p", "none"]
    ) == [
        "eagle",
        "ngram",
    ]
    monkeypatch.setenv("DRAFTGYM_CACHE", str(tmp_path / "cache"))
    cache_heads_dir().mkdir(parents=True)
    (cache_heads_dir() / f"{head_name('eagle3', 'm')}.safetensors").write_bytes(b"three")
    (tmp_path / "given.safetensors").write_bytes(b"given")
    opts = {
        "early_exit": {"weights": str(tmp_path / "given.safetensors")},
        "hybrid": {"parts": "suffix,eagle3"},
    }
    sha = lambda b: hashlib.sha256(b).hexdigest()  # noqa: E731
    # eagle has no head for model m: left out (its drafter says so when it loads); ngram has none to find
    assert head_identity(["eagle", "early_exit", "hybrid", "ngram"], opts, "m") == {
        "drafter_head.early_exit": sha(b"given"),
        "drafter_head.hybrid.eagle3": sha(b"three"),
    }


def test_bench_refuses_a_head_swapped_under_its_file_name(tmp_path, monkeypatch):
    _stub_generation(monkeypatch)
    head = tmp_path / "h.safetensors"
    head.write_bytes(b"first head")
    go = dict(max_new_tokens=3, out_dir=tmp_path / "b", settings={}, progress=False,
              decoders={m: object() for m in ("ar", "eagle-d2")}, drafter_options={"eagle": {"weights": str(head)}})  # fmt: skip
    bench.run_bench(_loaded(), PROMPTS[:2], ["ar", "eagle-d2"], **go)
    saved = json.loads((tmp_path / "b" / "settings.json").read_text())
    assert saved["drafter_head.eagle"] == hashlib.sha256(b"first head").hexdigest()
    head.write_bytes(b"another head")
    with pytest.raises(
        UserError, match=r"drafter_head\.eagle: sha256 [0-9a-f]{12}… there, sha256 [0-9a-f]{12}… now"
    ):
        bench.run_bench(_loaded(), PROMPTS, ["ar", "eagle-d2"], **go)  # (two prompts more: none was run)
    assert len((tmp_path / "b" / "records.jsonl").read_text().splitlines()) == 4
    head.write_bytes(b"first head")
    bench.run_bench(_loaded(), PROMPTS, ["ar", "eagle-d2"], **go)  # the head the records were made with
    assert len((tmp_path / "b" / "records.jsonl").read_text().splitlines()) == 8
    # a resume may leave the method out (and add it back): its head is not compared then, and the folder keeps
    # it, so a swap while it was left out is still refused when it comes back
    bench.run_bench(_loaded(), PROMPTS, ["ar"], **go)
    assert (
        json.loads((tmp_path / "b" / "settings.json").read_text())["drafter_head.eagle"]
        == saved["drafter_head.eagle"]
    )
    head.write_bytes(b"another head")
    bench.run_bench(_loaded(), PROMPTS, ["ar"], **go)
    with pytest.raises(UserError, match=r"drafter_head\.eagle: sha256"):
        bench.run_bench(_loaded(), PROMPTS, ["ar", "eagle-d2"], **go)


def test_serve_bench_refuses_a_head_swapped_under_its_file_name(tmp_path, tiny, capsys):
    from experiments.cli import main
    from tests.drafters.tiny import random_head

    head = random_head("eagle", tiny, tmp_path / "h.safetensors", seed=1)
    first, desc = head.read_bytes(), head.with_suffix(".json").read_bytes()
    argv = ["serve-bench", "--model", "random:llama-tiny", "--dtype", "fp32", "--limit", "1", "--methods",
            "ar,eagle-d2", "--max-new-tokens", "3", "--drafter-option", f'eagle.weights="{head}"', "--out",
            str(tmp_path / "sb"), "--json"]  # fmt: skip
    assert main([*argv, "--concurrency", "1"]) == 0
    random_head("eagle", tiny, head, seed=2)  # retrained under the same name
    capsys.readouterr()
    assert (
        main([*argv, "--concurrency", "1,2"]) == 2
    )  # a level more: it would serve the new head beside the old
    err = capsys.readouterr().err
    assert "drafter_head.eagle: sha256" in err and err.count("\n") == 1, err
    head.write_bytes(first)  # the head the results were made with (both its files)
    head.with_suffix(".json").write_bytes(desc)
    assert main([*argv, "--concurrency", "1,2"]) == 0


def test_a_live_sweep_refuses_to_resume_with_another_head(tmp_path):
    from experiments.config import ConfigError, load_config
    from experiments.sweep_checks import check_resumed, input_digests

    head = tmp_path / "h.safetensors"
    head.write_bytes(b"first head")
    text = f"""name = "s"
methods = ["ar", "eagle-d2"]
[drafters.eagle]
weights = "{head}"
[sweep]
method = "eagle-d2"
drafters = ["eagle"]
backend = "{{backend}}"
"""
    cfg = load_config(None, text=text.format(backend="live"))
    inputs = input_digests(cfg)
    assert inputs["drafter_head.eagle"] == hashlib.sha256(b"first head").hexdigest()
    assert "drafter_head.eagle" not in input_digests(load_config(None, text=text.format(backend="analytic")))

    class Study:
        user_attrs = {"config": text.format(backend="live"), "inputs": inputs}

    check_resumed(Study(), cfg, "study 's'")
    head.write_bytes(b"another head")
    with pytest.raises(
        ConfigError, match=r"other input files \(drafter_head\.eagle changed since\).*another --out"
    ):
        check_resumed(Study(), cfg, "study 's'")


def test_a_recording_is_not_resumed_with_another_head(tiny, tmp_path, monkeypatch):
    import env.trace_record as trace_mod
    from env.trace import TraceError
    from env.trace_record import record
    from tests.drafters.tiny import random_head
    from tests.env.kills import dies_on_call

    head = random_head("eagle", tiny, tmp_path / "h.safetensors", seed=1)
    first, desc = head.read_bytes(), head.with_suffix(".json").read_bytes()
    go = dict(max_new_tokens=3, progress=False, drafter_options={"eagle": {"weights": str(head)}})
    out = tmp_path / "t.npz"
    real = trace_mod.record_prompt
    monkeypatch.setattr(trace_mod, "record_prompt", dies_on_call(2, real))
    with pytest.raises(KeyboardInterrupt):
        record(tiny, PROMPTS[:3], ["eagle"], out, **go)
    monkeypatch.setattr(trace_mod, "record_prompt", real)
    random_head("eagle", tiny, head, seed=2)
    with pytest.raises(TraceError, match=r"partial recording with other settings \(heads \(eagle\) differ"):
        record(tiny, PROMPTS[:3], ["eagle"], out, **go)
    head.write_bytes(first)  # the head the results were made with (both its files)
    head.with_suffix(".json").write_bytes(desc)
    trace = record(tiny, PROMPTS[:3], ["eagle"], out, **go)
    assert trace.header["heads"] == {"eagle": hashlib.sha256(first).hexdigest()} and trace.num_prompts == 3
    random_head("eagle", tiny, head, seed=2)
    with pytest.raises(TraceError, match=r"already holds a trace of other settings \(heads \(eagle\) differ"):
        record(tiny, PROMPTS[:3], ["eagle"], out, **go)
    assert Path(out).is_file()


def test_evaluate_notes_a_trace_recorded_with_other_heads(tmp_path):
    """``evaluate`` (live) and ``evaluate --serve`` serve the trace's drafters; a head file changed since the trace
    was recorded is noted (replay priced one head, live serves another)."""
    from experiments.records import trace_heads_note

    head = tmp_path / "h.safetensors"
    head.write_bytes(b"recorded")
    header = {
        "drafters": {"eagle": {}, "ngram": {}},
        "heads": {"eagle": hashlib.sha256(b"recorded").hexdigest()},
    }
    options = {"eagle": {"weights": str(head)}}
    assert trace_heads_note(header, options, "m") is None
    assert trace_heads_note({"drafters": {"eagle": {}}}, options, "m") is None  # recorded before the key
    head.write_bytes(b"retrained")
    note = trace_heads_note(header, options, "m")
    assert note.startswith("note: live serves other head files than the trace recorded (eagle)"), note
