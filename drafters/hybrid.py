"""Hybrid trees: one draft tree from two drafters within one node budget (TensorRT-LLM's EAGLE-3 + suffix automaton;
Arctic Inference's suffix decoding switched per request against a model drafter, arXiv 2411.04975 section 4.3).

Both drafters propose for the arm's shape; their trees are merged into one prefix tree (a path both propose is one
path), and the ``shape.max_nodes`` draft nodes with the highest path probability -- either drafter's own estimate,
the larger where both propose a node -- are kept, at most ``shape.topk`` children per node. Path probabilities only
fall along a path, so the kept nodes always include their parents. A node without a score (a drafter that gives
none) counts ``unscored`` per level.

Before paying for the second (model) drafter, the first (cheap) one's tree is priced: when its expected accepted
length (the sum of its node probabilities) reaches ``skip_at`` and -- for a drafter that reports it, as the suffix
drafter does -- its suffix match is at least ``skip_match`` tokens long, its tree is proposed alone
(SuffixDecoding's adaptive rule: a long match is strong evidence; a one-token match with a single continuation
has probability 1 on every node and is not). The merged tree carries no draft distributions, so sampled
verification treats it as deterministic proposals (lossless for any tree).
"""

from __future__ import annotations

import heapq
import math
from typing import Any

import numpy as np
import torch

from drafters.base import (
    BatchProposer,
    DraftContext,
    DrafterError,
    DraftTree,
    Feedback,
    Forkable,
    TreeShape,
    carried_state,
    float_option,
    int_option,
    keyword_options,
    prepare_drafter,
    restore_state,
    shown,
)


def node_probs(tree: DraftTree, unscored: float) -> list[float]:
    """Path probability of every node (the root 1): from ``scores`` (log path probabilities), else ``unscored``
    per level for a first child, shared out geometrically among siblings in node order (the k-th child of a node
    gets ``unscored * (1 - unscored)**(k - 1)`` of its parent's): siblings never add up to more than their parent,
    so the sum over nodes, the expected accepted length, stays below the tree's depth. A chain gets
    ``unscored**level``."""
    n = tree.num_nodes
    if tree.scores is not None:
        p = tree.scores.float().exp().tolist()
        p[0] = 1.0
        return p
    parents = tree.parents.tolist()
    out = [1.0] * n
    rank = [0] * n  # children seen so far, per node
    for i in range(1, n):
        p = parents[i]
        out[i] = out[p] * unscored * (1.0 - unscored) ** rank[p]
        rank[p] += 1
    return out


def merge_trees(trees: list[DraftTree], probs: list[list[float]], shape: TreeShape) -> DraftTree:
    """The prefix-tree union of ``trees`` (same root), cut to the ``shape.max_nodes`` most probable draft nodes,
    ``shape.topk`` children per node and ``shape.depth`` levels. Ties keep the earlier tree's node first."""
    # union: node key = path of tokens; value = best probability
    best: dict[tuple[int, ...], float] = {}
    order: dict[tuple[int, ...], int] = {}
    root = int(trees[0].tokens[0])
    for t, p in zip(trees, probs):
        if int(t.tokens[0]) != root:
            raise DrafterError("hybrid parts proposed trees with different roots")
        toks, pars = t.tokens.tolist(), t.parents.tolist()
        paths: list[tuple[int, ...]] = [()]
        for i in range(1, len(toks)):
            path = (*paths[pars[i]], int(toks[i]))
            paths.append(path)
            if len(path) > shape.depth:
                continue
            if path not in best or p[i] > best[path]:
                best[path] = p[i]
            order.setdefault(path, len(order))
    # best-first from the root: a child enters only after its parent
    kids: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for path in best:
        kids.setdefault(path[:-1], []).append(path)
    tokens, parents = [root], [-1]
    scores = [0.0]
    index: dict[tuple[int, ...], int] = {(): 0}
    used: dict[tuple[int, ...], int] = {}
    heap = [(-best[c], order[c], c) for c in kids.get((), [])]
    heapq.heapify(heap)
    budget = shape.max_nodes
    while heap and len(tokens) - 1 < budget:
        neg, _, path = heapq.heappop(heap)
        parent = path[:-1]
        if used.get(parent, 0) >= shape.topk:
            continue
        used[parent] = used.get(parent, 0) + 1
        index[path] = len(tokens)
        tokens.append(path[-1])
        parents.append(index[parent])
        scores.append(math.log(max(-neg, 1e-30)))
        for c in kids.get(path, []):
            heapq.heappush(heap, (-best[c], order[c], c))
    return DraftTree(
        torch.tensor(tokens, dtype=torch.long),
        torch.tensor(parents, dtype=torch.long),
        scores=torch.tensor(scores, dtype=torch.float32),
    )


def _part_options(options: Any) -> dict[str, dict[str, Any]]:
    """The hybrid's ``options``: a table per drafter (``{"eagle3": {"vocab": 8192}}``; those of a drafter that is
    not a part are unused), keyed by registered drafter names."""
    if options is None:
        return {}
    if not isinstance(options, dict) or not all(isinstance(v, dict) for v in options.values()):
        raise DrafterError(f"hybrid option options must be a table of tables per part, got {shown(options)}")
    from drafters import DRAFTERS

    known = sorted(DRAFTERS)
    for n, opts in options.items():
        if n not in known:
            raise DrafterError(
                f"hybrid option options.{n}: {shown(n)} is not a drafter; known: {', '.join(known)}"
            )
        valid = keyword_options(DRAFTERS[n])
        for opt in opts:
            if opt not in valid:
                raise DrafterError(
                    f"hybrid option options.{n}.{opt}: {shown(opt)} is not an option of {n}; "
                    f"valid: {', '.join(valid)}"
                )
    return {n: dict(v) for n, v in options.items()}


class HybridDrafter:
    """``parts``: two registered drafter names, cheap first (``"suffix,eagle3"``); ``skip_at``: expected accepted
    length of the first tree at which the second is not asked (0: always merge), ``skip_match``: the suffix match
    that needs too; ``unscored``: per-level
    probability of a node without scores; ``options``: keyword options per part (``{"eagle3": {...}}``)."""

    name = "hybrid"
    exact_replay = False

    def __init__(
        self,
        parts: str | list[str] = "suffix,eagle3",
        skip_at: float = 2.5,
        skip_match: int = 4,
        unscored: float = 0.6,
        options: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        from drafters import DRAFTERS, make_drafter

        if isinstance(parts, str):
            names = [p.strip() for p in parts.split(",")]
        elif isinstance(parts, (list, tuple)) and all(isinstance(p, str) for p in parts):
            names = list(parts)
        else:
            raise DrafterError(
                f'hybrid option parts must be two drafter names ("suffix,eagle3"), got {shown(parts)}'
            )
        if len(names) != 2 or len(set(names)) != 2 or "hybrid" in names:
            raise DrafterError(f"hybrid needs two different drafters as parts, got {names}")
        for n in names:
            if n not in DRAFTERS:
                raise DrafterError(
                    f"unknown hybrid part {n!r}; known drafters: {', '.join(sorted(DRAFTERS))}"
                )
        self.part_names = names
        self.skip_at = float_option("hybrid", "skip_at", skip_at, 0.0, 1e6)
        self.skip_match = int_option("hybrid", "skip_match", skip_match, 0, 1 << 20)
        self.unscored = float_option("hybrid", "unscored", unscored, 0.0, 1.0, low_open=True)
        self.options = _part_options(options)
        self.parts: list[Any] = []
        for n in names:
            try:
                self.parts.append(make_drafter(n, **self.options.get(n, {})))
            except DrafterError as err:
                raise DrafterError(f"hybrid part {n}: {err}") from err
            except TypeError as err:  # an option the part does not take
                raise DrafterError(f"hybrid option options.{n}: {err}") from err
        self.skipped = 0  # proposals where the second drafter was not asked

    def fork(self) -> HybridDrafter:
        other = HybridDrafter.__new__(HybridDrafter)
        other.part_names, other.skip_at, other.unscored = self.part_names, self.skip_at, self.unscored
        other.skip_match = self.skip_match
        other.options = self.options
        other.parts = [p.fork() if isinstance(p, Forkable) else type(p)(**self.options.get(n, {}))
                       for p, n in zip(self.parts, self.part_names)]  # fmt: skip
        other.skipped = 0
        return other

    @property
    def cross_request(self) -> bool:
        """Whether a proposal may read other requests' tokens: where a part's may (the suffix part's cache)."""
        return any(getattr(p, "cross_request", False) for p in self.parts)

    def carried(self) -> dict[str, np.ndarray]:
        """Each part's carried state (``drafters.base.Carries``), its keys under the part's name."""
        return carried_state(dict(zip(self.part_names, self.parts)))

    def restore(self, arrays: dict[str, np.ndarray], vocab: int | None = None) -> None:
        restore_state(dict(zip(self.part_names, self.parts)), arrays, vocab)

    def prepare(self, target: Any) -> None:
        """Load the parts' files for ``target`` now (``drafters.base.prepare_drafter``)."""
        for p in self.parts:
            prepare_drafter(p, target)

    def reset(self, ctx: DraftContext) -> None:
        for p in self.parts:
            p.reset(ctx)

    def observe(self, ctx: DraftContext, feedback: Feedback) -> None:
        for p in self.parts:
            p.observe(ctx, feedback)

    def finish(self, ctx: DraftContext) -> None:
        for p in self.parts:
            finish = getattr(p, "finish", None)
            if finish is not None:
                finish(ctx)

    def propose(self, ctx: DraftContext, shape: TreeShape) -> DraftTree:
        return self.propose_batch([(self, ctx, shape)])[0]

    def propose_batch(self, items: list[tuple[HybridDrafter, DraftContext, TreeShape]]) -> list[DraftTree]:
        """Every row's first-part tree; the second part (batched when it can) only for the rows whose first tree
        is not strong enough alone; then the merges."""
        first = [d.parts[0].propose(ctx, shape) for d, ctx, shape in items]
        p_first = [node_probs(t, self.unscored) for t in first]

        def strong(i: int) -> bool:
            d = items[i][0]
            match = getattr(d.parts[0], "last_match", None)
            return (
                d.skip_at > 0
                and sum(p_first[i][1:]) >= d.skip_at
                and (match is None or match >= d.skip_match)
            )

        ask = [i for i, (_, _, shape) in enumerate(items) if shape.depth > 0 and not strong(i)]
        out = list(first)
        if ask:
            second_items = [(items[i][0].parts[1], items[i][1], items[i][2]) for i in ask]
            lead = second_items[0][0]
            if isinstance(lead, BatchProposer):
                seconds = lead.propose_batch(second_items)
            else:
                seconds = [d.propose(ctx, shape) for d, ctx, shape in second_items]
            for i, t2 in zip(ask, seconds):
                out[i] = merge_trees([first[i], t2], [p_first[i], node_probs(t2, self.unscored)], items[i][2])
        for i, (d, _, _) in enumerate(items):
            if i not in ask:
                d.skipped += 1
            if out[i].draft_probs is not None:  # deterministic proposals: any tree verifies losslessly
                out[i] = DraftTree(out[i].tokens, out[i].parents, scores=out[i].scores)
        return out
