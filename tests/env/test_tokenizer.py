"""The fast tokenizer (env.tokenizer) is the transformers tokenizer of the embedded model, without transformers."""

from __future__ import annotations

import random

from transformers import AutoTokenizer

from env.decoder import chat_prompt
from env.model import embedded_model_folder
from env.tokenizer import FastTokenizer
from env.workloads import load_workload

TEXTS = [
    "Hello, world!",
    "  leading spaces and trailing  ",
    "Unicode: naïve café — 東京 🚀 ∑ x² ",
    "code:\n\tdef f(x):\n\t\treturn x ** 2  # comment\n",
    "<|im_start|>user\nliteral special tokens in text<|im_end|>",
]


def test_the_fast_tokenizer_is_the_transformers_one():
    folder = embedded_model_folder()
    fast, ref = FastTokenizer(folder), AutoTokenizer.from_pretrained(folder)
    texts = TEXTS + [p.text for p in load_workload(None)]
    for text in texts:
        assert fast(text)["input_ids"] == ref(text)["input_ids"], text
        assert chat_prompt(fast, text) == chat_prompt(ref, text), text
    assert fast.get_vocab() == ref.get_vocab()
    assert (fast.eos_token_id, fast.pad_token_id) == (ref.eos_token_id, ref.pad_token_id)
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(len(ref)) for _ in range(rng.randrange(1, 40))]
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), (
                ids
            )
