"""``draftgym serve-bench`` end to end on the embedded model (fp32, tiny sizes): the documented JSON, the same
greedy tokens for every method of ours at every load, and a rerun that resumes from the finished cells."""

from __future__ import annotations

import json

import pytest

from experiments.cli import main
from experiments.serve_bench import split_methods

pytestmark = pytest.mark.model


def test_split_methods_keeps_mixes_whole():
    assert split_methods("ar, mix(none,ngram-d4),ngram-d8,") == ["ar", "mix(none,ngram-d4)", "ngram-d8"]


def test_serve_bench_writes_the_documented_json_and_resumes(tmp_path, capsys):
    out = tmp_path / "sb"
    methods = "ar,ngram-d4,mix(none,recycling-d2,ngram-d3-k2-b4),hf_batch"
    argv = ["serve-bench", "--limit", "3", "--concurrency", "1,2", "--methods", methods, "--max-new-tokens", "8",
            "--dtype", "fp32", "--out", str(out), "--json"]  # fmt: skip
    assert main(argv) == 0
    data = json.loads((out / "serve.json").read_text())
    assert {"settings", "provenance", "rows", "requests"} <= set(data)
    assert len(data["rows"]) == 4 * 2
    for r in data["rows"]:
        assert {"method", "concurrency", "goodput_tok_s", "tpot_ms_p50", "tpot_ms_p99", "ttft_ms_p50", "tau",
                "speedup_vs_ar"} <= set(r)  # fmt: skip
        assert r["goodput_tok_s"] > 0
    assert {r["speedup_vs_ar"] for r in data["rows"] if r["method"] == "ar"} == {1.0}
    reqs = data["requests"]
    assert len(reqs) == 3 * 4 * 2 and {"prompt_id", "method", "concurrency", "token_ids"} <= set(reqs[0])
    ours = {}
    for q in reqs:
        if q["method"] != "hf_batch":
            ours.setdefault(q["prompt_id"], set()).add(tuple(q["token_ids"]))
    assert all(len(v) == 1 for v in ours.values())  # every method, every load: the same greedy tokens
    mixed = {q["arm"] for q in reqs if q["method"].startswith("mix(")}
    assert mixed == {"none", "recycling-d2", "ngram-d3-k2-b4"}
    assert (out / "goodput.png").is_file()
    cells = (out / "cells.jsonl").read_text()
    capsys.readouterr()
    assert main(argv) == 0  # a rerun: every cell is done, nothing is served again
    assert (out / "cells.jsonl").read_text() == cells
    assert json.loads((out / "serve.json").read_text())["rows"] == data["rows"]
    capsys.readouterr()
    other = list(argv)  # --max-new-tokens 6: cells of 8 tokens must not be reused as its own
    other[other.index("--max-new-tokens") + 1] = "6"
    assert main(other) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and "other settings" in err[0] and "max_new_tokens" in err[0], err
    assert (out / "cells.jsonl").read_text() == cells
    settings = (out / "settings.json").read_text()  # started on another CPU: its timings are not this one's
    (out / "settings.json").write_text(
        json.dumps({**json.loads(settings), "cpu": "Other CPU (family 1 model 2)"})
    )
    assert main(argv) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and "cpu: 'Other CPU (family 1 model 2)' there" in err[0], err
    (out / "settings.json").write_text(settings)
    with (out / "cells.jsonl").open("a") as fh:  # a kill mid-append: the torn line is cut, the cells kept
        fh.write('{"method": "ar", "concu')
    assert main(argv) == 0
    assert (out / "cells.jsonl").read_text() == cells
    lines = cells.splitlines()  # a line that is JSON but no cell serve-bench wrote: one line naming it
    damages = [lambda c: c.pop("summary"), lambda c: c["summary"].update(goodput_tok_s="fast"),
               lambda c: c["summary"].update(tau=float("nan")), lambda c: c.pop("served"),
               lambda c: c["served"][0].update(token_ids="abc"), lambda c: c.update(concurrency=1.9),
               lambda c: c.update(concurrency=True), lambda c: c["summary"].pop("tpot_ms_p50"),
               lambda c: c["summary"].update(method=[1]), lambda c: c["summary"].update(concurrency="x")]  # fmt: skip
    for damage in damages:
        c = json.loads(lines[1])
        damage(c)
        (out / "cells.jsonl").write_text("\n".join([lines[0], json.dumps(c), *lines[2:]]) + "\n")
        capsys.readouterr()
        assert main(argv) == 2
        err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
        assert len(err) == 1 and "cells.jsonl: line 2 " in err[0] and "delete that line" in err[0], err
    (out / "cells.jsonl").write_text(cells)


def test_recorded_arrivals_and_chunked_prefill_serve_the_same_tokens(tmp_path, capsys):
    """Open loop from an arrival trace, prompts prefilled 16 tokens at a time: the same greedy tokens as closed
    loop with whole prefills; the settings and the time spent prefilling are in the JSON."""
    arrivals = tmp_path / "arrivals.txt"
    arrivals.write_text("0\n0.05\n0.3\n")
    runs = {}
    for name, extra in [("closed", []), ("open", ["--arrivals", str(arrivals), "--prefill-chunk", "16"])]:
        out = tmp_path / name
        argv = ["serve-bench", "--limit", "3", "--concurrency", "2", "--methods", "ar,ngram-d3", "--max-new-tokens",
                "8", "--dtype", "fp32", "--out", str(out), "--json", *extra]  # fmt: skip
        assert main(argv) == 0
        runs[name] = json.loads((out / "serve.json").read_text())
    s = runs["open"]["settings"]
    assert s["loop"] == "open" and s["prefill_chunk"] == 16 and s["arrivals"] == str(arrivals)
    assert all(r["prefill_s"] > 0 and r["mean_batch"] >= 1 for r in runs["open"]["rows"])

    def tokens(run):
        return sorted((q["method"], q["prompt_id"], tuple(q["token_ids"])) for q in run["requests"])

    assert tokens(runs["open"]) == tokens(runs["closed"])


def test_hf_batch_runs_under_the_batch_limit_of_the_other_methods(monkeypatch):
    """Under ``--max-batch 4`` at concurrency 16 every method serves at most 4 rows; HF's waves were 16 prompts."""
    from types import SimpleNamespace

    import experiments.serve_bench as sb

    waves = []
    monkeypatch.setattr(
        sb, "run_hf_batch", lambda loaded, prompts, rids, level, max_new: waves.append(level) or []
    )
    args = SimpleNamespace(max_batch=4, max_new_tokens=8)
    sb.run_cell(None, sb.HF_BATCH, 16, [[1]] * 16, [str(i) for i in range(16)], args, {})
    args.max_batch = None  # no limit: the concurrency
    sb.run_cell(None, sb.HF_BATCH, 16, [[1]] * 16, [str(i) for i in range(16)], args, {})
    assert waves == [4, 16]
