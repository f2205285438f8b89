"""Decoding up to the end of the context: a row whose tree no longer fits drafts nothing that step (the root alone)
and a row with no room left ends truncated — with the greedy tokens of autoregressive decoding, token for token,
for deep and wide arms, alone and beside a row with room to spare (fp32, the tiny target: 512 positions)."""

from __future__ import annotations

import pytest

from drafters import make_drafter
from env.batch import BatchEngine
from env.engine import NO_DRAFT, parse_arm
from env.step import Stepper
from tests.drafters.tiny import tiny_loaded

LOOP = [7, 21, 4, 60, 33, 12, 9, 51]


def decode(loaded, prompts: list[list[int]], arms: list[str], new: int) -> list[list[int]]:
    """Greedy decoding of ``prompts`` side by side, prompt i with arm i, until each ends."""
    menu = [NO_DRAFT, *[parse_arm(a) for a in dict.fromkeys(arms) if a != "none"]]
    names = [m.name for m in menu]
    st = Stepper(BatchEngine(loaded, max_rows=len(prompts)), menu)
    seqs = [st.start(p, new, {"ngram": make_drafter("ngram")}) for p in prompts]
    choice = {id(s): names.index(parse_arm(a).name) for s, a in zip(seqs, arms)}
    while any(not s.done for s in st.seqs):
        for s in [s for s in st.seqs if s.done]:
            st.retire(s)
        st.step([choice[id(s)] for s in st.seqs])
    return [list(s.tokens) for s in seqs]


@pytest.mark.parametrize("arm", ["ngram-d8", "ngram-d16", "ngram-d4-k4-b16"])
def test_speculation_to_the_context_end_is_autoregressive_decoding(arm):
    loaded = tiny_loaded()
    near = (LOOP * 70)[:490]  # 22 positions left: the loop makes the n-gram drafter propose deep trees there
    want = decode(loaded, [near], ["none"], 100)[0]
    assert len(want) < 100  # ended by the context, not by max_new_tokens
    got = decode(loaded, [near], [arm], 100)[0]
    assert got == want
    short = LOOP * 3  # beside a row with room to spare, which keeps drafting deep trees
    both = decode(loaded, [near, short], [arm, arm], 100)
    assert both[0] == want and both[1] == decode(loaded, [short], ["none"], 100)[0]
