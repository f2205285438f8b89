"""The decoder on the Triton path (CPU interpreter): same greedy tokens as the torch path and as HF generate.

The interpreter must be switched on before triton is imported, so the decoding runs in a subprocess.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
]

SCRIPT = r"""
import json, sys, torch
import kernels
from drafters import TreeShape
from env.decoder import SpeculativeDecoder, chat_prompt
from env.engine import Arm
from env.model import load_model

m = load_model(dtype="fp32", device="cpu")
ids = chat_prompt(m.tokenizer, "Repeat exactly: one two three, one two three, one two three.")
assert kernels.triton_enabled(torch.zeros(1)), "the interpreter is not on"
arm = Arm("ngram", TreeShape(depth=4, topk=2, budget=6))
g = SpeculativeDecoder(m, [arm]).generate(ids, max_new_tokens=12)
x = torch.tensor([ids])
hf = m.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False, pad_token_id=2)
print(json.dumps({"ours": g.token_ids, "hf": hf[0, x.shape[1]:].tolist(), "steps": g.stats.steps}))
"""


def test_greedy_decoding_through_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["ours"] == out["hf"]
    assert out["steps"] < len(out["ours"])  # drafts were accepted: the tree path was exercised
