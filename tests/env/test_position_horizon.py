"""The ``position`` feature's horizon: a policy learned ``generated / max_new_tokens`` at its training env's
``max_new_tokens``; a run of another length keeps that denominator (``ObservationBuilder(horizon=...)``,
``Stepper(horizon=...)``, ``SpeculativeDecoder(position_horizon=...)``) so that it shows the policy the positions
it learned. The tiny target: greedy output is the same whatever the arms, so two runs visit the same roots."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from env.arms import make_arms
from env.decoder import SpeculativeDecoder
from env.features import FeatureSpec, ObservationBuilder
from tests.env.conftest import tiny_words
from tests.env.test_terminal_obs import motif_prompts


class Recorder:
    """Always arm 1; keeps every observation it is shown."""

    def __init__(self):
        self.seen: list[np.ndarray] = []

    def act(self, obs):
        self.seen.append(obs.copy())
        return 1


@pytest.fixture(scope="module")
def tiny():
    return tiny_words()


def builder(horizon=None) -> ObservationBuilder:
    return ObservationBuilder(FeatureSpec(), ["none", "ngram-d4"], [0, 4], 32, horizon=horizon)


def test_the_position_is_a_fraction_of_the_horizon_when_one_is_given():
    logits, hidden, tokens = torch.randn(96), torch.randn(32), [5, 6, 7]
    assert builder().observe(logits, hidden, tokens, 64, 512)[0] == pytest.approx(64 / 512)
    assert builder(128).observe(logits, hidden, tokens, 64, 512)[0] == pytest.approx(0.5)
    assert builder(128).observe(logits, hidden, tokens, 300, 512)[0] == 1.0  # capped, as the feature's range
    rest = builder().observe(logits, hidden, tokens, 64, 512)[1:]
    assert np.array_equal(builder(128).observe(logits, hidden, tokens, 64, 512)[1:], rest)


@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "128"])
def test_a_horizon_that_is_no_positive_integer_is_refused(tiny, bad):
    with pytest.raises(ValueError, match="horizon must be an integer >= 1"):
        builder(bad)
    with pytest.raises(ValueError, match="position horizon must be an integer >= 1"):
        SpeculativeDecoder(tiny, list(make_arms(["ngram-d4"])), policy=Recorder(), position_horizon=bad)


def test_a_short_run_shows_the_policy_the_positions_of_its_training_length(tiny):
    """A policy trained at 40 new tokens, run for 12: with the horizon it sees exactly what a run of 40 showed it
    at the same roots; without it (before the fix) positions 40/12 times larger."""
    prompt = motif_prompts(1)[0]
    arms = list(make_arms(["ngram-d4"]))
    long, short, plain = Recorder(), Recorder(), Recorder()
    SpeculativeDecoder(tiny, arms, policy=long).generate(prompt, max_new_tokens=40)
    SpeculativeDecoder(tiny, arms, policy=short, position_horizon=40).generate(prompt, max_new_tokens=12)
    SpeculativeDecoder(tiny, arms, policy=plain).generate(prompt, max_new_tokens=12)
    assert 1 < len(short.seen) < len(long.seen)
    for got, want in zip(short.seen, long.seen):
        assert np.array_equal(got, want)
    assert plain.seen[1][0] == pytest.approx(short.seen[1][0] * 40 / 12)  # the run's own length, as before
