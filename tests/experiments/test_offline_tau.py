"""``experiments.offline_tau`` reads a bench's ``records.jsonl`` as data: the torn last line of a killed (or still
running) bench and lines that are not records are skipped, the file is left as it is, and a run without the ar
answers it needs is one line and exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest

from experiments.offline_tau import ar_answers
from experiments.records import Record

ROOT = Path(__file__).resolve().parents[2]


def _records(path: Path, tail: str) -> bytes:
    lines = [asdict(Record("ar", "p1", "qa", 4, 2, 0.1, 2, 1.0, [5, 6])),
             asdict(Record("ngram-d4", "p1", "qa", 4, 2, 0.1, 1, 2.0, [5, 6])),
             {"method": "ar", "prompt_id": "p2"},  # not a record: skipped
             asdict(Record("ar", "p3", "qa", 4, 1, 0.1, 1, 1.0, [7]))]  # fmt: skip
    data = ("".join(json.dumps(r) + "\n" for r in lines) + tail).encode()
    path.write_bytes(data)
    return data


def test_a_torn_last_line_is_skipped_and_the_file_left_as_it_is(tmp_path):
    path = tmp_path / "records.jsonl"
    data = _records(path, '{"method": "ar", "prompt_id": "p4", "token_')
    assert ar_answers(path) == {"p1": [5, 6], "p3": [7]}
    assert path.read_bytes() == data  # a bench may still be appending to it


def test_missing_answers_are_one_line_and_exit_2(tmp_path):
    _records(tmp_path / "records.jsonl", '{"method": "ar", "pro')
    r = subprocess.run([sys.executable, "-m", "experiments.offline_tau", str(tmp_path), "builtin", "1"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "has no ar answer to" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "experiments.offline_tau", str(tmp_path / "none"), "builtin"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)  # fmt: skip
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "cannot read" in r.stderr, r.stderr


def _run(run_dir: Path, settings: dict, ids: list[str], name: str = "bench.json") -> None:
    run_dir.mkdir(exist_ok=True)
    (run_dir / name).write_text(json.dumps({"settings": settings} if name == "bench.json" else settings))
    recs = [asdict(Record("ar", pid, "qa", 3, 3, 0.1, 3, 1.0, [5, 6, 5])) for pid in ids]
    (run_dir / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


@pytest.fixture
def no_model(monkeypatch):
    """No target: every prompt is the same three ids (the drafters read only the committed tokens)."""
    import env.decoder
    import env.model

    loaded = SimpleNamespace(tokenizer=None, config=SimpleNamespace(vocab_size=64))
    monkeypatch.setattr(env.model, "load_model", lambda *a, **k: loaded)
    monkeypatch.setattr(env.decoder, "chat_prompt", lambda tok, text: [1, 2, 3])


def test_a_workload_other_than_the_one_the_bench_ran_is_refused(tmp_path, monkeypatch, capsys, no_model):
    """The built-in set and a Spec-Bench file both have ids 1, 2, 3...: naming the wrong one would score the
    answers after other prompts' text. Compared as ``workload_identity`` gives them (a relative path is the file)."""
    from env.workloads import load_workload
    from experiments.offline_tau import main

    spec = tmp_path / "question.jsonl"
    spec.write_text("".join(json.dumps({"question_id": i, "category": "qa", "turns": [f"q{i}?"]}) + "\n"
                            for i in (1, 2)))  # fmt: skip
    ids = [p.prompt_id for p in load_workload(None)]
    assert {"1", "2"} <= set(ids)
    _run(tmp_path / "run", {"model": "m", "workload": str(spec), "per_category": None}, ids)
    assert main([str(tmp_path / "run"), "builtin"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"on workload {spec.resolve()}, not builtin" in err, err
    monkeypatch.chdir(tmp_path)
    assert main([str(tmp_path / "run"), "question.jsonl"]) == 0  # the same file, named relative to here
    # the folder's settings.json (resolved when the bench ran) is the record when there is one
    _run(tmp_path / "run", {"workload": "builtin"}, ids, name="settings.json")
    assert main([str(tmp_path / "run"), "question.jsonl"]) == 2
    assert f"on workload builtin, not {spec.resolve()}" in capsys.readouterr().err
    assert main([str(tmp_path / "run"), "builtin"]) == 0


def test_a_bench_run_with_limit_is_scored_on_the_prompts_it_ran(tmp_path, capsys, no_model):
    """``bench --limit 2`` records ``settings.prompts: 2`` and answers only the first two prompts: those are scored
    (it was refused, pointing at --per-category); with fewer answers than it says, the run is still refused."""
    from env.workloads import load_workload
    from experiments.offline_tau import main

    first = [p.prompt_id for p in load_workload(None)[:2]]
    _run(tmp_path, {"model": "m", "workload": "builtin", "per_category": None, "prompts": 2}, first)
    assert main([str(tmp_path), "builtin"]) == 0, capsys.readouterr().err
    assert "| overall |" in capsys.readouterr().out
    _run(tmp_path, {"model": "m", "workload": "builtin", "per_category": None, "prompts": 3}, first)
    assert main([str(tmp_path), "builtin"]) == 2
    assert "has no ar answer to 1 of 3 prompts" in capsys.readouterr().err


def test_an_answer_holding_an_id_outside_the_vocabulary_is_one_line(tmp_path, capsys, no_model):
    """A hand-edited record's ids past the model's vocabulary (2**63 overflowed deep in a drafter) are refused."""
    from env.workloads import load_workload
    from experiments.offline_tau import main

    ids = [p.prompt_id for p in load_workload(None)]
    _run(tmp_path, {"model": "m", "workload": "builtin", "per_category": None}, ids)
    recs = [json.loads(x) for x in (tmp_path / "records.jsonl").read_text().splitlines()]
    recs[1]["token_ids"] = [5, 2**63, 5]  # (as many as its new_tokens)
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert main([str(tmp_path), "builtin"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "outside the model's vocabulary of 64" in err, err
