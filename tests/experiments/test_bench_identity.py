"""Greedy speculative output must equal AR output token for token (exact in fp32; in bf16 a batched verify rounds
differently from a single-token step). ``bench`` and ``run`` count, per greedy method, the prompts whose tokens
equal the AR loop's (``= AR`` in the table, ``identical_to_ar`` in the summary), and say loudly when a greedy
speculative method differs in fp32. Records are made by hand or generations stubbed: nothing is decoded."""

from __future__ import annotations

import json

import pytest

from experiments.bench import format_table, summarize
from experiments.records import Record


def _rec(method: str, pid: str, tokens: list[int]) -> Record:
    return Record(method, pid, "qa", 4, len(tokens), 0.1, len(tokens), 1.0, tokens)


def _records(ngram_second: list[int]) -> list[Record]:
    return [_rec("ar", "p1", [5, 6, 7]), _rec("ar", "p2", [8, 9]),
            _rec("ngram-d8", "p1", [5, 6, 7]), _rec("ngram-d8", "p2", ngram_second)]  # fmt: skip


def _overall(rows, method):
    return next(r for r in rows if r["category"] == "overall" and r["method"] == method)


def test_a_greedy_method_that_differs_from_ar_is_counted_and_warned_of_in_fp32():
    rows = summarize(_records([8, 10]), ["ar", "ngram-d8"])
    row = _overall(rows, "ngram-d8")
    assert (row["identical_to_ar"], row["compared_to_ar"], row["ar_reference"]) == (1, 2, "ar")
    assert _overall(rows, "ar")["identical_to_ar"] is None  # the reference itself
    table = format_table(rows).splitlines()
    assert table[0].rstrip().endswith("= AR")
    assert next(ln for ln in table if ln.startswith("overall") and "ngram" in ln).rstrip().endswith("1/2")
    from experiments.bench_summary import identity_notes

    (line,) = identity_notes(rows, "float32")
    assert line.startswith(
        "WARNING: in float32 greedy speculative output must equal AR output token for token"
    )
    assert "but ngram-d8 equals ar on 1 of 2 prompts: a bug" in line
    (note,) = identity_notes(rows, "bfloat16")  # agreement, not identity: a note, not a warning
    assert note.startswith("note: in bfloat16 ngram-d8 equals ar on 1 of 2 prompts") and "WARNING" not in note


def test_identical_output_has_no_note_and_sampling_is_not_compared():
    rows = summarize(_records([8, 9]), ["ar", "ngram-d8"])
    row = _overall(rows, "ngram-d8")
    assert (row["identical_to_ar"], row["compared_to_ar"]) == (2, 2)
    from experiments.bench_summary import identity_notes

    assert identity_notes(rows, "float32") == []
    sampled = summarize(_records([8, 10]), ["ar", "ngram-d8"], greedy=False)
    assert _overall(sampled, "ngram-d8")["identical_to_ar"] is None
    assert identity_notes(sampled, "float32", greedy=False) == []


def test_without_ar_hf_greedy_is_the_reference_and_without_either_a_note_says_so():
    recs = [_rec("hf_greedy", "p1", [5, 6]), _rec("ngram-d8", "p1", [5, 7])]
    rows = summarize(recs, ["hf_greedy", "ngram-d8"])
    assert _overall(rows, "ngram-d8")["ar_reference"] == "hf_greedy"
    assert format_table(rows).splitlines()[0].rstrip().endswith("= HF")
    from experiments.bench_summary import identity_notes

    assert "ngram-d8 equals hf_greedy on 0 of 1 prompts" in identity_notes(rows, "float32")[0]
    alone = summarize([_rec("ngram-d8", "p1", [5])], ["ngram-d8"])
    assert identity_notes(alone, "float32") == [
        "token identity not checked: neither ar nor hf_greedy (in the methods' target variant) was run"
    ]


def test_a_target_variant_is_compared_with_its_own_ar_loop():
    from experiments.bench_summary import ar_reference_of

    methods = ["ar", "ar@int4", "ngram-d8", "ngram-d8@int4", "ngram-d4@int8", "policy:best", "hf_pld"]
    assert ar_reference_of("ngram-d8@int4", methods) == "ar@int4"
    assert ar_reference_of("ngram-d4@int8", methods) is None  # no int8 AR loop: other weights, not compared
    assert ar_reference_of("ngram-d8", methods) == "ar"
    assert ar_reference_of("policy:best", methods) == "ar"
    assert ar_reference_of("hf_pld", methods) == "ar"
    assert ar_reference_of("ar", methods) is None and ar_reference_of("ar@int4", methods) is None


@pytest.fixture
def lossy_bench(tmp_path, monkeypatch):
    """``draftgym bench`` on a stand-in model whose ngram-d8 gets the second token wrong."""
    from types import SimpleNamespace

    import env.model
    import experiments.bench as bench

    class Tok:
        chat_template = None

        def __call__(self, text):
            return {"input_ids": [ord(c) % 97 for c in text[:12]]}

    loaded = SimpleNamespace(model_id="tiny", dtype="torch.float32", device="cpu", weights="dense", forward="lean",
                             tokenizer=Tok(), max_context=512, config=SimpleNamespace(vocab_size=64))  # fmt: skip
    monkeypatch.setattr(env.model, "load_model", lambda *a, **k: loaded)
    monkeypatch.setattr(bench, "arm_decoder", lambda *a, **k: SimpleNamespace(drafters={}))

    def run_method(method, loaded, decoders, prompt_ids, max_new_tokens, **kw):
        return ([5, 9, 7] if method == "ngram-d8" else [5, 6, 7]), 0.1, 3, 1.0, []

    monkeypatch.setattr(bench, "run_method", run_method)
    return [
        "bench",
        "--methods",
        "ar,ngram-d8",
        "--limit",
        "2",
        "--max-new-tokens",
        "3",
        "--out",
        str(tmp_path),
    ]


def test_bench_prints_the_identity_column_and_warns_in_fp32(lossy_bench, tmp_path, capsys):
    from experiments.cli import main

    assert main(lossy_bench) == 0
    out = capsys.readouterr().out
    assert "= AR" in out and "WARNING: in float32" in out and "ngram-d8 equals ar on 0 of 2 prompts" in out
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert _overall(saved["summary"], "ngram-d8")["identical_to_ar"] == 0
    assert any(n.startswith("WARNING") for n in saved["notes"])


def test_bench_json_warns_on_stderr(lossy_bench, capsys):
    from experiments.cli import main

    assert main([*lossy_bench, "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["summary"]
    assert captured.err.count("WARNING: in float32") == 1


def test_run_summary_counts_identity_and_warns(tmp_path):
    from env.workloads import Prompt
    from experiments.config import load_config
    from experiments.runner import finish

    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text('name = "t"\nmethods = ["ar", "ngram-d8"]\n[model]\ndtype = "fp32"\n')
    prompts = [Prompt("p1", "qa", "a"), Prompt("p2", "qa", "b")]
    result = finish(load_config(cfg_file), tmp_path, _records([8, 10]), prompts)
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert _overall(saved["summary"], "ngram-d8")["identical_to_ar"] == 1
    assert saved["notes"][0].startswith("WARNING: in float32")
    assert "1/2" in result["table"] and "WARNING" in result["table"]
    assert "WARNING: in float32" in (tmp_path / "summary.md").read_text()


def test_report_shows_the_summary_notes(tmp_path):
    from env.workloads import Prompt
    from experiments.cli import main
    from experiments.config import load_config
    from experiments.runner import finish, prepare_run_dir

    cfg = load_config(None, text='name = "t"\nmethods = ["ar", "ngram-d8"]\n[model]\ndtype = "fp32"\n')
    prepare_run_dir(cfg, tmp_path)
    prompts = [Prompt("p1", "qa", "a"), Prompt("p2", "qa", "b")]
    finish(cfg, tmp_path, _records([8, 10]), prompts)
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "r" / "report.md")]) == 0
    assert "- WARNING: in float32 greedy speculative output" in (tmp_path / "r" / "report.md").read_text()
