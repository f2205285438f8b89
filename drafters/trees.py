"""Tree-shape builders shared by the drafters: chains, tries of token sequences, and the dynamic top-``budget``
tree of EAGLE-2 (arXiv 2406.16858): expand the top-k frontier nodes by path value at each depth, then keep the
``budget`` nodes of highest cumulative log-probability over all depths (a parent always outranks its children, so
the kept set is a tree)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from drafters.base import DraftTree, TreeShape


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


def dynamic_tree(
    root: int,
    expand: Callable[[list[int]], tuple[torch.Tensor, torch.Tensor]],
    depth: int,
    topk: int,
    budget: int,
) -> DraftTree:
    """EAGLE-2 expand-then-rerank.

    ``expand(frontier)`` takes node ids of the growing tree and returns ``(log_probs [F, topk], tokens [F, topk])``,
    the drafter's top-k children of each frontier node (the drafter reads the tree built so far from the lists it
    is handed through ``dynamic_tree``'s node order: node ids index ``tokens``/``parents`` of the candidate tree).
    """
    tokens, parents, scores = [root], [-1], [0.0]
    frontier = [0]
    for _ in range(depth):
        logp, toks = expand(frontier)  # logp, toks: [F, topk]
        cand = []
        for f, node in enumerate(frontier):
            for j in range(toks.shape[1]):
                cand.append((scores[node] + float(logp[f, j]), node, int(toks[f, j])))
        cand.sort(key=lambda c: -c[0])
        new_frontier = []
        for score, parent, tok in cand[: max(topk, 1) * max(1, len(frontier))]:
            tokens.append(tok)
            parents.append(parent)
            scores.append(score)
            new_frontier.append(len(tokens) - 1)
        frontier = sorted(new_frontier, key=lambda n: -scores[n])[:topk]
    return rerank(tokens, parents, scores, budget)


def rerank(tokens: list[int], parents: list[int], scores: list[float], budget: int) -> DraftTree:
    """Keep the root and the ``budget`` draft nodes of highest score, renumbered so that parents precede children
    (ties broken by creation order). Scores are cumulative log-probs, so a parent never ranks below its child."""
    order = sorted(range(1, len(tokens)), key=lambda i: (-scores[i], i))[:budget]
    keep = sorted([0, *order])  # creation order: parents were created before their children
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
    Steps 1-2 compose: pruning a pruned tree to a smaller shape equals pruning the original to it.
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
