"""What one engine step computes and keeps: nothing nobody reads (the softmax of ``Verdict.node_prob`` over all of
``[B, N, V]`` was forced every step, and every step's result was kept in a list for the whole generation)."""

from __future__ import annotations

import pytest

import kernels
from env.decoder import SpeculativeDecoder
from env.engine import Sampling, parse_arm

pytestmark = pytest.mark.model


def test_a_step_leaves_node_prob_lazy_and_keeps_no_history(fp32_model, monkeypatch):
    forced = []
    real_verify = kernels.verify

    def verify(*args, **kwargs):
        v = real_verify(*args, **kwargs)
        src = v.node_prob_source

        def thunk():
            forced.append(1)
            return src() if callable(src) else src

        object.__setattr__(v, "node_prob_source", thunk)
        return v

    monkeypatch.setattr(kernels, "verify", verify)
    dec = SpeculativeDecoder(fp32_model, [parse_arm("ngram-d4-k2-b6")])
    engine = dec._engine(Sampling(), 0)
    seq, _ = engine.start(dec.loaded.tokenizer("Count: one two three four five six")["input_ids"])
    for _ in range(6):
        engine.step(seq, dec.arms[0])
    assert forced == []
    assert not any(isinstance(v, list) and len(v) >= 6 for v in vars(seq).values())
