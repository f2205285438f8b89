"""Replay scores and oracles on the synthetic trace: the ordering every ceiling must obey, the dynamic programme
against brute force, and the batched replay against the single env stepping a policy."""

from __future__ import annotations

import itertools

import numpy as np

from policies.oracle import (
    best_static,
    oracle_scores,
    score_optimal_oracle,
    score_policy,
    score_static,
    static_table,
)
from policies.static import StaticPolicy


def test_plain_decoding_scores_one(synth_env):
    assert (
        abs(score_static(synth_env, 0).speedup - 1.0) < 1e-9
    )  # "none" is the AR loop: speedup 1 by definition


def test_ceilings_are_ordered(synth_env):
    statics = static_table(synth_env)
    best_arm, per_prompt, greedy, optimal = (o.speedup for o in oracle_scores(synth_env))
    assert best_arm == max(s.speedup for s in statics)
    assert best_arm <= per_prompt + 1e-9 <= optimal + 1e-9
    assert best_arm < greedy <= optimal + 1e-9
    for o in oracle_scores(synth_env):
        assert o.tokens.sum() == statics[0].tokens.sum()  # every method commits the same text


def test_optimal_oracle_equals_brute_force(synth_env):
    """Every arm sequence of one short prompt, enumerated: the dynamic programme finds the least total time."""
    tb = synth_env.tables
    p = int(np.argmin(np.where(tb.length >= 2, tb.length, 10**9)))
    n = int(tb.length[p]) - 1
    trimmed = synth_env.prompt_ids[p]
    arms = range(len(synth_env.arm_names))
    best = np.inf
    for seq in itertools.product(arms, repeat=min(n, 6)):
        pos, cost, i = 0, 0.0, 0
        while pos < n:
            a = seq[i] if i < len(seq) else 0  # past the enumerated prefix, plain steps
            g = tb.offset[p] + pos
            cost += float(tb.cost[a, g])
            pos += min(int(tb.accept[a, g]) + 1, n - pos)
            i += 1
        best = min(best, cost)
    opt = score_optimal_oracle(synth_env, [trimmed])
    assert opt.cost_s[0] <= best + 1e-9
    if n <= 6:
        assert abs(opt.cost_s[0] - best) < 1e-9


def test_batched_replay_equals_the_env_stepping_a_policy(synth_env):
    for arm in (1, 3):
        a = score_static(synth_env, arm)
        b = score_policy(StaticPolicy(synth_env.arm_names, arm=synth_env.arm_names[arm]), synth_env)
        assert np.allclose(a.cost_s, b.cost_s) and np.array_equal(a.tokens, b.tokens)
        assert np.array_equal(a.steps, b.steps)


def test_best_static_is_chosen_on_the_given_prompts(synth_env, synth_split):
    train = static_table(synth_env, synth_split.train)
    assert train[best_static(train)].speedup == max(s.speedup for s in train)
    assert set(train[0].prompts) == set(synth_split.train)
