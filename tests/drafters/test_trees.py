"""Tree builders on a toy expander with known probabilities: chain, fixed k-ary, EAGLE-2 dynamic top-budget."""

from __future__ import annotations

import math

import pytest
import torch

from drafters import DrafterError, TreeShape
from drafters.trees import GrowingTree, build_tree, dynamic_tree, kary_tree, rerank

PROBS = [0.6, 0.3, 0.1]


def toy_expand(calls: list[list[int]]):
    """Every node has children with probabilities 0.6, 0.3, 0.1; a child's token encodes its path
    (parent token * 10 + rank + 1), so a tree's tokens spell out where each node sits."""

    def expand(frontier: list[int], g: GrowingTree):
        calls.append(list(frontier))
        lp = torch.log(torch.tensor([PROBS] * len(frontier)))
        toks = torch.tensor([[g.tokens[n] * 10 + r + 1 for r in range(3)] for n in frontier])
        return lp, toks

    return expand


def _check_tree(tree):
    parents = tree.parents.tolist()
    assert parents[0] == -1 and all(0 <= p < i for i, p in enumerate(parents) if i)


def test_chain_takes_the_top_child_per_depth():
    calls = []
    t = build_tree("dynamic", 0, toy_expand(calls), TreeShape(depth=4, topk=1))
    assert t.tokens.tolist() == [0, 1, 11, 111, 1111]
    assert t.parents.tolist() == [-1, 0, 1, 2, 3]
    assert t.scores.exp().tolist() == pytest.approx([1, 0.6, 0.36, 0.216, 0.1296])
    assert len(calls) == 4


def test_chain_confidence_stop():
    t = build_tree("chain", 0, toy_expand([]), TreeShape(depth=6), min_prob=0.3)
    assert t.tokens.tolist() == [0, 1, 11]  # 0.6, 0.36 kept; 0.216 < 0.3 stops


def test_kary_fills_levels_breadth_first_within_budget():
    calls = []
    t = kary_tree(0, toy_expand(calls), depth=3, topk=2, budget=5)
    _check_tree(t)
    # level 1: 1, 2; level 2: children of 1 (11, 12) then of 2 (21) until the budget
    assert t.tokens.tolist() == [0, 1, 2, 11, 12, 21]
    assert t.parents.tolist() == [-1, 0, 0, 1, 1, 2]
    assert calls == [[0], [1, 2]]


def test_kary_full_binary_tree():
    t = kary_tree(0, toy_expand([]), depth=2, topk=2, budget=100)
    assert t.tokens.tolist() == [0, 1, 2, 11, 12, 21, 22]


def test_dynamic_tree_expands_topk_frontier_and_reranks():
    calls = []
    t = dynamic_tree(0, toy_expand(calls), depth=3, topk=2, budget=5)
    _check_tree(t)
    # depth 1: 1 (.6), 2 (.3); depth 2 candidates 11 (.36) 12 (.18) 21 (.18) 22 (.09) -> frontier 11, 12;
    # depth 3: 111 (.216) 112 (.108) 121 (.108) 122 (.036). Best 5: .6 .36 .3 .216 .18 (12 before 21: created first)
    assert calls == [[0], [1, 2], [3, 4]]
    assert sorted(t.tokens.tolist()) == [0, 1, 2, 11, 12, 111]
    probs = dict(zip(t.tokens.tolist(), t.scores.exp().tolist()))
    assert probs[111] == pytest.approx(0.216)
    assert t.parents.tolist()[t.tokens.tolist().index(111)] == t.tokens.tolist().index(11)


def test_dynamic_tree_is_the_best_budget_nodes_of_its_candidates():
    t = dynamic_tree(0, toy_expand([]), depth=4, topk=3, budget=10)
    scores = sorted(t.scores.tolist()[1:], reverse=True)
    # all candidates: fully expanded up to the frontier limit; the kept ones are the 10 most likely
    assert len(scores) == 10
    assert min(scores) >= math.log(0.6 * 0.3 * 0.3) - 1e-6


def test_missing_children_are_skipped():
    def expand(frontier, g):
        lp = torch.tensor([[math.log(0.5), -math.inf, -math.inf]] * len(frontier))
        return lp, torch.tensor([[7, 8, 9]] * len(frontier))

    t = build_tree("dynamic", 3, expand, TreeShape(depth=3, topk=3, budget=8))
    assert t.tokens.tolist() == [3, 7, 7, 7]


def test_rerank_keeps_parents_before_children():
    tokens, parents, scores = [0, 5, 6, 7, 8], [-1, 0, 1, 0, 2], [0.0, -0.1, -0.2, -3.0, -0.25]
    t = rerank(tokens, parents, scores, 3)
    assert t.tokens.tolist() == [0, 5, 6, 8]
    assert t.parents.tolist() == [-1, 0, 1, 2]


def test_unknown_builder():
    with pytest.raises(DrafterError, match="valid: chain, kary, dynamic"):
        build_tree("bushy", 0, toy_expand([]), TreeShape(depth=2, topk=2))


@pytest.mark.parametrize(
    "kind, shape, nodes",
    [("dynamic", TreeShape(depth=8, topk=1, budget=3), 3), ("kary", TreeShape(depth=8, topk=1, budget=3), 3),
     ("chain", TreeShape(depth=6, topk=4, budget=2), 2), ("chain", TreeShape(depth=6, topk=4), 6)],
)  # fmt: skip
def test_a_chain_keeps_to_the_node_budget(kind, shape, nodes):
    """A chain was grown to the shape's depth whatever its budget (eagle-d8-b4 drafted 8 nodes, priced as 4)."""
    calls: list[list[int]] = []
    t = build_tree(kind, 0, toy_expand(calls), shape)
    _check_tree(t)
    assert t.num_draft == nodes == min(shape.depth, shape.max_nodes) and len(calls) == nodes  # no wasted pass


def test_kary_fills_its_budget_past_nodes_without_children():
    """A lookup table's node may have no children: the next node's fill the budget (a cut of the level to
    budget / topk nodes assumed every node had topk)."""
    table = {0: [1, 2], 1: [], 2: [3, 4]}

    def expand(frontier, g):
        lp = torch.full((len(frontier), 2), -math.inf)
        toks = torch.zeros((len(frontier), 2), dtype=torch.long)
        for f, n in enumerate(frontier):
            for r, tok in enumerate(table.get(g.tokens[n], [])):
                lp[f, r], toks[f, r] = math.log(0.5), tok
        return lp, toks

    tree = kary_tree(0, expand, depth=2, topk=2, budget=4)
    assert tree.tokens.tolist() == [0, 1, 2, 3, 4] and tree.parents.tolist() == [-1, 0, 0, 2, 2]


def test_kary_honours_min_prob():
    """min_prob, documented for every tree kind of the model drafters, bounds the k-ary tree's paths too."""
    shape = TreeShape(depth=3, topk=2, budget=14)
    tree = build_tree("kary", 0, toy_expand([]), shape, min_prob=0.3)
    assert math.exp(float(tree.scores[1:].min())) >= 0.3 - 1e-6
    assert build_tree("kary", 0, toy_expand([]), shape).num_draft > tree.num_draft
