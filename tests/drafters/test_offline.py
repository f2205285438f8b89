"""Offline greedy τ equals what the engine measures for drafters that depend only on the committed tokens."""

from __future__ import annotations

import pytest
import torch

from drafters import DraftTree, make_drafter
from drafters.offline import accepted, greedy_tau
from env.engine import parse_arm
from tests.drafters.tiny import decode, tiny_loaded


def test_accepted_follows_the_true_continuation():
    t = DraftTree(torch.tensor([0, 1, 2, 3, 4]), torch.tensor([-1, 0, 1, 0, 3]))
    assert accepted(t, [1, 2, 9]) == 2
    assert accepted(t, [3, 4]) == 2
    assert accepted(t, [5]) == 0
    assert accepted(t, []) == 0


@pytest.mark.parametrize("arm", ["ngram-d4", "ngram-d6-k2-b10", "suffix-d5", "suffix-d8-k3-b12"])
def test_offline_tau_equals_the_engine(arm):
    loaded = tiny_loaded()
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (9, 14)]
    prompts = [p * 2 for p in prompts]  # repeats: drafts get accepted
    a = parse_arm(arm)
    seqs, engine_steps = [], []
    for p in prompts:
        new, steps = decode(loaded, arm, p, 30)
        seqs.append((p + new, len(p)))
        engine_steps.append(steps)
    res = greedy_tau(make_drafter(a.drafter, cache_requests=0) if a.drafter == "suffix" else make_drafter(a.drafter),
                     a.shape, seqs)  # fmt: skip
    assert [r.steps for r in res] == engine_steps
    assert [r.committed for r in res] == [len(s) - n for s, n in seqs]
