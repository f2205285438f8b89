"""The tree validator (``drafters.check_tree`` / ``tree_problem``, DESIGN.md "Trees") against the definition, on
arbitrary parent arrays; and every tree it accepts verifies into a root-to-node path of that tree."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
from drafters import DrafterError, check_tree, tree_problem

V = 11


def is_tree(parents: list[int]) -> bool:
    """The definition: node 0 is the root (parent -1); every other node's parent is an earlier node."""
    return bool(parents) and parents[0] == -1 and all(0 <= p < i for i, p in enumerate(parents) if i)


@settings(max_examples=500, deadline=None)
@given(st.lists(st.integers(-3, 12), min_size=0, max_size=14), st.integers(0, 2**32 - 1))
def test_the_validator_accepts_exactly_the_trees(parents, seed):
    tokens = np.random.default_rng(seed).integers(0, V, size=len(parents)).tolist()
    problem = tree_problem([0, len(parents)], tokens, parents, V) if parents else "empty"
    assert (problem is None) == is_tree(parents), (parents, problem)
    if problem is None:
        check_tree(tokens, parents, V)
    else:
        with pytest.raises(DrafterError):
            check_tree(tokens, parents, V)


@st.composite
def trees(draw):
    n = draw(st.integers(1, 12))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = draw(st.lists(st.integers(0, V - 1), min_size=n, max_size=n))
    return tokens, parents


@settings(max_examples=200, deadline=None)
@given(st.lists(trees(), min_size=1, max_size=4), st.integers(0, 2**32 - 1))
def test_packed_trees_and_their_greedy_verdicts(batch, seed):
    off = np.cumsum([0] + [len(t) for t, _ in batch])
    tokens = [x for t, _ in batch for x in t]
    parents = [x for _, p in batch for x in p]
    assert tree_problem(off, tokens, parents, V) is None
    n = max(len(t) for t, _ in batch)
    tok = torch.zeros(len(batch), n, dtype=torch.long)
    par = torch.full((len(batch), n), -1, dtype=torch.long)
    for b, (t, p) in enumerate(batch):
        tok[b, : len(t)], par[b, : len(p)] = torch.tensor(t), torch.tensor(p)
    logits = torch.randn(len(batch), n, V, generator=torch.Generator().manual_seed(seed))
    num = torch.tensor([len(t) for t, _ in batch])
    v = kernels.verify(tok, par, logits, num_nodes=num)
    for b, (t, p) in enumerate(batch):
        path = [int(i) for i in v.path[b] if i >= 0]
        assert path[0] == 0 and len(path) == int(v.accept_len[b]) + 1
        for a, c in zip(path, path[1:]):
            assert p[c] == a and t[c] == int(logits[b, a].argmax())
        assert int(v.next_token[b]) == int(logits[b, path[-1]].argmax())


def test_named_problems():
    assert "parent" in tree_problem([0, 3], [1, 2, 3], [-1, 0, 2])
    assert "vocabulary" in tree_problem([0, 2], [1, 99], [-1, 0], V)
    assert "non-empty" in tree_problem([0, 0, 2], [1, 2], [-1, 0])
    assert "parents" in tree_problem([0, 2], [1, 2], [-1, 0, 0])
    with pytest.raises(DrafterError, match="not a valid draft tree"):
        check_tree(torch.tensor([1, 2]), torch.tensor([0, 0]))
