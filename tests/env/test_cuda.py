"""The decoder on CUDA (skipped without a GPU; run on a GPU machine): every drafter kind, the Triton verify and KV
kernels on the real path, greedy output equal to Hugging Face greedy on the same device in fp32, and seeded
sampling reproducible. CPU runs cover the same code through the torch reference (test_decoder.py)."""

from __future__ import annotations

import pytest
import torch

from env.decoder import SpeculativeDecoder, chat_prompt
from env.engine import Sampling, parse_arm
from env.workloads import load_workload
from tests.hf_reference import hf_greedy

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

ARMS = ["ngram-d8", "ngram-d6-k3-b12", "recycling-d4-k4-b8", "eagle-d5-k3-b10", "early_exit-d3-k2-b5"]


@pytest.fixture(scope="module")
def cuda_fp32():
    from env.model import load_model

    return load_model(dtype="fp32", device="cuda")


@pytest.mark.parametrize("category", ["summarization", "rag", "mt_bench"])
def test_greedy_equals_hf_generate_on_cuda(cuda_fp32, category):
    prompt = next(p for p in load_workload() if p.category == category)
    ids = chat_prompt(cuda_fp32.tokenizer, prompt.text)
    expected = hf_greedy(cuda_fp32, ids, 48)
    for name in ARMS:
        g = SpeculativeDecoder(cuda_fp32, [parse_arm(name)]).generate(ids, max_new_tokens=48)
        assert g.token_ids == expected, name


def test_sampling_on_cuda_is_seeded(cuda_fp32):
    s = Sampling(temperature=0.8)
    for name in ("ngram-d6-k3-b12", "eagle-d5-k3-b10"):
        dec = SpeculativeDecoder(cuda_fp32, [parse_arm(name)])
        a = dec.generate("Tell me a story about a cat.", max_new_tokens=32, sampling=s, seed=3)
        b = dec.generate("Tell me a story about a cat.", max_new_tokens=32, sampling=s, seed=3)
        assert a.token_ids == b.token_ids and 0 < len(a.token_ids) <= 32, name
