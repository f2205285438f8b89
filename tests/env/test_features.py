"""Observation features: known answers for each piece, and numpy == torch for the batched history update."""

from __future__ import annotations

import math

import numpy as np
import torch

from env.features import (
    FeatureSpec,
    ObservationBuilder,
    assemble,
    feature_names,
    history_columns,
    history_init,
    history_inputs,
    history_update,
    observation_bounds,
    position_features,
    projection,
    suffix_match_length,
    target_features,
)


def test_suffix_match_length_known_cases():
    assert suffix_match_length([5], 16) == 0
    assert suffix_match_length([1, 2, 3], 16) == 0
    assert suffix_match_length([1, 2, 3, 9, 2, 3], 16) == 2  # "2 3" ended at index 2
    assert suffix_match_length([7, 1, 2, 3, 8, 1, 2, 3], 16) == 3
    assert suffix_match_length([4, 4, 4, 4], 16) == 3  # overlapping occurrences count, as in the n-gram index
    assert suffix_match_length([1, 2, 1, 2, 1, 2, 1, 2], 3) == 3  # capped


def test_target_features_uniform_and_peaked():
    v, h = 64, 12
    proj = projection(h, FeatureSpec(proj_dim=4))
    logits = torch.zeros(2, v)
    logits[1, 5] = 100.0  # all mass on one token
    out = target_features(logits, torch.randn(2, h), proj)
    assert out.shape == (2, 3 + 4) and out.dtype == np.float32
    assert math.isclose(out[0, 0], 1.0, rel_tol=1e-5) and math.isclose(out[0, 1], 1 / v, rel_tol=1e-5)
    assert (
        out[1, 0] < 1e-6
        and math.isclose(out[1, 1], 1.0, rel_tol=1e-6)
        and math.isclose(out[1, 2], 1.0, rel_tol=1e-6)
    )
    assert np.all(np.abs(out[:, 3:]) <= 1.0)


def test_a_masked_logit_adds_no_entropy():
    """A -inf logit (a masked token) has p = 0 and log p = -inf: 0 * -inf was NaN, and so the entropy feature."""
    proj = projection(12, FeatureSpec(proj_dim=4))
    logits = torch.zeros(1, 64)
    logits[0, 32:] = -math.inf  # half the vocabulary masked: uniform over 32 tokens
    out = target_features(logits, torch.randn(1, 12), proj)
    assert np.isfinite(out).all() and math.isclose(out[0, 0], math.log(32) / math.log(64), rel_tol=1e-5)


def test_projection_is_fixed_by_its_seed():
    a, b = projection(10, FeatureSpec()), projection(10, FeatureSpec())
    assert np.array_equal(a, b) and not np.array_equal(a, projection(10, FeatureSpec(proj_seed=1)))


def test_history_update_known_values():
    depths = np.array([0, 2, 4])
    hist = history_init(1, 3)
    # arm 2 (depth 4) accepted 2 of 4 drafted, committed 3 tokens; decay 0.5
    history_update(hist, 0, 2, history_inputs(2, 4, 3, depths[2], 5, 0.5))
    assert np.allclose(hist[0], [0.0, 0.0, 0.25, 3 / 5, 0.25])
    # the none arm drafts nothing: the acceptance averages stay
    history_update(hist, 0, 0, history_inputs(0, 0, 1, depths[0], 5, 0.5))
    assert np.allclose(hist[0], [0.0, 0.0, 0.25, 1 / 5, 0.25])
    # another decay: new = decay * old + (1 - decay) * x (at 0.5 the two weights are one number)
    hist = history_init(1, 2)
    history_update(hist, 0, 1, history_inputs(1, 1, 2, 1, 2, decay=0.9))
    assert np.allclose(hist[0], [0.0, 0.1, 1.0, 0.1])


def test_history_update_numpy_equals_torch_batched():
    rng = np.random.default_rng(0)
    depths = np.array([0, 2, 4, 8])
    b = 64
    hn = history_init(b, 4)
    ht = history_init(b, 4, like=torch.zeros(1))
    for _ in range(10):
        arm = rng.integers(4, size=b)
        drafted = depths[arm] * rng.integers(0, 2, size=b)
        acc = (drafted * rng.random(b)).astype(np.int64)
        tok = acc + 1
        history_update(hn, np.arange(b), arm, history_inputs(acc, drafted, tok, depths[arm], 9, 0.5))
        t = [torch.as_tensor(x) for x in (arm, acc, drafted, tok, depths[arm])]
        history_update(ht, torch.arange(b), t[0], history_inputs(t[1], t[2], t[3], t[4], 9, 0.5))
    assert np.allclose(hn, ht.numpy(), atol=1e-6)
    assert hn.min() >= 0.0 and hn.max() <= 1.0


def test_observation_layout_names_and_bounds():
    spec = FeatureSpec()
    names = feature_names(spec, ["none", "ngram-d2", "ngram-d8"], [0, 2, 8])
    assert names[:5] == ["position", "entropy", "top1_prob", "top1_margin", "match_len"]
    assert names[-4:] == ["accept/ngram-d2", "accept/ngram-d8", "last_tokens", "accept_rate_recent"]
    cols = history_columns([0, 2, 8])
    assert cols == slice(1, 5)  # "none" first: a contiguous slice
    assert history_columns([4, 0, 8]).tolist() == [0, 2, 3, 4]
    low, high = observation_bounds(spec, len(names))
    assert low[names.index("hidden_0")] == -1.0 and low[0] == 0.0 and np.all(high == 1.0)
    hist = np.arange(5, dtype=np.float32)[None] / 10  # [none, d2, d8, last_tokens, accept_rate_recent]
    pos_feat = np.full(4 + spec.proj_dim, 0.5, dtype=np.float32)
    obs = assemble(0.25, pos_feat, hist[0], cols, np.empty(len(names), np.float32))
    assert obs[0] == 0.25 and np.all(obs[1 : 5 + spec.proj_dim] == 0.5)
    assert np.allclose(obs[-4:], [0.1, 0.2, 0.3, 0.4])


def test_builder_observation_in_bounds():
    spec = FeatureSpec()
    b = ObservationBuilder(spec, ["none", "ngram-d4"], [0, 4], hidden_size=16)
    obs = b.observe(torch.randn(100), torch.randn(16), [1, 2, 3, 1, 2], generated=3, max_new_tokens=10)
    assert obs.shape == (b.size,) and obs.dtype == np.float32
    assert np.all(obs >= b.low) and np.all(obs <= b.high)
    assert math.isclose(obs[0], 0.3, rel_tol=1e-6) and math.isclose(obs[4], 2 / 16)
    pf = position_features(torch.randn(100), torch.randn(16), [1, 2], spec, b.proj)
    assert pf.shape == (4 + spec.proj_dim,)
