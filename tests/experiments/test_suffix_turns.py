"""``experiments.suffix_turns``'s answer cache: answers are saved as they finish (a kill keeps them), with the
settings they were made with (a rerun with others is refused in one line) and their prompt's digest (an answer to
another prompt is made again). Serving is stubbed: the cache's handling is under test, not the model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments.errors import UserError
from experiments.suffix_turns import AnswerCache, _answer

SETTINGS = {"model": "m", "dtype": "bfloat16", "weights": "dense", "max_new_tokens": 8}
VOCAB = 96


@pytest.fixture
def fake_serve(monkeypatch):
    """serve() answering each request with its prompt reversed; a kill (KeyboardInterrupt) after ``kill_after``."""
    import env.batch
    import env.serving

    state = {"kill_after": None, "served": []}

    def serve(engine, reqs, concurrency, on_finish):
        for r in reqs:
            if len(state["served"]) == state["kill_after"]:
                raise KeyboardInterrupt
            state["served"].append(r.rid)
            on_finish(type("Served", (), {"rid": r.rid, "token_ids": r.prompt_ids[::-1]})())

    monkeypatch.setattr(env.serving, "serve", serve)
    monkeypatch.setattr(env.batch, "BatchEngine", lambda *a, **k: None)
    return state


def test_answers_are_saved_as_they_finish_and_a_rerun_makes_only_the_rest(fake_serve, tmp_path):
    path = tmp_path / "answers.json"
    prompts = {"q1/1": [1, 2], "q2/1": [3, 4], "q3/1": [5, 6]}
    fake_serve["kill_after"] = 2
    with pytest.raises(KeyboardInterrupt):
        _answer(None, prompts, 8, 2, AnswerCache(path, SETTINGS, VOCAB, 8), "turn 1")
    doc = json.loads(path.read_text())
    assert doc["settings"] == SETTINGS and sorted(doc["answers"]) == ["q1/1", "q2/1"]
    fake_serve["kill_after"], fake_serve["served"] = None, []
    cache = AnswerCache(path, SETTINGS, VOCAB, 8)
    _answer(None, prompts, 8, 2, cache, "turn 1")
    assert fake_serve["served"] == ["q3/1"]
    assert [cache.get(k, v) for k, v in prompts.items()] == [[2, 1], [4, 3], [6, 5]]
    # an answer to another prompt under the same key is made again
    fake_serve["served"] = []
    _answer(None, {**prompts, "q2/1": [3, 4, 7]}, 8, 2, AnswerCache(path, SETTINGS, VOCAB, 8), "turn 1")
    assert fake_serve["served"] == ["q2/1"]


def test_answers_of_other_settings_are_refused_in_one_line(tmp_path):
    path = tmp_path / "answers.json"
    AnswerCache(path, SETTINGS, VOCAB, 8).put("q1/1", [1], [2])
    for change in ({"dtype": "float32"}, {"max_new_tokens": 16}, {"model": "other"}, {"weights": "int4"}):
        key = next(iter(change))
        with pytest.raises(UserError, match=f"other settings \\({key}: .* there, .* now\\)") as err:
            AnswerCache(path, {**SETTINGS, **change}, VOCAB, 8)
        assert "\n" not in str(err.value)
    assert AnswerCache(path, SETTINGS, VOCAB, 8).get("q1/1", [1]) == [2]
    path.write_text(json.dumps({"q1/1": [2]}))  # a cache of an earlier version: no settings to compare
    with pytest.raises(UserError, match="without the settings"):
        AnswerCache(path, SETTINGS, VOCAB, 8)


def test_question_lines_are_checked_as_the_workload_loader_checks_them(tmp_path):
    """A string for ``turns`` (read letter by letter), an empty or non-string second turn, a question id used
    twice (one question lost) and a lone surrogate are each refused in one line naming the line."""
    import json

    import pytest

    from env.workloads import WorkloadError
    from experiments.suffix_turns import _turns

    good = {"category": "writing", "turns": ["First?", "Second?"], "question_id": 1}
    f = tmp_path / "w.jsonl"
    f.write_text(json.dumps(good) + "\n" + json.dumps({**good, "question_id": 2, "category": "qa"}) + "\n")
    assert _turns(str(f)) == [("1", "First?", "Second?")]
    bad = [
        ([{**good, "turns": "ab"}], ":1: .*turns are not a list"),
        ([{**good, "turns": ["First?", ""]}], ":1: .*turns are not a list of non-empty strings"),
        ([{**good, "turns": ["First?", 7]}], ":1: .*turns are not a list"),
        ([good, good], ":2: question_id 1 already used on line 1"),
        ([{**good, "question_id": True}], ":1: .*question_id"),
    ]
    for rows, match in bad:
        f.write_text("".join(json.dumps(r) + "\n" for r in rows))
        with pytest.raises(WorkloadError, match=match) as err:
            _turns(str(f))
        assert "\n" not in str(err.value)
    f.write_text('{"category": "writing", "turns": ["\\ud800", "x"], "question_id": 1}\n')
    with pytest.raises(WorkloadError, match=":1: not a Spec-Bench question line"):
        _turns(str(f))


def test_an_answer_holding_an_id_outside_the_vocabulary_is_made_again(fake_serve, tmp_path):
    """A hand-edited ``answers.json`` with an id >= the target's vocabulary (which ``tok.decode`` cannot take: an
    OverflowError for 10**20) is no answer: it is generated again, as an answer with a negative id is."""
    path = tmp_path / "answers.json"
    cache = AnswerCache(path, SETTINGS, VOCAB, 8)
    prompts = {"q1/1": [1, 2], "q2/1": [3, 4], "q3/1": [5, 6], "q4/1": [7, 8]}
    for key, ids in zip(prompts, ([VOCAB - 1, 0], [5, VOCAB], [10**20], [-1])):
        cache.put(key, prompts[key], ids)
    cache = AnswerCache(path, SETTINGS, VOCAB, 8)
    assert [cache.get(k, v) for k, v in prompts.items()] == [[VOCAB - 1, 0], None, None, None]
    _answer(None, prompts, 8, 2, cache, "turn 1")
    assert fake_serve["served"] == ["q2/1", "q3/1", "q4/1"]
    assert [cache.get(k, v) for k, v in prompts.items()] == [[VOCAB - 1, 0], [4, 3], [6, 5], [8, 7]]


def test_an_answer_longer_than_the_new_tokens_is_made_again(tmp_path):
    """A hand-edited answer of 9,000 ids was used with --max-new-tokens 4: the turns were scored on it."""
    path = tmp_path / "answers.json"
    first = AnswerCache(path, SETTINGS, VOCAB, 8)
    first.put("q1/1", [1], [2] * 9)
    first.put("q2/1", [1], [2] * 8)
    cache = AnswerCache(path, SETTINGS, VOCAB, 8)
    assert cache.get("q1/1", [1]) is None and cache.get("q2/1", [1]) == [2] * 8


def test_a_category_that_is_not_a_name_is_refused_in_one_line(tmp_path):
    """A category that is a list (unhashable: ``cat in MT_BENCH`` raised a TypeError), a number or blank is refused
    as ``env.workloads.load_workload`` refuses it: one line naming the line, and exit code 2 from the program."""
    import subprocess
    import sys

    from env.workloads import WorkloadError, load_workload
    from experiments.suffix_turns import _turns

    f = tmp_path / "w.jsonl"
    for cat in (["writing"], {"writing": 1}, 7, " ", None):
        f.write_text(json.dumps({"question_id": 1, "category": cat, "turns": ["a", "b"]}) + "\n")
        for read in (_turns, load_workload):
            with pytest.raises(
                WorkloadError, match=":1: not a Spec-Bench question line .*category is not a name"
            ):
                read(str(f))
    f.write_text(json.dumps({"question_id": 1, "category": ["writing"], "turns": ["a", "b"]}) + "\n")
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-m", "experiments.suffix_turns", "--workload", str(f),
                        "--out", str(tmp_path / "out")], capture_output=True, text=True, cwd=root, timeout=300)  # fmt: skip
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "category is not a name" in r.stderr and "Traceback" not in r.stderr
