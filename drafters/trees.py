"""Tree-shape builders shared by the drafters: chains, tries of token sequences, and the dynamic top-``budget``
tree of EAGLE-2 (arXiv 2406.16858): expand the top-k frontier nodes by path value at each depth, then keep the
``budget`` nodes of highest cumulative log-probability over all depths (a parent always outranks its children, so
the kept set is a tree)."""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass

import torch

from drafters.base import DrafterError, DraftTree, TreeShape, shown


def chain(root: int, tokens: Sequence[int], scores: Sequence[float] | None = None) -> DraftTree:
    """The chain root -> tokens[0] -> tokens[1] -> ...: ``parents = [-1, 0, 1, ..., d-1]``."""
    n = len(tokens) + 1
    out_scores = None if scores is None else torch.tensor([0.0, *scores], dtype=torch.float32)
    return DraftTree(
        tokens=torch.tensor([root, *tokens], dtype=torch.long),
        parents=torch.arange(-1, n - 1, dtype=torch.long),
        scores=out_scores,
    )


def trie(root: int, sequences: Sequence[Sequence[int]], budget: int) -> DraftTree:
    """Merge token sequences (best first) into a prefix tree under the root, keeping at most ``budget`` draft nodes.

    Children are created in order of first appearance, so the best sequence's tokens are tried first at every node.
    """
    tokens, parents = [root], [-1]
    children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for seq in sequences:
        cur = 0
        for tok in seq:
            node = children.get((cur, tok))
            if node is None:
                if len(tokens) - 1 >= budget:
                    break
                node = len(tokens)
                tokens.append(int(tok))
                parents.append(cur)
                children[(cur, tok)] = node
            cur = node
    return DraftTree(
        tokens=torch.tensor(tokens, dtype=torch.long), parents=torch.tensor(parents, dtype=torch.long)
    )


Expand = Callable[[list[int], "GrowingTree"], tuple[torch.Tensor, torch.Tensor]]
"""``expand(frontier, tree) -> (log_probs [F, K], tokens [F, K])``: the drafter's best children of each frontier
node (node ids of ``tree``), best first along K; ``-inf`` log-probs mark missing children. The drafter may read
``tree.tokens`` / ``tree.parents`` / ``tree.depths`` to know where each frontier node sits."""


@dataclass
class GrowingTree:
    """A draft tree under construction: parallel lists, node 0 the root, parents before children.
    ``scores`` are cumulative log-probabilities of the root-to-node path (0 at the root)."""

    tokens: list[int]
    parents: list[int]
    scores: list[float]
    depths: list[int]

    @classmethod
    def start(cls, root: int) -> GrowingTree:
        return cls([int(root)], [-1], [0.0], [0])

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, logp: float) -> int:
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.scores.append(self.scores[parent] + logp)
        self.depths.append(self.depths[parent] + 1)
        return len(self.tokens) - 1

    def to_tree(self) -> DraftTree:
        return DraftTree(
            tokens=torch.tensor(self.tokens, dtype=torch.long),
            parents=torch.tensor(self.parents, dtype=torch.long),
            scores=torch.tensor(self.scores, dtype=torch.float32),
        )


def _children(
    logp: torch.Tensor | list, toks: torch.Tensor | list, row: int, k: int
) -> list[tuple[float, int]]:
    """The first ``k`` finite (log-prob, token) pairs of one row of an ``expand`` answer (tensors, or the same as
    nested lists: a caller that answers many trees at once converts once)."""
    if isinstance(logp, torch.Tensor):
        lp, tk = logp[row, :k].tolist(), toks[row, :k].tolist()
    else:
        lp, tk = logp[row][:k], toks[row][:k]
    return [(a, int(b)) for a, b in zip(lp, tk) if a != -math.inf]


TreeSteps = Generator[tuple[list[int], "GrowingTree"], tuple[torch.Tensor, torch.Tensor], DraftTree]
"""A tree builder as a generator: it yields ``(frontier, tree)`` — an ``expand`` request — receives the answer
``(log_probs [F, K], tokens [F, K])`` (tensors or nested lists), and returns the finished ``DraftTree``. ``drive``
runs one with an ``expand`` function; a drafter that batches over sequences (``drafters.eagle.propose_batch``)
runs many in lockstep, one batched pass per round."""


def drive(steps: TreeSteps, expand: Expand) -> DraftTree:
    """Run a tree builder to its end, answering each request with ``expand``."""
    try:
        request = next(steps)
        while True:
            request = steps.send(expand(*request))
    except StopIteration as stop:
        return stop.value


def chain_tree(root: int, expand: Expand, depth: int, min_prob: float = 0.0) -> DraftTree:
    """Greedy chain: the drafter's top-1 child at each depth; stop early once the path probability falls below
    ``min_prob`` (the confidence stop of Kangaroo / DISCO / dynamic depth decoding, on the cumulative value)."""
    return drive(dynamic_steps(root, depth=depth, topk=1, budget=depth, min_prob=min_prob), expand)


def kary_tree(root: int, expand: Expand, depth: int, topk: int, budget: int) -> DraftTree:
    """Fixed k-ary tree, filled breadth first: every node of a level gets its ``topk`` best children (best first),
    level by level, until ``budget`` draft nodes or ``depth`` levels. Token Recycling expands a fixed template
    breadth first (arXiv 2408.08696); this is a balanced one of the arm's shape, not the paper's own template. With
    a model drafter it costs one ``expand`` call per level."""
    return drive(kary_steps(root, depth, topk, budget), expand)


def kary_steps(root: int, depth: int, topk: int, budget: int, min_prob: float = 0.0) -> TreeSteps:
    """``kary_tree`` as a generator (``TreeSteps``). Every node of a level is expanded: a node may have fewer
    than ``topk`` children (a lookup table's row, or a child below ``min_prob``, which is not added), so the ones
    after it fill the budget. Nodes whose path probability is below ``min_prob`` are not added."""
    g = GrowingTree.start(root)
    level = [0]
    min_logp = math.log(min_prob) if min_prob > 0 else -math.inf
    for _ in range(depth):
        if len(g) - 1 >= budget or not level:
            break
        logp, toks = yield level, g
        nxt = []
        for f, node in enumerate(level):
            for lp, tok in _children(logp, toks, f, topk):
                if len(g) - 1 >= budget:
                    break
                if g.scores[node] + lp < min_logp:
                    continue
                nxt.append(g.add(node, tok, lp))
        level = nxt
    return g.to_tree()


def dynamic_tree(
    root: int, expand: Expand, depth: int, topk: int, budget: int, min_prob: float = 0.0
) -> DraftTree:
    """EAGLE-2 expand-then-rerank (arXiv 2406.16858).

    Expand: at each depth, the ``topk`` frontier nodes of highest path value get ``topk`` children each (one
    ``expand`` call per depth, so a model drafter runs ``depth`` batched forwards); the ``topk`` best of those
    ``topk**2`` candidates form the next frontier. Rerank: of all candidates, keep the ``budget`` of highest
    cumulative log-probability (``rerank``). Nodes whose path probability is below ``min_prob`` are not expanded.
    """
    return drive(dynamic_steps(root, depth, topk, budget, min_prob), expand)


def dynamic_steps(root: int, depth: int, topk: int, budget: int, min_prob: float = 0.0) -> TreeSteps:
    """``dynamic_tree`` as a generator (``TreeSteps``)."""
    g = GrowingTree.start(root)
    frontier = [0]
    min_logp = math.log(min_prob) if min_prob > 0 else -math.inf
    for _ in range(depth):
        if not frontier:
            break
        logp, toks = yield frontier, g  # [F, K]
        new = [
            g.add(n, tok, lp) for f, n in enumerate(frontier) for lp, tok in _children(logp, toks, f, topk)
        ]
        new.sort(key=lambda n: (-g.scores[n], n))
        frontier = [n for n in new[:topk] if g.scores[n] >= min_logp]
    if min_prob > 0:  # candidates below the threshold go too (a parent outranks its children: still a tree)
        keep = [i for i in range(1, len(g)) if g.scores[i] >= min_logp]
        budget = min(budget, len(keep))
    return rerank(g.tokens, g.parents, g.scores, budget)


TREE_BUILDERS = ("chain", "kary", "dynamic")


def tree_option(owner: str, value: object) -> str:
    """A drafter's ``tree`` option: one of ``TREE_BUILDERS``, else a ``DrafterError`` listing them."""
    if not isinstance(value, str) or value not in TREE_BUILDERS:
        raise DrafterError(
            f"unknown tree builder {shown(value)} for {owner}; valid: {', '.join(TREE_BUILDERS)}"
        )
    return value


def build_tree(kind: str, root: int, expand: Expand, shape: TreeShape, min_prob: float = 0.0) -> DraftTree:
    """One entry point for drafters with probabilities: ``kind`` in ``TREE_BUILDERS``; ``shape.topk == 1`` is
    always a chain. ``shape.max_nodes`` bounds the draft nodes."""
    return drive(tree_steps(kind, root, shape, min_prob), expand)


def tree_steps(kind: str, root: int, shape: TreeShape, min_prob: float = 0.0) -> TreeSteps:
    """``build_tree`` as a generator (``TreeSteps``)."""
    if kind not in TREE_BUILDERS:
        raise DrafterError(f"unknown tree builder {kind!r}; valid: {', '.join(TREE_BUILDERS)}")
    if shape.depth == 0:
        return _done(DraftTree.root_only(root))
    if shape.topk == 1 or kind == "chain":  # at most the shape's node budget (eagle-d8-b4: 4 nodes)
        d = min(shape.depth, shape.max_nodes)
        return dynamic_steps(root, d, 1, d, min_prob)
    if kind == "kary":
        return kary_steps(root, shape.depth, shape.topk, shape.max_nodes, min_prob)
    return dynamic_steps(root, shape.depth, shape.topk, shape.max_nodes, min_prob)


def _done(tree: DraftTree) -> TreeSteps:
    return tree
    yield  # a generator that asks nothing


def rerank(tokens: list[int], parents: list[int], scores: list[float], budget: int) -> DraftTree:
    """Keep the root and the ``budget`` draft nodes of highest score, renumbered so that parents precede children
    (ties broken by creation order). Scores are cumulative log-probs, so a parent never ranks below its child;
    a node whose parent did not make the cut is skipped all the same (defensive: NaN scores)."""
    kept = {0}
    for i in sorted(range(1, len(tokens)), key=lambda i: (-scores[i], i)):
        if len(kept) > budget:
            break
        if parents[i] in kept:
            kept.add(i)
    keep = sorted(kept)  # creation order: parents were created before their children
    remap = {old: new for new, old in enumerate(keep)}
    new_parents = [-1] + [remap[parents[i]] for i in keep[1:]]
    return DraftTree(
        tokens=torch.tensor([tokens[i] for i in keep], dtype=torch.long),
        parents=torch.tensor(new_parents, dtype=torch.long),
        scores=torch.tensor([scores[i] for i in keep], dtype=torch.float32),
    )


def prune_indices(
    parents: Sequence[int], shape: TreeShape, scores: Sequence[float] | None = None
) -> list[int]:
    """The nodes (increasing indices, root first) that ``prune`` keeps; pure, on plain integer sequences, so that
    trace replay (numpy) and the drafters (torch) share one rule.

    1. nodes deeper than ``shape.depth`` go;
    2. every node keeps its first ``shape.topk`` children, in node order (children are tried in that order);
    3. of the survivors, the first ``shape.max_nodes`` draft nodes in node order stay, or, when the tree carries
       ``scores``, the highest-scoring ones (ties by node order; a node whose parent is not kept is skipped).
    Steps 1-2 compose (where the budget does not bind): pruning twice equals pruning once to the smaller shape.
    """
    n = len(parents)
    depth = [0] * n
    rank = [0] * n  # children seen so far, per node
    alive = [False] * n
    alive[0] = True
    survivors = []
    for i in range(1, n):
        p = int(parents[i])
        depth[i] = depth[p] + 1
        r = rank[p]
        rank[p] = r + 1
        if alive[p] and depth[i] <= shape.depth and r < shape.topk:
            alive[i] = True
            survivors.append(i)
    budget = shape.max_nodes
    if len(survivors) <= budget:
        return [0, *survivors]
    if scores is None:
        return [0, *survivors[:budget]]
    kept = {0}
    for i in sorted(survivors, key=lambda j: (-float(scores[j]), j)):
        if int(parents[i]) in kept:
            kept.add(i)
            if len(kept) > budget:
                break
    return sorted(kept)


def prune(tree: DraftTree, shape: TreeShape) -> DraftTree:
    """The tree cut down to ``shape`` (rules in ``prune_indices``), renumbered with parents before children."""
    if shape.depth == 0:
        return DraftTree.root_only(int(tree.tokens[0]))
    scores = None if tree.scores is None else tree.scores.tolist()
    keep = prune_indices(tree.parents.tolist(), shape, scores)
    if len(keep) == tree.num_nodes:
        return tree
    remap = {old: new for new, old in enumerate(keep)}
    parents = tree.parents.tolist()
    idx = torch.tensor(keep, dtype=torch.long)
    return DraftTree(
        tokens=tree.tokens[idx],
        parents=torch.tensor([-1] + [remap[parents[i]] for i in keep[1:]], dtype=torch.long),
        scores=None if tree.scores is None else tree.scores[idx],
        draft_probs=None if tree.draft_probs is None else tree.draft_probs[idx],
    )
