"""``SpeculativeDecoder.generate`` refuses a ``max_new_tokens`` that is no integer in one line (a float failed later
with a traceback; a bool ran as 1), and takes any integer kind. The tiny target: no embedded model needed."""

from __future__ import annotations

import numpy as np
import pytest

from env.decoder import SpeculativeDecoder
from env.engine import NO_DRAFT
from tests.env.conftest import tiny_words
from tests.env.test_terminal_obs import motif_prompts


@pytest.fixture(scope="module")
def decoder():
    loaded = tiny_words()
    return SpeculativeDecoder(loaded)


@pytest.mark.parametrize("bad", [2.5, 4.0, True, False, "4", None, 0, -1])
def test_max_new_tokens_that_is_no_positive_integer_is_refused_in_one_line(decoder, bad):
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1") as err:
        decoder.generate(motif_prompts(1)[0], max_new_tokens=bad)
    assert "\n" not in str(err.value)


def test_any_integer_kind_is_taken(decoder):
    prompt = motif_prompts(1)[0]
    want = SpeculativeDecoder(decoder.loaded, [NO_DRAFT]).generate(prompt, max_new_tokens=5).token_ids
    got = decoder.generate(prompt, max_new_tokens=np.int64(5))
    assert got.token_ids == want and got.stats.new_tokens == 5
