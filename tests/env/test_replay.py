"""Replay functions: the vectorized tables equal the per-tree reference (prune + walk), and episodes commit
exactly the recorded trajectory whatever the arms."""

from __future__ import annotations

import numpy as np
import pytest

from drafters import TreeShape
from env.arms import make_arms
from env.engine import Arm
from env.replay import arm_columns, build_tables, greedy_walk, replay_accept, replay_step
from env.trace import TraceError

ARMS = make_arms(
    ["ngram-d1", "ngram-d3", "ngram-d8", "ngram-d16", "ngram-d4-k2", "ngram-d8-k4-b12", "ngram-d16-k8"]
)


def test_greedy_walk_known_cases():
    # root 0 -> [1 -> 2, 3 -> 4]; trajectory continues 3 4 9
    tokens, parents = [0, 1, 2, 3, 4], [-1, 0, 1, 0, 3]
    assert greedy_walk(tokens, parents, [3, 4, 9]) == 2
    assert greedy_walk(tokens, parents, [1, 2]) == 2  # stops at the trajectory's end
    assert greedy_walk(tokens, parents, [7]) == 0
    assert greedy_walk([0, 5, 5, 6], [-1, 0, 0, 2], [5, 6]) == 1  # the first matching child is taken


def test_vectorized_tables_equal_the_reference(toy_trace):
    tr = toy_trace
    for arm in ARMS:
        acc, drafted, chain, rejected = arm_columns(tr, arm)
        for p in range(tr.num_prompts):
            traj = tr.trajectory(p)
            for t in range(len(traj)):
                g = int(tr.traj_off[p]) + t
                toks, pars = tr.trees["ngram"].at(g)
                want = replay_accept(toks.tolist(), pars.tolist(), traj[t + 1 :], arm)
                assert (acc[g], drafted[g], bool(chain[g]), bool(rejected[g])) == want, (arm.name, p, t)
    assert arm_columns(tr, ARMS[3])[0].max() >= 3  # the synthetic text repeats: long drafts get accepted


def test_episodes_commit_the_trajectory_whatever_the_arms(toy_trace, toy_cost):
    tb = build_tables(toy_trace, ARMS, toy_cost)
    rng = np.random.default_rng(0)
    for p in range(toy_trace.num_prompts):
        if tb.length[p] < 2:
            continue
        pos, hist, total, steps = 0, np.zeros((1, 2 + len(ARMS)), np.float32), 1, 0
        while True:
            out = replay_step(tb, p, pos, hist, 0, int(rng.integers(len(ARMS))))
            assert 0 <= out.accepted <= out.tokens <= out.accepted + 1 and out.tokens >= 1
            pos, total, steps = int(out.pos), total + int(out.tokens), steps + 1
            if out.terminated or out.truncated:
                break
        assert total == tb.length[p]  # every recorded token committed exactly once
        assert bool(out.terminated) == bool(tb.eos[p]) and bool(out.truncated) != bool(tb.eos[p])


def test_max_new_tokens_caps_episodes(toy_trace, toy_cost):
    tb = build_tables(toy_trace, ARMS, toy_cost, max_new_tokens=10)
    assert tb.length.max() == 10 and tb.max_new_tokens == 10
    # a step the limit cuts counts only the accepted drafts that fit (no bonus after them)
    cut = (tb.accept > tb.tokens) & (tb.tokens > 0)
    assert cut.any() and (tb.accepted <= tb.tokens).all() and (tb.accepted[cut] == tb.tokens[cut]).all()
    with pytest.raises(TraceError, match="max_new_tokens must be in 2..40"):
        build_tables(toy_trace, ARMS, toy_cost, max_new_tokens=41)


def test_arms_the_trace_cannot_replay(toy_trace, toy_cost):
    with pytest.raises(TraceError, match="larger than the trees the trace recorded"):
        arm_columns(toy_trace, Arm("ngram", TreeShape(32)))
    with pytest.raises(TraceError, match="did not record"):
        arm_columns(toy_trace, Arm("eagle", TreeShape(4)))


def test_none_arm_is_one_token_at_ar_cost(toy_trace, toy_cost):
    tb = build_tables(toy_trace, ARMS, toy_cost)
    assert np.all(tb.accept[0] == 0) and np.all(tb.drafted[0] == 0)
    assert np.allclose(tb.cost[0], tb.ar_cost)
