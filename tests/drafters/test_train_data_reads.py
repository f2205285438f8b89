"""What ``drafters.train_data`` writes and reads back: a distilled sequence is the last ``window`` tokens of prompt
and answer (cut after the first end-of-sequence token, which is kept), ``answer_start`` its first answer token; a
teacher-forced prompt is its first ``max_len`` tokens; a finished folder is resumed without a forward; ``keep``
keeps those ids; the held-out split is by prompt and never trains; answers weigh 4x in the draft vocabulary."""

from __future__ import annotations

import pytest
import torch

from drafters.train_data import (
    Sequence,
    draft_vocab,
    generate_data,
    load_data,
    prefill_data,
    split,
)
from tests.drafters.tiny import tiny_loaded

PROMPTS = [(f"p{i}", [1 + i, 7, 9, 11 + i, 3]) for i in range(4)]
KW = dict(max_new_tokens=4, batch_size=2, capture_layers=(1,), pad_id=0, progress=False, model_id="tiny")


@pytest.fixture(scope="module")
def model():
    return tiny_loaded(seed=0).model


@pytest.fixture(scope="module")
def answers(model, tmp_path_factory):
    """Each prompt's whole greedy answer (a window that cuts nothing)."""
    out = tmp_path_factory.mktemp("whole")
    generate_data(model, PROMPTS, out, window=64, **KW)
    seqs = {s.prompt_id: s for s in load_data(out)}
    return {pid: seqs[pid].tokens[len(ids) :].tolist() for pid, ids in PROMPTS}


def test_a_window_keeps_the_tail_of_prompt_and_answer(model, answers, tmp_path):
    assert all(len(a) == 4 for a in answers.values())
    generate_data(model, PROMPTS, tmp_path, window=6, **KW)
    for s in load_data(tmp_path):
        ids = dict(PROMPTS)[s.prompt_id]
        whole = ids + answers[s.prompt_id]
        assert s.tokens.tolist() == whole[-6:]
        assert s.answer_start == len(ids) - (len(whole) - 6) == 2  # 9 tokens, the first 3 cut away
        assert (s.feats[-1] == 0).all() and (s.feats[:-1].abs().sum(1) > 0).all()


def test_an_answer_ends_at_its_first_end_of_sequence_token_kept(model, answers, tmp_path, monkeypatch):
    first = answers["p0"][0]
    monkeypatch.setattr(model.generation_config, "eos_token_id", first)
    generate_data(model, PROMPTS, tmp_path, window=64, **KW)
    s = next(s for s in load_data(tmp_path) if s.prompt_id == "p0")
    assert s.tokens.tolist() == PROMPTS[0][1] + [first] and s.answer_start == len(PROMPTS[0][1])


def test_a_finished_folder_resumes_without_a_forward_and_a_deleted_part_is_made_again(
    model, tmp_path, monkeypatch
):
    generate_data(model, PROMPTS, tmp_path, window=16, **KW)
    parts = sorted(tmp_path.glob("part-*.safetensors"))
    assert len(parts) == 2
    calls = []
    generate = model.generate

    def counted(*a, **k):
        calls.append(1)
        return generate(*a, **k)

    monkeypatch.setattr(model, "generate", counted)
    generate_data(model, PROMPTS, tmp_path, window=16, **KW)
    assert calls == []
    parts[1].unlink()
    generate_data(model, PROMPTS, tmp_path, window=16, **KW)
    assert calls == [1] and len(list(tmp_path.glob("part-*.safetensors"))) == 2


def test_prefill_takes_the_first_max_len_tokens_and_keep_reads_those_ids(model, tmp_path):
    prefill_data(model, PROMPTS, tmp_path, max_len=4, capture_layers=(1,), pad_id=0, progress=False,
                 model_id="tiny")  # fmt: skip
    seqs = load_data(tmp_path)
    assert {s.prompt_id: s.tokens.tolist() for s in seqs} == {pid: ids[:4] for pid, ids in PROMPTS}
    assert all(s.answer_start == 4 for s in seqs)
    assert [s.prompt_id for s in load_data(tmp_path, keep={"p2", "p0"})] in (["p0", "p2"], ["p2", "p0"])


def _seq(pid: str, n: int, answer_start: int, tokens: list[int] | None = None) -> Sequence:
    t = torch.tensor(tokens if tokens is not None else list(range(n)))
    return Sequence(
        tokens=t, feats=torch.zeros(len(t), 4), exits={}, answer_start=answer_start, prompt_id=pid
    )


def test_the_held_out_split_is_every_kth_answer_by_prompt_and_never_trains():
    answered = [_seq(f"a{i:02d}", 8, 3) for i in range(10)]
    text = [_seq(f"text-{i}", 8, 8) for i in range(10)]  # teacher-forced: no answer
    seqs = text[:5] + answered[::-1] + text[5:]
    train, held = split(seqs, heldout_every=5)
    assert [s.prompt_id for s in held] == ["a04", "a09"]
    assert len(train) == 18 and not ({id(s) for s in train} & {id(s) for s in held})
    assert {id(s) for s in text} <= {id(s) for s in train}


def test_answer_tokens_weigh_four_times_in_the_draft_vocabulary():
    # token 7 three times in a prompt, token 9 once in an answer: 4 > 3
    seqs = [_seq("a", 4, 3, [7, 7, 7, 9])]
    assert draft_vocab(seqs, 1).tolist() == [9]
    assert draft_vocab(seqs, 3).tolist() == [0, 7, 9]  # then the lowest unused ids
