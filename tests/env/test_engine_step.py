"""What one engine step computes and keeps: nothing nobody reads (the softmax of ``Verdict.node_prob`` over all of
``[B, N, V]`` was forced every step, and every step's result was kept in a list for the whole generation)."""

from __future__ import annotations

import pytest

import kernels
from env.decoder import SpeculativeDecoder
from env.engine import parse_arm
from env.step import Stepper

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
    stepper = Stepper(dec.engine, dec.arms)
    seq = stepper.start(
        dec.loaded.tokenizer("Count: one two three four five six")["input_ids"], 64, dec.drafters
    )
    for _ in range(6):
        stepper.step([0])
    assert forced == []
    kept = [v for v in (*vars(seq).values(), *vars(stepper).values()) if isinstance(v, list) and len(v) >= 6]
    assert all(isinstance(x, int) for v in kept for x in v)  # the generated tokens only, no per-step results
    stepper.retire(seq)
