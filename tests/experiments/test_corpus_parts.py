"""What the corpus of the draft heads (``experiments.corpus``) writes into its parts, read back as training reads
it (``drafters.train_data.load_data``): an answer is its prompt's tokens then the target's, ``answer_start`` at the
first answer token; a teacher-forced window has no answer; the last token has no feature; a prompt too long for
the context keeps its tail and is resumed under the digest of the prompt given; an id held twice counts from its
first part."""

from __future__ import annotations

import pytest
import torch

from drafters.train_data import load_data
from tests.drafters.tiny import tiny_loaded


@pytest.fixture(scope="module")
def loaded():
    return tiny_loaded()


def _zero_last_only(feats: torch.Tensor) -> bool:
    return bool((feats[-1] == 0).all() and (feats[:-1].abs().sum(1) > 0).all())


def test_an_answer_is_its_prompt_then_the_answer_with_answer_start_between(loaded, tmp_path):
    from experiments import corpus

    items = [("a", [5, 7, 9, 11, 3, 5]), ("b", [4, 8, 12])]
    corpus.distill_answers(loaded, items, tmp_path, max_new_tokens=3, batch=2, progress=False)
    seqs = {s.prompt_id: s for s in load_data(tmp_path)}
    assert sorted(seqs) == ["a", "b"]
    for pid, ids in items:
        s = seqs[pid]
        assert s.answer_start == len(ids) and s.tokens[: len(ids)].tolist() == ids
        assert 1 <= len(s.tokens) - len(ids) <= 3
        assert _zero_last_only(s.feats) and all(_zero_last_only(x) for x in s.exits.values())


def test_a_text_window_has_no_answer_and_no_feature_at_its_last_token(loaded, tmp_path):
    from drafters.train_data import split
    from experiments import corpus

    windows = [(f"text-w{i}", [3 + (5 * i + j) % 80 for j in range(10)]) for i in range(12)]
    corpus.text_features(loaded, windows, tmp_path, part_size=5, progress=False)
    seqs = load_data(tmp_path)
    assert [s.prompt_id for s in seqs] == [w for w, _ in windows]
    for s, (_, ids) in zip(seqs, windows):
        assert s.tokens.tolist() == ids and s.answer_start == len(ids)
        assert _zero_last_only(s.feats)
    train, held = split(seqs, heldout_every=3)  # text trains whole: nothing of it is held out
    assert held == [] and len(train) == len(seqs)


def test_a_prompt_too_long_keeps_its_tail_and_a_rerun_finds_it_done(loaded, tmp_path):
    from experiments import corpus

    long = [3 + i % 80 for i in range(loaded.max_context)]
    items = [("long", long)]
    corpus.distill_answers(loaded, items, tmp_path, max_new_tokens=2, batch=1, progress=False)
    (s,) = load_data(tmp_path)
    keep = loaded.max_context - 2 - 2  # room for the answer and a tree
    assert s.answer_start == keep and s.tokens[:keep].tolist() == long[-keep:]
    # resumed: found done under the digest of the prompt given, not refused as another text
    corpus.distill_answers(loaded, items, tmp_path, max_new_tokens=2, batch=1, progress=False)
    assert len(list(tmp_path.glob("part-*.safetensors"))) == 1


def test_an_id_held_twice_counts_with_the_digest_of_its_first_part(tmp_path):
    from experiments import corpus
    from experiments.errors import UserError

    def seq(sha):
        return {"id": "p", "sha": sha, "tokens": [1, 2, 3], "final": torch.zeros(3, 4), "aux": torch.zeros(3, 8),
                "answer_start": 1, "answer_len": 2}  # fmt: skip

    first, second = [4, 5], [6, 7]
    corpus._write_part(tmp_path, [seq(corpus.prompt_digest(first))], (1, 2))
    corpus._write_part(tmp_path, [seq(corpus.prompt_digest(second))], (1, 2))
    done = corpus._part_digests(tmp_path)
    assert done == {"p": corpus.prompt_digest(first)}
    corpus.same_prompts(tmp_path, done, [("p", first)])
    with pytest.raises(UserError, match="another text under prompt id p"):
        corpus.same_prompts(tmp_path, done, [("p", second)])
