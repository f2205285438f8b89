"""What ``draftgym record`` writes, checked against answers computed apart from it on the tiny random target: the
header's settings, each prompt's greedy trajectory to its last token, the position features of root t from the
target's output that produced token t, each probe's trees under its own name (as recorded alone), and a resumed
recording that decodes only the prompts still missing and ends as the uninterrupted one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import env.trace_record as trace_mod
from env.decoder import SpeculativeDecoder, chat_prompt
from env.engine import NO_DRAFT
from env.features import FeatureSpec, projection, suffix_match_length, target_features
from env.trace import TraceError
from env.trace_record import record
from env.workloads import Prompt
from tests.env.kills import dies_on_call

PROMPTS = [
    Prompt("code-f-a", "code", "Write a function that adds two numbers."),
    Prompt("qa-f-b", "qa", "Hi."),
    Prompt("code-f-c", "code", "Sort a list of words by length."),
]
NEW = 6
PROBES = [
    "ngram",
    "recycling",
]  # recycling proposes at every root, ngram where the context repeats: other trees
GO = dict(max_new_tokens=NEW, progress=False, workload="code:fields")


@pytest.fixture(scope="module")
def tiny():
    from env.model import load_model

    return load_model("random:llama-tiny", dtype="fp32", device="cpu")


@pytest.fixture(scope="module")
def trace(tiny, tmp_path_factory):
    return record(tiny, PROMPTS, PROBES, tmp_path_factory.mktemp("fields") / "t.npz", **GO)


def _rows(arr: np.ndarray, off: np.ndarray, i: int) -> np.ndarray:
    return arr[off[i] : off[i + 1]]


def test_the_header_holds_the_settings(trace):
    h = trace.header
    assert h["max_new_tokens"] == NEW and h["sampling"] == "greedy" and h["workload"] == "code:fields"
    assert h["prompts"] == {
        "ids": [p.prompt_id for p in PROMPTS],
        "categories": [p.category for p in PROMPTS],
    }
    assert list(h["drafters"]) == PROBES and all(d["options"] == {} for d in h["drafters"].values())


def test_each_trajectory_is_the_greedy_decoding_to_its_last_token(tiny, trace):
    dec = SpeculativeDecoder(tiny, [NO_DRAFT])
    for i, p in enumerate(PROMPTS):
        ids = chat_prompt(tiny.tokenizer, p.text)
        assert _rows(trace.prompt_tokens, trace.prompt_off, i).tolist() == ids
        want = dec.generate(ids, max_new_tokens=NEW).token_ids
        assert _rows(trace.traj, trace.traj_off, i).tolist() == want, p.prompt_id


def test_the_features_of_root_t_are_from_the_output_that_produced_token_t(tiny, trace):
    spec = FeatureSpec.from_dict(trace.header["features"]["spec"], source="the trace")
    proj = projection(int(tiny.config.hidden_size), spec)
    for i in range(len(PROMPTS)):
        ids = _rows(trace.prompt_tokens, trace.prompt_off, i).tolist()
        traj = _rows(trace.traj, trace.traj_off, i).tolist()
        with torch.no_grad():
            out = tiny.model(torch.tensor([ids + traj]), output_hidden_states=True)
        at = slice(
            len(ids) - 1, len(ids) - 1 + len(traj)
        )  # the positions whose outputs are traj[0], traj[1], ...
        tf = target_features(out.logits[0, at], out.hidden_states[-1][0, at], proj)
        match = [
            suffix_match_length(ids + traj[: t + 1], spec.match_max) / spec.match_max
            for t in range(len(traj))
        ]
        want = np.concatenate([tf[:, :3], np.array(match, dtype=np.float32)[:, None], tf[:, 3:]], axis=1)
        got = _rows(trace.feat, trace.traj_off, i)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=2e-5, err_msg=PROMPTS[i].prompt_id)


def test_each_probes_trees_are_its_own(tiny, trace, tmp_path):
    a, b = (trace.trees[n] for n in PROBES)
    assert not np.array_equal(a.off, b.off) or not np.array_equal(a.tokens, b.tokens)  # the swap below shows
    for name in PROBES:
        alone = record(tiny, PROMPTS, [name], tmp_path / f"{name}.npz", **GO)
        got, want = trace.trees[name], alone.trees[name]
        for field in ("off", "tokens", "parents"):
            assert np.array_equal(getattr(got, field), getattr(want, field)), (name, field)


def test_a_resume_decodes_only_the_prompts_not_recorded(tiny, trace, tmp_path, monkeypatch):
    out = tmp_path / "t.npz"
    real = trace_mod.record_prompt
    monkeypatch.setattr(trace_mod, "record_prompt", dies_on_call(2, real))
    with pytest.raises(KeyboardInterrupt):
        record(tiny, PROMPTS, PROBES, out, **GO)
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(trace_mod, "record_prompt", counted)
    resumed = record(tiny, PROMPTS, PROBES, out, **GO)
    assert len(calls) == len(PROMPTS) - 1  # the first prompt's part was kept, not decoded again
    for arr in ("prompt_tokens", "prompt_off", "traj", "traj_off", "feat"):
        assert np.array_equal(getattr(resumed, arr), getattr(trace, arr)), arr
    for name in PROBES:
        assert np.array_equal(resumed.trees[name].tokens, trace.trees[name].tokens), name


def test_a_part_deleted_by_hand_records_every_prompt_again_from_fresh_probes(
    tiny, trace, tmp_path, monkeypatch
):
    """The probes' saved state covers two parts, but the first was deleted: the state cannot go on from before it,
    so every prompt is decoded again from fresh probes (recycling's table carries across prompts)."""
    out = tmp_path / "t.npz"
    real = trace_mod.record_prompt
    monkeypatch.setattr(trace_mod, "record_prompt", dies_on_call(3, real))
    with pytest.raises(KeyboardInterrupt):
        record(tiny, PROMPTS, PROBES, out, **GO)
    parts = out.with_name(out.name + ".parts")
    assert (parts / trace_mod.PROBES_FILE).is_file() and trace_mod.part_progress(out) == 2
    (parts / "00000.npz").unlink()
    calls = []
    monkeypatch.setattr(trace_mod, "record_prompt", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    again = record(tiny, PROMPTS, PROBES, out, **GO)
    assert len(calls) == len(PROMPTS)
    for name in PROBES:
        for field in ("off", "tokens", "parents"):
            assert np.array_equal(getattr(again.trees[name], field), getattr(trace.trees[name], field)), (
                name,
                field,
            )


def test_the_header_keeps_each_probes_options(tiny, tmp_path):
    """What live serving of the trace's menu must run with (``recorded_drafter_options``): the options given."""
    opts = {"ngram": {"max_ngram": 2, "max_depth": 4}, "recycling": {"width": 4}}
    t = record(tiny, PROMPTS[:1], PROBES, tmp_path / "o.npz", **GO, drafter_options=opts)
    assert {n: d["options"] for n, d in t.header["drafters"].items()} == opts
    assert trace_mod.recorded_drafter_options(t, "o.npz") == opts
    assert t.header["drafters"]["ngram"]["shape"][0] == 4  # the largest proposal of the drafter as configured


def test_a_max_new_tokens_under_two_is_refused(tiny, tmp_path):
    with pytest.raises(TraceError, match="max_new_tokens must be >= 2, got 1"):
        record(tiny, PROMPTS, ["ngram"], tmp_path / "t.npz", **{**GO, "max_new_tokens": 1})
    assert not (tmp_path / "t.npz.parts").exists()
