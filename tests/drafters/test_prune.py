"""``prune``: the rule that makes replay exact. Known small cases, composition, and the n-gram drafter's proposal
for any shape equal to the pruned largest proposal."""

from __future__ import annotations

import random

import torch

from drafters import DraftContext, DraftTree, NGramDrafter, TreeShape
from drafters.trees import prune, prune_indices, trie

#        0
#      / | \
#     1  4  6        depth 1 (root's children in order 1, 4, 6)
#    / \  \
#   2   3  5         depth 2
#   |
#   7                depth 3
PARENTS = [-1, 0, 1, 1, 0, 4, 0, 2]


def test_depth_topk_budget_rules():
    assert prune_indices(PARENTS, TreeShape(depth=1, topk=8)) == [0, 1, 4, 6]
    assert prune_indices(PARENTS, TreeShape(depth=8, topk=1)) == [0, 1, 2, 7]  # the first-child chain
    assert prune_indices(PARENTS, TreeShape(depth=3, topk=2)) == [0, 1, 2, 3, 4, 5, 7]
    assert prune_indices(PARENTS, TreeShape(depth=2, topk=2)) == [0, 1, 2, 3, 4]  # default budget depth*topk
    assert prune_indices(PARENTS, TreeShape(depth=8, topk=2, budget=3)) == [
        0,
        1,
        2,
        3,
    ]  # first 3 in node order
    scores = [0.0, -1.0, -1.5, -3.0, -0.5, -0.6, -4.0, -2.0]
    assert prune_indices(PARENTS, TreeShape(depth=8, topk=8, budget=3), scores) == [0, 1, 4, 5]


def test_prune_renumbers_parents_before_children():
    tree = DraftTree(tokens=torch.arange(10, 18), parents=torch.tensor(PARENTS))
    out = prune(tree, TreeShape(depth=2, topk=1))
    assert out.tokens.tolist() == [10, 11, 12]
    assert out.parents.tolist() == [-1, 0, 1]
    assert prune(tree, TreeShape(depth=0)).num_nodes == 1
    assert prune(tree, TreeShape(depth=9, topk=9)) is tree


def _random_tree(rng: random.Random, n: int) -> list[int]:
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def test_depth_and_topk_pruning_compose():
    # where the node budget does not bind, pruning twice equals pruning once to the smaller shape
    rng = random.Random(0)
    checked = 0
    for _ in range(400):
        parents = _random_tree(rng, rng.randrange(1, 30))
        big = TreeShape(depth=rng.randrange(1, 8), topk=rng.randrange(1, 5))
        small = TreeShape(depth=rng.randrange(1, big.depth + 1), topk=rng.randrange(1, big.topk + 1))
        kept = prune_indices(parents, big)
        if len(kept) - 1 >= big.max_nodes or len(prune_indices(parents, small)) - 1 >= small.max_nodes:
            continue
        checked += 1
        remap = {old: new for new, old in enumerate(kept)}
        sub_parents = [-1] + [remap[parents[i]] for i in kept[1:]]
        twice = [kept[i] for i in prune_indices(sub_parents, small)]
        assert twice == prune_indices(parents, small)
    assert checked > 50


def test_ngram_proposal_is_the_pruned_largest_tree():
    rng = random.Random(1)
    d = NGramDrafter()
    for _ in range(30):
        toks = [rng.randrange(6) for _ in range(rng.randrange(2, 60))]
        ctx = DraftContext(tokens=toks, prompt_len=len(toks))
        d.reset(ctx)
        largest = d.propose(ctx, d.max_shape)
        for shape in (TreeShape(1), TreeShape(4), TreeShape(8, 2), TreeShape(8, 4, 6), TreeShape(16, 8, 24)):
            got = d.propose(ctx, shape)
            want = prune(largest, shape)
            assert (
                got.tokens.tolist() == want.tokens.tolist() and got.parents.tolist() == want.parents.tolist()
            )


def test_ngram_chains_are_the_best_continuation():
    toks = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    d = NGramDrafter(max_ngram=3)
    ctx = DraftContext(tokens=toks, prompt_len=len(toks))
    d.reset(ctx)
    best = d.continuations(toks, 16, 1)[0]
    for depth in (1, 2, 3, 5, 9):
        assert d.propose(ctx, TreeShape(depth)).tokens.tolist() == [3, *best[:depth]]
    assert trie(3, [best], 16).tokens.tolist() == d.propose(ctx, TreeShape(16)).tokens.tolist()
