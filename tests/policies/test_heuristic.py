"""The hand-written schedules, against their definitions."""

from __future__ import annotations

import numpy as np
import pytest

from policies import PolicyError
from policies.heuristic import ConfidencePolicy, HFSchedulePolicy, arm_for_length, chain_arms, roc_threshold
from policies.static import StaticPolicy

ARMS = ["none", "ngram-d1", "ngram-d2", "ngram-d4", "ngram-d6", "ngram-d8", "ngram-d4-k2"]


def test_hf_schedule_plus_two_on_full_acceptance_minus_one_otherwise():
    p = HFSchedulePolicy(ARMS, initial=4)
    assert ARMS[p.act(None)] == "ngram-d4"
    p.update(None, ARMS.index("ngram-d4"), 5.0, {"accepted": 4, "drafted": 4})
    assert p.depth == 6 and ARMS[p.act(None)] == "ngram-d6"
    p.update(None, ARMS.index("ngram-d6"), 1.0, {"accepted": 2, "drafted": 6})
    assert p.depth == 5 and ARMS[p.act(None)] == "ngram-d4"  # largest menu depth not above 5
    for _ in range(10):
        p.update(None, p.act(None), 1.0, {"accepted": 0, "drafted": 3})
    assert p.depth == 1  # never below the shallowest chain
    for _ in range(10):
        a = p.act(None)
        p.update(None, a, 1.0, {"accepted": int(ARMS[a].split("-d")[1]), "drafted": 8})
    assert p.depth == 8  # capped at the deepest chain
    p.update(None, p.act(None), 1.0, {"accepted": 0, "drafted": 0})
    assert p.depth == 8  # nothing drafted: nothing learned
    p.reset()
    assert p.depth == 4


def test_confidence_length_is_the_threshold_rule():
    feats = ["position", "top1_prob"]
    p = ConfidencePolicy(ARMS, 2, feats, threshold=0.4, refit=False)
    assert p.feature == "top1_prob"
    # a^i >= 0.4: a = 0.9 -> i <= 8.7; a = 0.5 -> i <= 1.3; a = 0.3 -> none
    assert ARMS[p.act(np.array([0.0, 0.9]))] == "ngram-d8"
    assert ARMS[p.act(np.array([0.0, 0.5]))] == "ngram-d1"
    assert ARMS[p.act(np.array([0.0, 0.3]))] == "none"
    with pytest.raises(PolicyError, match="not in the observation"):
        ConfidencePolicy(ARMS, 2, feats, feature="entropy")


def test_confidence_labels_each_drafted_level_by_whether_it_was_accepted():
    """A depth-4 chain at top-1 probability 0.9, two drafts accepted: the levels' confidences 0.9^i, labelled
    accepted for i <= 2, the pairs the threshold is refitted on."""
    c = ConfidencePolicy(
        ["none", "ngram-d1", "ngram-d2", "ngram-d4"], 2, ["position", "top1_prob"], refit=True
    )
    c.act(np.array([0.0, 0.9]))
    c.update(None, 3, 1.0, {"accepted": 2, "drafted": 4})
    assert [(round(p, 3), ok) for p, ok in c.pairs] == [
        (0.9, True),
        (0.81, True),
        (0.729, False),
        (0.656, False),
    ]


def test_roc_threshold_minimises_fpr_plus_three_fnr():
    rng = np.random.default_rng(0)
    p = rng.random(4000)
    y = rng.random(4000) < p  # accepted with probability p
    t = roc_threshold(p, y)
    grid = np.linspace(0.01, 0.99, 99)

    def cost(th):
        pred = p >= th
        return (pred & ~y).sum() / (~y).sum() + 3 * (~pred & y).sum() / y.sum()

    assert cost(t) <= min(cost(g) for g in grid) + 1e-12
    assert t < 0.5  # false negatives weigh 3x: the threshold sits low
    assert roc_threshold(p, np.ones(4000, dtype=bool)) is None


def test_static_always_its_arm():
    p = StaticPolicy(ARMS, arm="ngram-d4-k2")
    assert {p.act(None) for _ in range(5)} == {ARMS.index("ngram-d4-k2")}


def test_confidence_refit_moves_the_threshold_to_the_roc_point():
    """Drafts accepted exactly when the confidence is >= 0.7: the refit threshold is the ROC point of the pairs
    (the smallest accepted confidence), not the initial 0.4."""
    c = ConfidencePolicy(["none", "ngram-d1"], 1, ["top1_prob"], threshold=0.4, refit_every=1)
    rng = np.random.default_rng(0)
    for a in rng.uniform(0.05, 0.95, 100):
        c.act(np.array([a]))
        c.update(None, 1, 1.0, {"accepted": int(a >= 0.7), "drafted": 1})
    probs = np.array([q for q, _ in c.pairs])
    labels = np.array([ok for _, ok in c.pairs])
    assert c.threshold == roc_threshold(probs, labels)
    assert 0.7 <= c.threshold < 0.75


def test_a_length_below_the_shallowest_chain_drafts_that_chain_not_none():
    """Length 1.5 on a menu whose chains start at depth 2: the shallowest drafting arm; only a length below 1 is
    "none"."""
    arms = ["none", "ngram-d2", "ngram-d4"]
    _, by_depth = chain_arms(arms)
    assert arms[arm_for_length(by_depth, 1.5)] == "ngram-d2"
    assert arms[arm_for_length(by_depth, 0.5)] == "none"
    assert arms[arm_for_length(by_depth, 4.0)] == "ngram-d4"
