"""``draftgym agreement`` reloads the prompts a bench ran from its ``bench.json`` settings: the workload and its
``--per-category`` (a ``code:`` workload's prompts are every k-th function of the source, k set by it). The model is
a stand-in (``tests.drafters.tiny``) and the records agree, so nothing is decoded."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from env.workloads import code_prompts
from experiments.errors import UserError
from experiments.records import Record


def _bench(run_dir, per_category, ids):
    run_dir.mkdir()
    settings = {"model": "tiny", "dtype": "float32", "workload": "code:stdlib", "per_category": per_category}
    (run_dir / "bench.json").write_text(json.dumps({"settings": settings}))
    recs = [Record(m, pid, "code", 4, 3, 0.1, 3, 1.0, [5, 6, 7]) for pid in ids for m in ("hf_greedy", "ar")]
    (run_dir / "records.jsonl").write_text("".join(json.dumps(asdict(r)) + "\n" for r in recs))


def test_a_code_workload_bench_with_per_category_is_read_with_it(tmp_path, monkeypatch):
    import env.model
    from experiments.agreement import agreement
    from tests.drafters.tiny import tiny_loaded

    monkeypatch.setattr(env.model, "load_model", lambda *a, **k: tiny_loaded())
    ids = [pid for pid, _ in code_prompts("stdlib", limit=5)]
    default = {pid for pid, _ in code_prompts("stdlib", limit=200)}  # load_workload's without --per-category
    assert set(ids) - default
    _bench(tmp_path / "run", 5, ids)
    out = agreement(tmp_path / "run", 0.25)
    assert out["rows"] == [{"method": "ar", "prompts": 5, "identical": 5, "divergences": []}]
    # a per_category that is not a count is not one: the default prompts, which do not hold these
    _bench(tmp_path / "other", True, ids)
    with pytest.raises(UserError, match="its records name prompts its workload code:stdlib does not hold"):
        agreement(tmp_path / "other", 0.25)


def test_the_programs_reading_a_run_load_its_random_weight_model_again(tmp_path):
    """A run of ``--model random:SHAPE`` records the id ``random-SHAPE``; ``agreement`` (and ``offline_tau``,
    ``env.fidelity``) load it again through ``model_spec`` (seeded weights: the same model), not as a folder."""
    from env.model import DEFAULT_MODEL, model_id_of, model_spec
    from experiments.agreement import agreement

    for spec in (None, "random:llama-tiny", "random:llama-8b", "some/folder"):
        assert model_spec(model_id_of(spec)) == spec
    assert model_spec(DEFAULT_MODEL) is None and model_spec("random-unknown") == "random-unknown"
    (tmp_path / "random-llama-tiny").mkdir()
    assert model_spec(str(tmp_path / "random-llama-tiny")) == str(tmp_path / "random-llama-tiny")
    run = tmp_path / "run"
    run.mkdir()
    settings = {
        "model": "random-llama-tiny",
        "dtype": "float32",
        "workload": "code:stdlib",
        "per_category": 1,
    }
    (run / "bench.json").write_text(json.dumps({"settings": settings}))
    pid = code_prompts("stdlib", limit=1)[0][0]
    recs = [Record(m, pid, "code", 4, 3, 0.1, 3, 1.0, [5, 6, 7]) for m in ("hf_greedy", "ar")]
    (run / "records.jsonl").write_text("".join(json.dumps(asdict(r)) + "\n" for r in recs))
    assert agreement(run, 0.25)["rows"][0]["identical"] == 1


@pytest.mark.parametrize(
    "damage, needle",
    [
        ('{"method": "ar", "prompt_id": "x"}\n', "line 5 is not a run record"),  # a method would vanish
        ("\xff garbage\n", "line 5 is not a run record"),
        (None, "line 5 records ar on"),  # a record twice would count a prompt twice
    ],
    ids=["fields-missing", "garbage", "twice"],
)
def test_damaged_records_are_named_not_left_out(tmp_path, damage, needle):
    from experiments.agreement import agreement

    ids = [pid for pid, _ in code_prompts("stdlib", limit=2)]
    run = tmp_path / "bench"
    _bench(run, 2, ids)
    lines = (run / "records.jsonl").read_text().splitlines(keepends=True)
    with (run / "records.jsonl").open("a") as fh:
        fh.write(lines[1] if damage is None else damage)
    with pytest.raises(UserError, match=needle):
        agreement(run, 0.05)
