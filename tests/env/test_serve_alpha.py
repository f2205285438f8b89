"""The serving env's per-row acceptance estimate (``env.serve_obs.update_alpha``): a step adds its accepted drafts
as successes and one failure only where a draft was rejected — not where the walk ran out of draft, which a tree
arm's shallower branch does while the arm's depth is larger — in replay (the flag packed beside the step's
outcome in ``ServeSim``, checked against the per-tree reference ``env.replay.replay_accept``) and live."""

from __future__ import annotations

import numpy as np

from env.engine import parse_arm
from env.replay import replay_accept
from env.serve_obs import DECAY, update_alpha
from env.serve_sim import ServeSim
from tests.env.conftest import serve_kw as kw


def test_a_fully_accepted_branch_is_no_failure():
    # a depth-2 branch of a 4-node tree of an arm of depth 12, accepted whole: two successes, no failure
    s, n = update_alpha(np.float64(0.0), np.float64(0.0), 2, 4, False)
    assert (s, n) == (2.0, 2.0)
    s, n = update_alpha(np.float64(0.0), np.float64(0.0), 1, 4, True)  # one accepted, then a rejection
    assert (s, n) == (1.0, 2.0)
    s, n = update_alpha(np.array([1.0, 1.0]), np.array([2.0, 2.0]), np.array([0, 0]), np.array([0, 3]),
                        np.array([True, True]))  # fmt: skip
    assert s.tolist() == [1.0, DECAY] and n.tolist() == [2.0, DECAY * 2 + 1]  # no draft: the counts stay


def test_the_replayed_estimate_counts_rejections_of_tree_arms(serve_trace):
    arms = ["none", "ngram-d2", "ngram-d8-k4-b12", "ngram-d16-k8"]
    sim = ServeSim(3, **kw(serve_trace, arms=arms, loads=["3"], requests=6, seed=1))
    sim.reset()
    parsed = [parse_arm(a) for a in arms]
    rng = np.random.default_rng(0)
    trees, leaf_ends, checked = 0, 0, 0
    tr = serve_trace
    while not sim.done().all():
        a = rng.integers(0, len(arms), size=sim.active.shape)
        act = sim.active.copy()
        s, n = sim.s.copy(), sim.n.copy()
        want_s, want_n = s.copy(), n.copy()
        for i, j in zip(*np.nonzero(act & ~sim.done()[:, None])):
            arm = parsed[a[i, j]]
            p, t = int(sim.prompt[i, j]), int(sim.pos[i, j])
            g = int(tr.traj_off[p]) + t
            toks, pars = tr.trees["ngram"].at(g)
            traj = tr.trajectory(p)
            acc, dr, chain, rejected = replay_accept(toks.tolist(), pars.tolist(), traj[t + 1 :], arm)
            acc = min(acc, len(traj) - 1 - t)  # cut at the episode's end, as the tables are
            want_s[i, j], want_n[i, j] = update_alpha(s[i, j], n[i, j], acc, dr, rejected)
            trees += dr > 0 and not chain
            leaf_ends += dr > 0 and not chain and not rejected and acc < arm.shape.depth
        _, o = sim.step(a)
        kept = act & ~o["end"].any(
            1, keepdims=True
        )  # servers where no row left (a leaving row's hole is refilled)
        assert np.allclose(sim.s[kept], want_s[kept]) and np.allclose(sim.n[kept], want_n[kept])
        checked += int(kept.sum())
    assert (
        trees > 20 and leaf_ends > 0 and checked > 100
    )  # tree arms were taken, and some walks ended at a shallow leaf
