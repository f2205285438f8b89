import json

import pytest

from env.workloads import WorkloadError, load_workload


def test_builtin_covers_the_spec_bench_groups():
    prompts = load_workload()
    cats = {p.category for p in prompts}
    assert cats == {"mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"}
    assert len(load_workload(per_category=1)) == 6


def test_mt_bench_subcategories_round_robin(tmp_path):
    f = tmp_path / "w.jsonl"
    rows = [
        {"question_id": i, "category": c, "turns": [f"q{i}"]}
        for i, c in enumerate(["writing"] * 3 + ["coding"] * 3)
    ]
    f.write_text("\n".join(json.dumps(r) for r in rows))
    got = load_workload(f, per_category=2)
    assert [p.prompt_id for p in got] == ["0", "3"] and {p.category for p in got} == {"mt_bench"}


def test_bad_workload_names_the_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"question_id": 1, "category": "qa", "turns": ["ok"]}\n{not json}\n')
    with pytest.raises(WorkloadError, match=":2:"):
        load_workload(f)
    with pytest.raises(WorkloadError, match="does not exist"):
        load_workload(tmp_path / "missing.jsonl")
