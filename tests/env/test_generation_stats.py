"""``SpeculativeDecoder.generate``'s bookkeeping with known answers on tiny targets: an end of sequence that is also
the last token allowed is named the stop ("eos", not "max_new_tokens"); the stats add up (tau is tokens per
verification step, prefill included; plain decoding's is 1.00; tokens per second over the whole wall time); the text
leaves out special tokens."""

from __future__ import annotations

import pytest

from env.decoder import SpeculativeDecoder
from env.engine import NO_DRAFT, parse_arm
from tests.env.conftest import WordTokenizer, tiny_words

PROMPT = [10, 20, 30, 40, 50, 60]


@pytest.fixture(scope="module")
def tiny():
    from env.model import load_model

    return load_model("random:llama-tiny", dtype="fp32", device="cpu")  # its greedy output does not repeat


@pytest.mark.parametrize("arm", ["none", "ngram-d3"])
def test_an_end_of_sequence_as_the_last_token_allowed_is_the_stop(tiny, monkeypatch, arm):
    free = SpeculativeDecoder(tiny, [NO_DRAFT]).generate(PROMPT, max_new_tokens=6).token_ids
    third = free[2]
    assert third not in free[:2]  # the end of sequence below comes third, not before
    monkeypatch.setattr(tiny.model.generation_config, "eos_token_id", third)
    dec = SpeculativeDecoder(tiny, [parse_arm(arm)])
    at_max = dec.generate(PROMPT, max_new_tokens=3)
    assert at_max.token_ids == free[:3] and at_max.stop == "eos"
    room = dec.generate(PROMPT, max_new_tokens=6)
    assert room.token_ids == free[:3] and room.stop == "eos"
    cut = dec.generate(PROMPT, max_new_tokens=2)
    assert cut.token_ids == free[:2] and cut.stop == "max_new_tokens"


@pytest.mark.parametrize("arm", ["none", "ngram-d3"])
def test_the_stats_add_up(arm):
    loaded = tiny_words()  # [5, 6, 7] goes on with 7s: the n-gram chain accepts several a step
    g = SpeculativeDecoder(loaded, [parse_arm(arm)]).generate([5, 6, 7], max_new_tokens=8)
    s = g.stats
    assert g.stop == "max_new_tokens" and s.new_tokens == len(g.token_ids) == 8
    assert s.steps == len(g.arms) + 1  # the prefill's token, then one step an arm
    assert s.tau == s.new_tokens / s.steps
    assert s.tokens_per_s == s.new_tokens / s.wall_s and 0 < s.prefill_s <= s.wall_s
    assert 0 <= s.accepted <= s.drafted and s.acceptance_rate == (
        s.accepted / s.drafted if s.drafted else 0.0
    )
    if arm == "none":
        assert s.tau == 1.0 and s.steps == 8 and s.drafted == 0
    else:
        assert s.steps < 8 and s.tau > 1.0 and s.accepted > 0


class _MarkerTokenizer(WordTokenizer):
    """Id 7 is a special token (a chat marker): left out of a text decoded with ``skip_special_tokens``."""

    def decode(self, ids, skip_special_tokens=False, **_):
        return " ".join(str(i) for i in ids if not (skip_special_tokens and i == 7))


def test_the_text_leaves_out_special_tokens():
    loaded = tiny_words()
    loaded._tokenizer = _MarkerTokenizer()
    g = SpeculativeDecoder(loaded, [NO_DRAFT]).generate([5, 6, 7], max_new_tokens=4)
    assert g.token_ids == [7, 7, 7, 7] and g.text == ""


def test_a_text_prompt_goes_through_the_chat_template_unless_chat_is_false(tiny):
    from env.decoder import chat_prompt, raw_prompt

    dec = SpeculativeDecoder(tiny, [NO_DRAFT])
    chat = dec.generate("Hi.", max_new_tokens=2)
    raw = dec.generate("Hi.", max_new_tokens=2, chat=False)
    assert chat.prompt_ids == chat_prompt(tiny.tokenizer, "Hi.") != raw.prompt_ids
    assert raw.prompt_ids == raw_prompt(tiny.tokenizer, "Hi.")
