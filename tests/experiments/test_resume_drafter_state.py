"""Resuming runs whose drafters carry state from prompt to prompt (the suffix drafter's answer cache, the recycling
table; ``experiments.drafter_state``) and online policies: killed at the narrow points between a method's saved
states and its record, a run resumes as if it had never stopped; saved states that disagree with the records are
refused. In-process kills on the embedded model (fp32), beside the kill -9 matrix (``test_kill_matrix.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.experiments.test_kill_matrix import RUN_TOML, _run_results

CARRY_TOML = """name = "kill-carry"
seed = 0
methods = ["suffix-d8", "recycling-d4-k2-b6"]
[model]
dtype = "fp32"
device = "cpu"
[workload]
categories = ["summarization", "rag"]   # they copy from their context: drafts get accepted
per_category = 2
limit = 3
[decode]
max_new_tokens = 32
"""


@pytest.mark.model
def test_saved_states_that_learned_prompts_the_records_lack_are_refused(tmp_path, fp32_model):
    """A run folder whose records.jsonl was deleted (or replaced) but whose saved states were kept: the online
    policies and the stateful drafters learned from prompts the records do not hold, and a resume would go on from
    them as if from the start — refused in one line instead."""
    from experiments.config import load_config
    from experiments.errors import UserError
    from experiments.runner import run

    for text, what in ((RUN_TOML, "ucb.zip learned from other prompts of policy:ucb"),
                       (CARRY_TOML, "learned from other prompts of suffix-d8")):  # fmt: skip
        cfg = load_config(None, text=text)
        out = tmp_path / cfg.name
        run(cfg, out, progress=False, loaded=fp32_model)
        (out / "records.jsonl").unlink()
        with pytest.raises(UserError, match=what) as err:
            run(cfg, out, progress=False, loaded=fp32_model)
        assert "\n" not in str(err.value)


_UNINTERRUPTED: dict[str, Any] = {}  # config text -> the results of its uninterrupted run (one per module)


def _uninterrupted(cfg: Any, text: str, loaded: Any, out: Path) -> dict[str, Any]:
    from experiments.runner import run

    if text not in _UNINTERRUPTED:
        run(cfg, out, progress=False, loaded=loaded)
        _UNINTERRUPTED[text] = _run_results(out)
    return _UNINTERRUPTED[text]


@pytest.mark.model
@pytest.mark.parametrize("where", ["between-state-and-record", "between-prompts"])
def test_run_with_drafters_that_carry_state_resumes_as_if_never_killed(
    tmp_path, fp32_model, monkeypatch, where
):
    """The suffix drafter's answer cache and the recycling table outlive a prompt: a run killed after its second
    prompt (between a method's saved drafter state and its record, or between two prompts) resumes with the
    drafters as they were — the same steps and arms as an uninterrupted run, not those of empty drafters (warm-up
    included: the state is restored after it)."""
    import experiments.drafter_state as ds
    from experiments.config import load_config
    from experiments.runner import run

    cfg = load_config(None, text=CARRY_TOML)
    want = _uninterrupted(cfg, CARRY_TOML, fp32_model, tmp_path / "A")
    real, calls = ds.save_drafters, []

    def killed(decoder, state_dir, method, rec, learned):
        calls.append(method)
        if where == "between-prompts" and len(calls) == 5:  # prompt 2's first method: 4 records written
            raise KeyboardInterrupt
        real(decoder, state_dir, method, rec, learned)
        if where == "between-state-and-record" and len(calls) == 4:  # prompt 1's second method, state saved
            raise KeyboardInterrupt

    monkeypatch.setattr(ds, "save_drafters", killed)
    with pytest.raises(KeyboardInterrupt):
        run(cfg, tmp_path / "B", progress=False, loaded=fp32_model)
    assert len((tmp_path / "B" / "records.jsonl").read_text().splitlines()) == (3 if "state" in where else 4)
    monkeypatch.undo()
    run(cfg, tmp_path / "B", progress=False, loaded=fp32_model)
    assert _run_results(tmp_path / "B") == want


@pytest.mark.model
def test_a_saved_state_no_run_on_this_target_could_have_written_is_refused_naming_it(
    tmp_path, fp32_model, monkeypatch
):
    """A saved suffix cache with a token id past the target's vocabulary, or a recycling table of another
    vocabulary's size: one line naming the file when the run resumes, before any prompt is decoded — not an error
    at the suffix drafter's first proposal, nor a table silently dropped for an empty one."""
    import numpy as np

    import experiments.drafter_state as ds
    from experiments.config import load_config
    from experiments.errors import UserError
    from experiments.runner import run

    cfg = load_config(None, text=CARRY_TOML)
    real, calls = ds.save_drafters, []

    def killed(*a, **k):
        calls.append(1)
        if len(calls) == 3:  # after the first prompt of both methods
            raise KeyboardInterrupt
        real(*a, **k)

    monkeypatch.setattr(ds, "save_drafters", killed)
    out = tmp_path / "B"
    with pytest.raises(KeyboardInterrupt):
        run(cfg, out, progress=False, loaded=fp32_model)
    monkeypatch.undo()
    vocab = int(fp32_model.config.vocab_size)
    records = (out / "records.jsonl").read_text()
    for method, key, change, needle in (
        ("suffix-d8", "suffix/answers", lambda a: np.where(np.arange(a.size) == 0, vocab, a),
         f"suffix state: token id {vocab} is outside the target's vocabulary"),
        ("recycling-d4-k2-b6", "recycling/ids", lambda a: a[:100].clip(-1, 99),
         f"recycling state: a table of 100 token ids, not the target's vocabulary of {vocab}"),
    ):  # fmt: skip
        path = ds.state_file(out / "policies", method)
        saved = path.read_bytes()
        arrays = dict(np.load(path))
        arrays[key] = change(arrays[key])
        if key == "recycling/ids":
            arrays["recycling/logp"] = arrays["recycling/logp"][:100]
        np.savez(path, **arrays)
        with pytest.raises(UserError, match=needle) as err:
            run(cfg, out, progress=False, loaded=fp32_model)
        assert str(path) in str(err.value) and "\n" not in str(err.value)
        assert (out / "records.jsonl").read_text() == records  # nothing decoded, nothing lost
        path.write_bytes(saved)


POLICY_CARRY_TOML = (
    CARRY_TOML.replace('methods = ["suffix-d8", "recycling-d4-k2-b6"]', 'methods = ["policy:ucb"]')
    + """[policies.ucb]
kind = "ucb1"
arms = ["none", "suffix-d8", "recycling-d4-k2-b6"]
params = { c = 1.0, scale = 13.0 }
"""
)


@pytest.mark.model
@pytest.mark.parametrize("where", ["before-the-policy", "before-the-commit"])
def test_a_policy_and_its_drafters_resume_from_one_prompt(tmp_path, fp32_model, monkeypatch, where):
    """An online bandit over drafting arms keeps two states, its own and its drafters': killed after the drafters'
    state was written aside but before the policy's (both resume from the prompt before), or after the policy's
    but before the drafters' took its place (both resume from this prompt) — as an uninterrupted run either way."""
    import dataclasses

    import env.decoder
    import experiments.drafter_state as ds
    import experiments.methods as methods
    from env.cost import load_cost_model
    from experiments.config import load_config
    from experiments.runner import run

    # rewards priced by the cost model (deterministic), not by wall time: the shipped model with the n-gram
    # drafter's costs for the suffix and recycling drafters too (it calibrated the n-gram one only)
    shipped = load_cost_model()
    ngram = shipped.drafters["ngram"]
    priced = dataclasses.replace(shipped, drafters={**shipped.drafters, "suffix": ngram, "recycling": ngram})
    monkeypatch.setattr(env.decoder, "load_cost_model", lambda *a, **k: priced)
    cfg = load_config(None, text=POLICY_CARRY_TOML)
    want = _uninterrupted(cfg, POLICY_CARRY_TOML, fp32_model, tmp_path / "A")
    # the second prompt's policy state, or the commit of its drafters' state, is killed
    module, name = (
        (methods, "save_policy_states") if where == "before-the-policy" else (ds, "commit_drafters")
    )
    real, calls = getattr(module, name), []

    def killed(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real(*a, **k)

    monkeypatch.setattr(module, name, killed)
    with pytest.raises(KeyboardInterrupt):
        run(cfg, tmp_path / "B", progress=False, loaded=fp32_model)
    assert len((tmp_path / "B" / "records.jsonl").read_text().splitlines()) == 1
    monkeypatch.undo()
    monkeypatch.setattr(env.decoder, "load_cost_model", lambda *a, **k: priced)
    run(cfg, tmp_path / "B", progress=False, loaded=fp32_model)
    assert _run_results(tmp_path / "B") == want
