"""``env.metrics``: the closed forms against known answers and simulation, ratios of sums, zero guards."""

from __future__ import annotations

import numpy as np
import pytest

from env.metrics import acceptance_rate, chain_expected_tokens, goodput, speedup, tau


def test_chain_expected_tokens_known_answers_and_a_simulation():
    """Tokens per step of a depth-k chain whose drafts are each accepted with probability alpha until the first
    rejection, plus the bonus token: known values, and a Monte-Carlo run of that process."""
    assert chain_expected_tokens(0.0, 5) == 1.0  # the bonus token alone
    assert chain_expected_tokens(1.0, 5) == 6.0  # every draft and the bonus
    assert chain_expected_tokens(0.5, 1) == pytest.approx(1.5)
    assert chain_expected_tokens(0.7, 6) == pytest.approx((1 - 0.7**7) / 0.3)
    rng = np.random.default_rng(0)
    for alpha, depth in ((0.3, 2), (0.7, 6), (0.9, 12)):
        draws = rng.random((200_000, depth)) < alpha
        accepted = np.where(
            draws.all(axis=1), depth, np.argmin(draws, axis=1)
        )  # run of accepts before a reject
        sim = float((accepted + 1).mean())
        assert sim == pytest.approx(chain_expected_tokens(alpha, depth), rel=0.01), (alpha, depth)


def test_goodput_is_tokens_over_the_span():
    assert goodput([10, 20], 1.0, 4.0) == pytest.approx(10.0)
    assert goodput([5], 2.0, 2.0) == 0.0  # no span: no rate (not a division by zero)


def test_tau_acceptance_and_speedup_known_values():
    """tau: committed tokens (the bonus included) per step, 1 for plain decoding; acceptance: accepted drafts
    over drafted; speedup: the method's rate over the baseline's. Zero guards: no steps, nothing drafted, no
    baseline."""
    assert (tau(10, 4), tau(7, 7), tau(0, 0)) == (2.5, 1.0, 0.0)
    assert (acceptance_rate(3, 4), acceptance_rate(0, 0)) == (0.75, 0.0)
    assert speedup(30.0, 20.0) == 1.5 and np.isnan(speedup(1.0, 0.0))
