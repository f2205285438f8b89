"""The decoder on the embedded model, in fp32: greedy speculative output equals Hugging Face greedy output token
for token, for chains and trees; sampling is reproducible from its seed."""

from __future__ import annotations

import pytest

from drafters import TreeShape
from env.decoder import SpeculativeDecoder, chat_prompt
from env.engine import NO_DRAFT, Arm, Sampling
from env.workloads import load_workload
from tests.hf_reference import hf_greedy

pytestmark = pytest.mark.model

ARMS = [NO_DRAFT, Arm("ngram", TreeShape(depth=8)), Arm("ngram", TreeShape(depth=6, topk=3, budget=12))]


@pytest.mark.parametrize("category", ["summarization", "rag", "qa"])
def test_greedy_equals_hf_generate(fp32_model, category):
    prompt = next(p for p in load_workload() if p.category == category)
    ids = chat_prompt(fp32_model.tokenizer, prompt.text)
    expected = hf_greedy(fp32_model, ids, 40)
    for arm in ARMS:
        g = SpeculativeDecoder(fp32_model, [arm]).generate(ids, max_new_tokens=40)
        assert g.token_ids == expected, arm.name
        assert g.stats.new_tokens == len(expected)
        if arm is NO_DRAFT:
            assert g.stats.tau == 1.0


def test_tree_steps_commit_the_accepted_path(fp32_model):
    # summarizing copies phrases of the article: the n-gram tree accepts several drafts per step
    prompt = next(p for p in load_workload() if p.category == "summarization")
    ids = chat_prompt(fp32_model.tokenizer, prompt.text)
    expected = hf_greedy(fp32_model, ids, 48)
    g = SpeculativeDecoder(fp32_model, [ARMS[2]]).generate(ids, max_new_tokens=48)
    assert g.token_ids == expected
    assert g.stats.tau > 1.2  # several tokens per step: the tree did its work
    assert g.stats.accepted > 0 and g.stats.drafted >= g.stats.accepted


def test_sampling_is_seeded_and_stops_at_max(fp32_model):
    dec = SpeculativeDecoder(fp32_model, [ARMS[1]])
    s = Sampling(temperature=0.8, top_k=50, top_p=0.95)
    a = dec.generate("Tell me a story about a cat.", max_new_tokens=24, sampling=s, seed=3)
    b = dec.generate("Tell me a story about a cat.", max_new_tokens=24, sampling=s, seed=3)
    assert a.token_ids == b.token_ids
    assert 1 <= len(a.token_ids) <= 24
    vocab = fp32_model.model.config.vocab_size
    assert all(0 <= t < vocab for t in a.token_ids)
    # and it samples: another seed, and greedy decoding, give other text (a greedy decoder passed the lines above)
    c = dec.generate("Tell me a story about a cat.", max_new_tokens=24, sampling=s, seed=4)
    greedy = dec.generate("Tell me a story about a cat.", max_new_tokens=24)
    assert c.token_ids != a.token_ids and greedy.token_ids not in (a.token_ids, c.token_ids)


class _Oracle:
    """Proposes the known continuation (HF greedy's tokens, end of sequence included) as a chain."""

    name, exact_replay = "oracle", True

    def __init__(self, prompt_len: int, continuation: list[int]) -> None:
        self.prompt_len, self.continuation = prompt_len, continuation

    def reset(self, ctx) -> None:
        pass

    def propose(self, ctx, shape):
        from drafters.trees import chain

        done = len(ctx.tokens) - self.prompt_len
        return chain(ctx.tokens[-1], self.continuation[done : done + shape.depth])

    def observe(self, ctx, feedback) -> None:
        pass


def test_an_end_of_sequence_inside_the_accepted_path_ends_generation(fp32_model, monkeypatch):
    import drafters

    ids = chat_prompt(fp32_model.tokenizer, "Say hello.")
    expected = hf_greedy(fp32_model, ids, 64)
    assert len(expected) < 64  # the answer ends with an end of sequence
    depth = (
        len(expected) + 4
    )  # one step accepts the whole answer, its end of sequence in the middle of the path
    monkeypatch.setitem(drafters.DRAFTERS, "oracle", lambda **_: _Oracle(len(ids), expected + [42] * 8))
    g = SpeculativeDecoder(fp32_model, [Arm("oracle", TreeShape(depth=depth))]).generate(
        ids, max_new_tokens=64
    )
    assert g.token_ids == expected
    assert g.stats.steps == 2  # prefill + one verification; decoding on past the end would take more steps
