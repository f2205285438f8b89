"""The step object's pure bookkeeping, on known cases without a model: where a sequence's counted tokens end
(``truncate``) and what a step costs under a cost model (``StepCosts``: drafting, verification of the root and
the drafted nodes, the observation's proposals)."""

from __future__ import annotations

import pytest
import torch

from drafters import TreeShape
from env.engine import NO_DRAFT, Arm, StepResult
from env.step import StepCosts, truncate
from tests.env.conftest import toy_cost_model

EOS = frozenset({2})


def test_truncate_keeps_the_end_of_sequence_token_and_cuts_at_max_new_tokens():
    assert truncate([5, 6, 2, 7], EOS, 10) == [
        5,
        6,
        2,
    ]  # the end-of-sequence token is kept, what follows is not
    assert truncate([2, 5], EOS, 10) == [2]
    assert truncate([5, 6, 7, 8], EOS, 3) == [5, 6, 7]
    assert truncate([5, 6, 7, 2], EOS, 3) == [5, 6, 7]  # an end past the limit does not count
    assert truncate([5, 6, 2], EOS, 3) == [5, 6, 2]  # at the limit it does
    assert truncate([5, 6], EOS, 0) == []


@pytest.fixture
def cm():
    return toy_cost_model()


def test_a_cost_model_prices_drafting_and_the_verification_of_root_and_drafts(cm):
    arm = Arm("ngram", TreeShape(depth=4))
    chain = StepResult(arm, [7, 8], 1, 4, draft_s=9.0, verify_s=9.0)  # wall times are not read
    cost, ar = StepCosts(cm)(chain, 30)
    assert ar == pytest.approx(float(cm.ar_cost(30)))
    assert cost == pytest.approx(
        cm.draft_cost(arm) + float(cm.verify_cost(5, 30, True))
    )  # 4 drafts + the root
    tree = StepResult(arm, [7], 0, 3, 0.0, 0.0, parents=torch.tensor([-1, 0, 0, 1]))
    assert StepCosts(cm)(tree, 30)[0] == pytest.approx(
        cm.draft_cost(arm) + float(cm.verify_cost(4, 30, False))
    )
    plain = StepResult(NO_DRAFT, [7], 0, 0, 0.0, 0.0)
    assert StepCosts(cm)(plain, 30) == pytest.approx((float(cm.ar_cost(30)), float(cm.ar_cost(30))))


def test_the_observations_proposals_are_paid_and_a_cut_arm_drafts_nothing_more(cm):
    arm = Arm("ngram", TreeShape(depth=4))
    largest = Arm("ngram", TreeShape(16, 8))
    res = StepResult(arm, [7, 8], 1, 4, 0.0, 0.0)
    verify = float(cm.verify_cost(5, 30, True))
    assert cm.draft_cost(largest) > cm.draft_cost(arm) > 0
    observed = StepCosts(cm)(res, 30, [largest], 0.5, cut=True)[0]
    assert observed == pytest.approx(cm.draft_cost(largest) + verify)
    drafted = StepCosts(cm)(res, 30, [largest], 0.5, cut=False)[0]
    assert drafted == pytest.approx(cm.draft_cost(largest) + cm.draft_cost(arm) + verify)


def test_measured_costs_against_a_model_are_the_wall_time_and_its_autoregressive_unit(cm):
    res = StepResult(Arm("ngram", TreeShape(depth=4)), [7, 8], 1, 4, draft_s=0.25, verify_s=0.5)
    cost, ar = StepCosts(cm, measured=True)(res, 30, observe_s=0.125)
    assert (cost, ar) == (pytest.approx(0.875), pytest.approx(float(cm.ar_cost(30))))
    with pytest.raises(ValueError, match="need a cost model"):
        StepCosts(None, measured=True)


def test_a_step_cut_at_max_new_tokens_counts_and_rewards_only_its_counted_tokens():
    """The tiny model loops, so an n-gram chain's step commits several tokens: one that runs past
    ``max_new_tokens`` counts (``info["tokens"]``, the reward, the history) only those before the limit."""
    from drafters import make_drafter
    from env.batch import BatchEngine
    from env.engine import parse_arm
    from env.metrics import step_reward
    from env.step import Stepper
    from tests.env.conftest import tiny_words

    loaded = tiny_words()
    arm = parse_arm("ngram-d8")
    cut = 0
    for max_new in range(4, 24):
        engine = BatchEngine(loaded, max_rows=1)
        stepper = Stepper(engine, [arm])
        seq = stepper.start([5, 6, 7, 5, 6, 7, 5, 6], max_new, {"ngram": make_drafter("ngram")})
        total = 1
        while not seq.done:
            (out,) = stepper.step([0])
            assert out.info["tokens"] == len(out.tokens) <= len(out.result.committed)
            assert out.info["accepted"] <= out.info["tokens"]
            assert out.reward == pytest.approx(
                step_reward(len(out.tokens), out.info["cost_s"], out.info["ar_cost_s"])
            )
            cut += len(out.tokens) < len(out.result.committed)
            total += out.info["tokens"]
        assert total == len(seq.tokens) <= max_new
        stepper.retire(seq)
    assert cut  # some step ran past the limit
