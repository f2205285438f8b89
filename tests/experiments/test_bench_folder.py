"""``draftgym bench`` (and ``evaluate``'s live part) name their run folder before any work, with how to resume a
killed run there (the default folder is timestamped: without the line a user cannot find it again); the progress
bar of a narrower rerun counts only the records of this run's prompts and methods.

The model is a stand-in (a tokenizer and the attributes the records' settings name): nothing is decoded."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest

import experiments.bench as bench
from env.workloads import Prompt
from experiments.cli import main
from experiments.records import Record


class _Tokenizer:
    chat_template = None

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) % 97 for c in text[:12]]}


def _loaded() -> SimpleNamespace:
    return SimpleNamespace(model_id="tiny", dtype="torch.float32", device="cpu", weights="dense", forward="lean",
                           tokenizer=_Tokenizer(), max_context=512, config=SimpleNamespace(vocab_size=64))  # fmt: skip


class _Killed(Exception):
    pass


def test_bench_names_its_default_folder_before_any_work(tmp_path, monkeypatch, capsys):
    import env.model

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(env.model, "load_model", lambda *a, **k: _loaded())
    monkeypatch.setattr(bench, "arm_decoder", lambda *a, **k: SimpleNamespace(drafters={}))

    def killed(*a, **k):  # the first generation (the warm-up): the run dies there
        raise _Killed

    monkeypatch.setattr(bench, "run_method", killed)
    with pytest.raises(_Killed):
        main(["bench", "--methods", "ar", "--limit", "1", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    (folder,) = list((tmp_path / "runs").iterdir())
    assert folder.name.startswith("bench-")
    out = Path("runs") / folder.name
    lines = [line for line in err.splitlines() if str(out) in line]
    assert lines == [f"draftgym bench: results in {out}/ (if it stops, rerun with --out {out} to resume)"]


def test_the_progress_bar_counts_only_this_runs_records(tmp_path, monkeypatch):
    prompts = [Prompt("p1", "qa", "Say hello."), Prompt("p2", "qa", "Say goodbye.")]
    done = [("ar", "p1"), ("ar", "p2"), ("ngram-d8", "p1"), ("ngram-d8", "p2"), ("hf_greedy", "p1")]
    with (tmp_path / "records.jsonl").open("w") as fh:
        for m, pid in done:
            fh.write(json.dumps(asdict(Record(m, pid, "qa", 4, 2, 0.1, 2, 1.0, [1, 2]))) + "\n")
    bars = []

    class Bar:
        def __init__(self, **kwargs):
            bars.append(kwargs)

        def update(self, n):
            pass

        def close(self):
            pass

    monkeypatch.setattr(bench, "tqdm", Bar)
    decoders = {"ar": object(), "ngram-d8": object()}
    result = bench.run_bench(_loaded(), prompts[:1], ["ar"], max_new_tokens=2, out_dir=tmp_path, settings={},
                             decoders=decoders)  # fmt: skip
    assert (bars[0]["initial"], bars[0]["total"]) == (1, 1)  # not the 5 records of the folder
    assert [r["prompts"] for r in result["summary"] if r["category"] == "overall"] == [1]


@pytest.mark.model
def test_evaluate_names_its_live_folder_before_any_work(tmp_path, monkeypatch, fp32_model):
    from experiments.policy_commands import evaluate, shipped_policy_paths

    monkeypatch.chdir(tmp_path)
    seen = {}

    def fake_run_bench(loaded, prompts, methods, *, out_dir, start_note=None, **kwargs):
        seen.update(out_dir=out_dir, start_note=start_note)
        return {"summary": []}

    monkeypatch.setattr(bench, "run_bench", fake_run_bench)
    paths = [p for p in shipped_policy_paths() if p.stem == "best-static"]
    evaluate(paths, live=True, loaded=fp32_model, max_new_tokens=2, live_limit=1, progress=False)
    out = seen["out_dir"]
    assert str(out).startswith("runs/evaluate-")
    assert (
        seen["start_note"]
        == f"draftgym evaluate: results in {out}/ (if it stops, rerun with --out {out} to resume)"
    )


@pytest.fixture
def killed_bench(tmp_path, monkeypatch, capsys):
    """``resumed(argv, change, key)``: a bench killed at its first timed method, one prompt measured before the
    kill, resumed once unchanged (and killed again), then after ``change()``: refused in one line naming ``key``."""
    import env.model

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(env.model, "load_model", lambda *a, **k: _loaded())
    monkeypatch.setattr(bench, "arm_decoder", lambda *a, **k: SimpleNamespace(drafters={}))

    def killed(*a, **k):
        raise _Killed

    monkeypatch.setattr(bench, "run_method", killed)

    def resumed(argv: list[str], change, key: str) -> None:
        argv = ["bench", "--methods", "ar", "--max-new-tokens", "2", "--out", "runs/b", *argv]
        with pytest.raises(_Killed):
            main(argv)
        with (tmp_path / "runs" / "b" / "records.jsonl").open("w") as fh:  # a prompt measured before the kill
            fh.write(json.dumps(asdict(Record("ar", "1", "qa", 4, 2, 0.1, 2, 1.0, [1, 2]))) + "\n")
        with pytest.raises(_Killed):  # unchanged: resumed
            main(argv)
        change()
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and key in err, err

    return resumed


def test_a_resume_on_an_edited_workload_file_is_refused(tmp_path, killed_bench):
    """The same path with other prompts under the same ids would mix answers to two prompt sets in one table."""
    wl = tmp_path / "prompts.jsonl"
    rows = [
        {"question_id": i, "category": "qa", "turns": [t]} for i, t in ((1, "Say hello."), (2, "Say hi."))
    ]
    wl.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def edit() -> None:  # prompt 1, measured, now means another prompt
        rows[0]["turns"] = ["Say goodbye."]
        wl.write_text("".join(json.dumps(r) + "\n" for r in rows))

    killed_bench(["--workload", str(wl)], edit, "workload_sha256")


def test_a_resume_on_changed_built_in_prompts_is_refused(monkeypatch, killed_bench):
    """A workload without a file of the user's (the built-in set, a ``code:`` source read from a package's
    docstrings) has no file to hash: its prompts are, so a text changed under the same id is not resumed."""
    import env.workloads

    text = ["Say hello."]
    prompts = lambda *a, **k: [Prompt("1", "qa", text[0]), Prompt("2", "qa", "Say hi.")]  # noqa: E731
    monkeypatch.setattr(env.workloads, "load_workload", prompts)
    killed_bench(
        [], lambda: text.__setitem__(0, "Say goodbye."), "workload_prompts_sha256"
    )  # a package upgrade


def test_a_method_that_stopped_early_is_compared_on_the_prompts_it_finished():
    """llama.cpp's worker dying at prompt 2 of 4 left its "x HF" a ratio of 2 prompts' tokens/s over 4 others':
    a speedup now compares the two methods on the prompts both finished."""
    from experiments.bench import summarize
    from experiments.records import Record

    def rec(m, i, s):  # 100 tokens in s seconds
        return Record(m, f"p{i}", "qa", 10, 100, s, 100, 1.0, [1] * 100)

    slow_late = [
        rec("hf_greedy", i, s) for i, s in enumerate([1.0, 1.0, 4.0, 4.0])
    ]  # later prompts are slower
    early = [rec("llama_cpp", i, 0.5) for i in range(2)]  # twice as fast on the two prompts it ran
    rows = {
        r["method"]: r
        for r in summarize(slow_late + early, ["hf_greedy", "llama_cpp"])
        if r["category"] == "overall"
    }
    assert rows["llama_cpp"]["speedup_vs_hf"] == pytest.approx(2.0)  # not 200/1 over 400/10 = 5x
    assert rows["hf_greedy"]["speedup_vs_hf"] == pytest.approx(1.0) and rows["llama_cpp"]["prompts"] == 2


def test_hf_static_warms_every_cache_size_the_prompts_reach():
    """hf_static and hf_compile size their static cache in 256-position buckets; the warm-up built only the first,
    so a longer prompt recompiled inside the timed region. One warm-up prompt per further bucket now."""
    from experiments.hf_baselines import bucket_warmup_lengths

    assert bucket_warmup_lengths({100, 300, 700}, 128, 20) == [
        257,
        769,
    ]  # buckets 2 (428 positions) and 4 (828)
    assert bucket_warmup_lengths({20, 60}, 128, 20) == []  # all in the first, which the warm-up built
    for n in bucket_warmup_lengths({1000}, 512, 20):
        assert -(-(n + 4) // 256) == -(-(1000 + 512) // 256)


def test_the_median_speedup_weighs_every_prompt_alike():
    """``x AR`` is the ratio of aggregate tokens/s, which a long slow prompt dominates; ``median_speedup_vs_ar`` is
    the median of the per-prompt ratios on the prompts both methods ran."""
    from experiments.bench import format_table, summarize
    from experiments.records import Record

    def rec(m, i, s):  # 100 tokens in s seconds
        return Record(m, f"p{i}", "qa", 10, 100, s, 100, 1.0, [1] * 100)

    ar = [rec("ar", i, s) for i, s in enumerate([1.0, 1.0, 1.0, 10.0])]
    fast = [rec("ngram-d4", i, s) for i, s in enumerate([0.5, 0.5, 0.5, 10.0, 0.0])]  # p4: no ar to pair with
    ar.append(rec("ar", 5, 1.0))
    fast.append(rec("ngram-d4", 5, 0.0))  # timed at 0 s: compares nothing (not a 0x or infinite speedup)
    rows = {r["method"]: r for r in summarize(ar + fast, ["ar", "ngram-d4"]) if r["category"] == "overall"}
    assert rows["ngram-d4"]["median_speedup_vs_ar"] == pytest.approx(2.0)  # per prompt: 2, 2, 2, 1
    assert rows["ngram-d4"]["speedup_vs_ar"] == pytest.approx(
        500 / 11.5 / (500 / 14.0)
    )  # the long prompt weighs
    assert rows["ar"]["median_speedup_vs_ar"] == pytest.approx(1.0)
    assert "med x AR" in format_table(list(rows.values())).splitlines()[0]


def test_a_resume_on_records_holding_a_prompt_twice_is_refused(tmp_path, killed_bench):
    """Two records of one (method, prompt) were both counted: 2 prompts and 2/2 identical for a one-prompt run."""

    def duplicate() -> None:
        rec = tmp_path / "runs" / "b" / "records.jsonl"
        rec.write_text(rec.read_text() * 2)

    killed_bench([], duplicate, "records ar on 1 a second time")


def test_the_resume_line_quotes_a_folder_the_shell_would_split():
    """``rerun with --out with space`` pasted back named the folder ``with`` and an argument ``space``."""
    from experiments.bench import resume_note

    assert resume_note("bench", Path("runs/with space")).endswith(
        "rerun with --out 'runs/with space' to resume)"
    )
    assert resume_note("bench", Path("runs/plain")).endswith("rerun with --out runs/plain to resume)")
