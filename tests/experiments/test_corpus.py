"""The eagle3 training corpus: which prompts and text it takes, and what it keeps out."""

from __future__ import annotations

import pytest

from env.workloads import WorkloadError, code_prompts, load_workload
from experiments.corpus import general_prompts, instruction_prompts, text_windows


def test_instruction_prompts_keep_mt_bench_and_the_benchmark_prompts_out():
    bench = {p.prompt_id for p in load_workload(None, per_category=2)}
    mt = {p.prompt_id for p in load_workload(None) if p.category == "mt_bench"}
    got = instruction_prompts(None, 2, code_limit=5, general_limit=7)
    ids = [pid for pid, _ in got]
    assert len(ids) == len(set(ids))
    assert not (set(ids) & bench) and not (set(ids) & mt)
    assert sum(pid.startswith("code-stdlib-") for pid in ids) == 5
    assert sum(pid.startswith("general-") for pid in ids) == 7
    assert all(text.strip() for _, text in got)


def test_code_prompts_are_deterministic_and_held_out_sources_differ():
    a, b = code_prompts("stdlib", limit=40), code_prompts("stdlib", limit=40)
    assert a == b and len(a) == 40
    assert all(t.startswith("Write a Python function `") for _, t in a)
    held = code_prompts("numpy", limit=40)
    assert held and not ({pid for pid, _ in held} & {pid for pid, _ in code_prompts("stdlib", limit=10_000)})


def test_code_workloads_and_their_errors():
    w = load_workload("code:numpy", per_category=3)
    assert [p.category for p in w] == ["code"] * 3
    with pytest.raises(WorkloadError, match="is not installed"):
        load_workload("code:no_such_package_here")
    with pytest.raises(WorkloadError, match="unknown categories"):
        load_workload("code:numpy", categories=["qa"])


def test_general_prompts_spread_over_templates_and_topics():
    g = general_prompts(20)
    assert len({pid for pid, _ in g}) == 20
    assert len({pid.split("-")[1] for pid, _ in g}) == 10  # every template among the first 20
    every = general_prompts(10_000)
    assert len(every) == 1400 == len({pid for pid, _ in every}) == len({text for _, text in every})
    # the first 500 are the ones a corpus answered before the later templates came (a rerun keeps their answers)
    assert every[499] == ("general-08-49", "Pretend you are a tour guide and talk about a snowstorm.")
    assert every[500][0] == "general-10-00" and every[:500] == general_prompts(500)


def test_text_windows_are_fixed_size_and_bounded():
    class Tok:
        def encode(self, text):
            return [ord(c) % 97 for c in text]

    w = list(text_windows(Tok(), 5000, window=256))
    assert sum(len(ids) for _, ids in w) >= 5000 > sum(len(ids) for _, ids in w[:-1])
    assert all(64 <= len(ids) <= 256 for _, ids in w)
    assert w == list(text_windows(Tok(), 5000, window=256))


def test_every_mt_bench_prompt_stays_out_not_only_the_benchmarks_first(tmp_path):
    """MT-bench is kept out whole (EAGLE's rule), whatever ``exclude_per_category`` takes of it; of the other
    categories, exactly their first ``exclude_per_category`` (the benchmark's) are kept out."""
    import json

    f = tmp_path / "w.jsonl"
    cats = ["writing", "coding", "writing", "math", "qa", "qa", "qa", "rag"]
    f.write_text("".join(json.dumps({"question_id": f"q{i}", "category": c, "turns": [f"Question {i}?"]}) + "\n"
                         for i, c in enumerate(cats)))  # fmt: skip
    got = instruction_prompts(str(f), 1, code_limit=0)
    assert got == [("q5", "Question 5?"), ("q6", "Question 6?")]
    assert [pid for pid, _ in instruction_prompts(str(f), 2, code_limit=0)] == ["q6"]
