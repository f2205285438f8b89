"""Replay prices a step as live does (``env.step.StepCosts``): with draft features every step pays the proposals its
observation made, whichever arm it takes, and an exact drafter's arm cut from its largest proposal drafts nothing
more; without them an arm pays its own drafting."""

from __future__ import annotations

import numpy as np

from drafters import TreeShape
from env.arms import make_arms
from env.engine import Arm
from env.features import DRAFT_DEPTH, DRAFT_WIDTH
from env.replay import build_tables
from env.trace import Trace, TreeArrays

ARMS = make_arms(["none", "ngram-d1", "ngram-d4", "ngram-d8-k4-b12"])


def test_draft_features_charge_the_observations_proposals_to_every_arm(toy_trace, toy_cost):
    plain = build_tables(toy_trace, ARMS, toy_cost)
    drafty = build_tables(toy_trace, ARMS, toy_cost, draft_features=True)
    observe = toy_cost.draft_cost(Arm("ngram", TreeShape(16, 8, 0)))  # the recorded largest shape
    assert observe > 0
    for i, arm in enumerate(ARMS):
        own = toy_cost.draft_cost(
            arm
        )  # paid without draft features; cut from the observed proposal with them
        want = plain.cost[i].astype(np.float64) - own + observe
        np.testing.assert_allclose(drafty.cost[i], want, rtol=1e-5, err_msg=arm.name)
    # the plain arm (no draft) is an autoregressive step plus the observation's proposal
    np.testing.assert_allclose(drafty.cost[0], plain.ar_cost + observe, rtol=1e-5)
    np.testing.assert_allclose(drafty.reward, drafty.tokens * drafty.ar_cost / drafty.cost, rtol=1e-5)


def test_draft_features_read_the_recorded_trees_width_and_depth(toy_trace, toy_cost):
    tb = build_tables(toy_trace, ARMS, toy_cost, draft_features=True)
    assert tb.feat.shape[1] == toy_trace.feat.shape[1] + 2
    np.testing.assert_array_equal(tb.feat[:, :-2], toy_trace.feat)
    widths = []
    for g in range(toy_trace.traj.shape[0]):
        _, pars = toy_trace.trees["ngram"].at(g)
        pars = [int(p) for p in pars]
        depth = [0] * len(pars)
        for i in range(1, len(pars)):
            depth[i] = depth[pars[i]] + 1
        width = sum(p == 0 for p in pars)  # the root's children (the root itself is no draft)
        widths.append(width)
        want = [min(width / DRAFT_WIDTH, 1.0), min(max(depth) / DRAFT_DEPTH, 1.0)]
        np.testing.assert_allclose(tb.feat[g, -2:], want, rtol=1e-6, err_msg=str(g))
    assert max(widths) >= 2  # branching trees among them


def _first_positions(trace: Trace, keep: list[int]) -> Trace:
    """``trace`` with prompt p's trajectory cut to its first ``keep[p]`` positions (their trees kept)."""
    pos = np.concatenate(
        [np.arange(int(trace.traj_off[p]), int(trace.traj_off[p]) + n) for p, n in enumerate(keep)]
    )
    t = trace.trees["ngram"]
    nodes = [np.arange(int(t.off[g]), int(t.off[g + 1])) for g in pos]
    sizes = [len(x) for x in nodes]
    idx = np.concatenate(nodes)
    tree = TreeArrays(np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64), t.tokens[idx], t.parents[idx])
    return Trace(trace.header, trace.prompt_tokens, trace.prompt_off, trace.traj[pos],
                 np.concatenate([[0], np.cumsum(keep)]).astype(np.int64), trace.feat[pos], {"ngram": tree})  # fmt: skip


def test_a_prompt_whose_first_token_ends_it_is_not_an_episode(toy_trace, toy_cost):
    keep = [int(n) for n in np.diff(toy_trace.traj_off)]
    keep[1] = 1  # decoding ended at the prefill's token: no step to take
    tb = build_tables(_first_positions(toy_trace, keep), ARMS, toy_cost)
    assert tb.length[1] == 1
    assert tb.startable.tolist() == [p for p in range(len(keep)) if p != 1]
