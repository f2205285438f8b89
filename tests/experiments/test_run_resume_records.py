"""``draftgym run`` resumed on the records a kill left: a record that reached only a saved state (an online
policy's, a stateful drafter's) is appended as it was, not decoded again; a rerun of a finished run adds nothing; a
torn last line is cut before the resume appends, so every line stays whole. On the tiny random model (seconds)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments.config import load_config
from experiments.records import load_done
from experiments.runner import run


@pytest.fixture(scope="module")
def tiny():
    from env.model import load_model

    return load_model("random:llama-tiny", dtype="fp32", device="cpu")


def _config(tmp_path: Path, methods: list[str], policy: str = "ucb") -> str:
    rows = [
        {"question_id": 1, "category": "qa", "turns": ["What is 1 plus 1?"]},
        {"question_id": 2, "category": "qa", "turns": ["Name three colours."]},
    ]
    (tmp_path / "w.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f"""name = "resume-records"
methods = {json.dumps(methods)}
[model]
name = "random:llama-tiny"
dtype = "fp32"
device = "cpu"
[workload]
path = "{tmp_path / "w.jsonl"}"
[decode]
max_new_tokens = 3
warmup = false
[policies.{policy}]
kind = "ucb1"
arms = ["none", "ngram-d2", "ngram-d4"]
params = {{ c = 1.0, scale = 13.0 }}
"""


@pytest.mark.parametrize("method", ["policy:ucb", "suffix-d8"])
def test_a_record_only_a_saved_state_holds_is_appended_as_it_was_and_not_decoded_again(
    tmp_path, tiny, method
):
    """Killed after the state that holds the last prompt's record was saved, before the record was appended."""
    cfg = load_config(None, text=_config(tmp_path, [method]))
    out = tmp_path / "run"
    run(cfg, out, progress=False, loaded=tiny)
    whole = (out / "records.jsonl").read_text().splitlines(keepends=True)
    assert len(whole) == 2
    (out / "records.jsonl").write_text(whole[0])  # the kill: the state has the record, the file does not

    run(cfg, out, progress=False, loaded=tiny)
    # the very line (its wall time and session too): taken from the state, not timed again
    assert (out / "records.jsonl").read_text().splitlines(keepends=True) == whole
    run(cfg, out, progress=False, loaded=tiny)  # finished: the state's record is in the file already
    assert (out / "records.jsonl").read_text().splitlines(keepends=True) == whole


def test_a_torn_last_line_is_cut_before_the_resume_appends(tmp_path, tiny):
    cfg = load_config(None, text=_config(tmp_path, ["ar", "ngram-d4"]))
    out = tmp_path / "run"
    run(cfg, out, progress=False, loaded=tiny)
    whole = (out / "records.jsonl").read_text().splitlines(keepends=True)
    assert len(whole) == 4
    torn = whole[-1][: len(whole[-1]) // 2]  # a kill during the last write
    (out / "records.jsonl").write_text("".join(whole[:-1]) + torn)

    run(cfg, out, progress=False, loaded=tiny)
    lines = (out / "records.jsonl").read_text().splitlines(keepends=True)
    assert lines[:3] == whole[:3] and len(lines) == 4
    redone = load_done(out / "records.jsonl", strict=True)[-1]  # every line a whole record, none twice
    assert redone.token_ids == json.loads(whole[-1])["token_ids"]


def test_a_saved_policy_state_lists_the_prompts_it_learned_from_once_each(tmp_path, tiny):
    """Its ``run_learned`` holds the policy's own prompts in order, not those another method decoded."""
    from experiments.records import RUN_LEARNED
    from policies.base import read_policy

    cfg = load_config(None, text=_config(tmp_path, ["ar", "policy:ucb"]))
    run(cfg, tmp_path / "run", progress=False, loaded=tiny)
    meta = read_policy(tmp_path / "run" / "policies" / "ucb.zip")[0].meta
    assert meta[RUN_LEARNED] == ["1", "2"]


def test_a_policy_named_like_a_plain_method_has_its_record_recovered_once(tmp_path, tiny):
    """``policies/ar.zip`` is the state of ``policy:ar``, not of the method ``ar``; killed after the policy's state
    of the second prompt was saved, before its record (and before ``ar`` ran that prompt)."""
    cfg = load_config(None, text=_config(tmp_path, ["ar", "policy:ar"], policy="ar"))
    out = tmp_path / "run"
    run(cfg, out, progress=False, loaded=tiny)
    whole = (out / "records.jsonl").read_text().splitlines(keepends=True)
    order = [(r["method"], r["prompt_id"]) for r in map(json.loads, whole)]
    assert order == [("ar", "1"), ("policy:ar", "1"), ("policy:ar", "2"), ("ar", "2")]  # rotated per prompt
    (out / "records.jsonl").write_text("".join(whole[:2]))

    run(cfg, out, progress=False, loaded=tiny)
    assert (out / "records.jsonl").read_text().splitlines(keepends=True)[:3] == whole[:3]
    assert len(load_done(out / "records.jsonl", strict=True)) == 4
