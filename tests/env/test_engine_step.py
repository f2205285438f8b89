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


def test_measured_costs_take_a_plain_autoregressive_step_as_their_unit():
    """Without a cost model a step's reward is its wall time against the last plain autoregressive step's: a first
    step that drafted (2 s here) is not that unit (it made a 10 ms step look 400x as fast), nor is a root-only
    step that paid for a drafter's search; until a plain step is measured, the step's own verify time is."""
    from drafters import TreeShape
    from env.engine import NO_DRAFT, Arm, StepResult
    from env.step import StepCosts

    arm = Arm("ngram", TreeShape(depth=4))
    costs = StepCosts(None)
    assert costs(StepResult(arm, [1, 2], 1, 4, draft_s=1.5, verify_s=0.5), 10) == (2.0, 0.5)
    assert costs(StepResult(arm, [1], 0, 0, draft_s=0.004, verify_s=0.006), 11) == (0.01, 0.006)  # searched
    assert costs(StepResult(NO_DRAFT, [1], 0, 0, draft_s=0.0, verify_s=0.008), 12) == (0.008, 0.008)
    assert costs(StepResult(arm, [1, 2, 3], 2, 4, draft_s=0.002, verify_s=0.01), 13) == (0.012, 0.008)


def test_a_prompt_token_outside_the_vocabulary_is_a_prompt_error():
    """An id past the embedding would be an index error here and a device assert on CUDA (ending every request
    in flight): refused at admission, naming it."""
    from env.batch import BatchEngine
    from env.target import PromptError
    from tests.drafters.tiny import tiny_loaded

    loaded = tiny_loaded()
    engine = BatchEngine(loaded, max_rows=1)
    vocab = int(loaded.config.vocab_size)
    for bad in (vocab, -1):
        with pytest.raises(PromptError, match=f"token id {bad}, outside the vocabulary"):
            engine.admit([5, bad], {})
    row, first = engine.admit([5, 6], {})  # the engine still serves
    assert row.slot == 0 and 0 <= first < vocab
    from env.engine import NO_DRAFT

    (res,) = engine.step([NO_DRAFT])
    assert len(res.committed) == 1 and row.tokens[-2:] == [first, res.committed[0]]
