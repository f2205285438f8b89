"""``Generation.stop`` says why a generation ended: its end-of-sequence token, ``max_new_tokens``, or the model's
context filled up (``draftgym generate`` says so; a prompt near the context's end returned a few tokens unexplained)."""

from __future__ import annotations

from env.decoder import SpeculativeDecoder
from env.engine import parse_arm
from tests.env.conftest import tiny_words


def test_stop_names_the_end_of_a_generation():
    loaded = tiny_words()  # context 512, end-of-sequence id 95
    arm = [parse_arm("ngram-d3")]
    near_end = [5 + i % 80 for i in range(500)]
    g = SpeculativeDecoder(loaded, arm).generate(near_end, max_new_tokens=64)
    # the context ends it (the seeded model emits no end-of-sequence token here): 12 positions fill it, and the
    # 13th token is read from the last of them (it needs no position of its own)
    assert g.stop == "context" and len(g.token_ids) == loaded.max_context - len(near_end) + 1
    short = SpeculativeDecoder(loaded, arm).generate([5, 6, 7], max_new_tokens=3)
    first = short.token_ids[0]
    assert short.stop == "max_new_tokens" and len(short.token_ids) == 3
    loaded.model.generation_config.eos_token_id = first  # the first token now ends the sequence
    ended = SpeculativeDecoder(loaded, arm).generate([5, 6, 7], max_new_tokens=3)
    assert ended.stop == "eos" and ended.token_ids == [first]
