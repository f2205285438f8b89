"""Token Recycling (Luo et al., arXiv 2408.08696): training-free drafting from the target's own past predictions.

An adjacency table ``ids[V, K]`` holds, for every token id ``v``, the ``K`` tokens the target found most likely to
follow ``v`` the last time ``v`` was verified (with their log-probabilities ``logp[V, K]``, which the paper does
not keep; we keep them so that the dynamic tree can rank paths). Each step, the tree is grown from the root by
looking rows up: breadth first over a fixed k-ary template as in the paper (``tree="kary"``), or EAGLE-2's
dynamic top-``budget`` tree on the stored probabilities (``tree="dynamic"``, default). After verification, the rows
of every verified token are overwritten with the target's fresh top-K (the paper's update: all tree nodes, the
accepted path last so that it wins when a token occurs twice).

The table outlives a sequence ("hot start" across queries, as in the paper), so the drafter is stateful and its
proposals depend on what was decoded before: ``exact_replay = False``. ``fork`` gives another sequence (a served
request) a drafter over the same table: every request's verifications fill it for all, as one table does for a
server in the paper. Memory: ``V * K`` int64 + float32 (49152 x 8:
4.7 MB).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from drafters.base import (
    DraftContext,
    DrafterError,
    DraftTree,
    Feedback,
    TreeShape,
    float_option,
    int_array,
    int_option,
)
from drafters.trees import GrowingTree, build_tree, tree_option

MAX_WIDTH = 256  # the table is V x width (int64 + float32): 150 MB at V = 49152


def _shared(name: str) -> property:
    """An attribute kept in the drafter's ``_table``, which its forks share."""
    return property(lambda self: self._table[name], lambda self, value: self._table.__setitem__(name, value))


class RecyclingDrafter:
    """Adjacency-table drafter. ``width`` = K candidates kept per token; ``tree`` = ``kary`` | ``dynamic``;
    ``prompt_prior`` = log-prob given to "the token that followed v in the prompt" for rows never verified."""

    name = "recycling"
    exact_replay = False
    cross_request = True  # the table learns from every request served before

    def __init__(self, width: int = 8, tree: str = "dynamic", prompt_prior: float = math.log(0.2)) -> None:
        self.width = int_option("recycling", "width", width, 1, MAX_WIDTH)
        self.tree = tree_option("recycling", tree)
        # a log-probability: finite and <= 0 (a NaN would poison every path score it enters)
        self.prompt_prior = float_option("recycling", "prompt_prior", prompt_prior, -1e4, 0.0)
        # ids [V, K] int64 (-1: no candidate) and logp [V, K] float32 (-inf: no candidate), shared by forks
        self._table: dict[str, torch.Tensor | None] = {"ids": None, "logp": None}

    ids = _shared("ids")
    logp = _shared("logp")

    def fork(self) -> RecyclingDrafter:
        """A drafter for another sequence over the same table (hot start across requests in serving)."""
        other = RecyclingDrafter(self.width, self.tree, self.prompt_prior)
        other._table = self._table
        return other

    # ---- the table as arrays (``drafters.base.Carries``) ----
    def carried(self) -> dict[str, np.ndarray]:
        """The table (``ids``, ``logp``); none before the first sequence."""
        if self.ids is None:
            return {}
        return {"ids": self.ids.numpy().copy(), "logp": self.logp.numpy().copy()}

    def restore(self, arrays: dict[str, np.ndarray], vocab: int | None = None) -> None:
        """The table from ``carried()``'s arrays (checked; ``vocab``: the target's vocabulary size, which the table
        must have as its rows — drafting replaces a table of another size with an empty one), shared with the
        forks; none given: empty again."""
        if not arrays:
            self.ids = self.logp = None
            return
        ids = int_array("recycling", "ids", arrays, 2)
        logp = arrays.get("logp")
        size = ids.shape[0]
        if ids.shape[1] != self.width or size < 1:
            raise DrafterError(
                f"recycling state: ids must be [vocab, {self.width}] (width), got {list(ids.shape)}"
            )
        if not isinstance(logp, np.ndarray) or logp.shape != ids.shape or logp.dtype.kind != "f":
            raise DrafterError(
                f"recycling state: logp must be a float array of the shape of ids, {list(ids.shape)}"
            )
        if ids.min() < -1 or ids.max() >= size:
            raise DrafterError(f"recycling state: a token id outside -1..{size - 1}")
        if vocab is not None and size != vocab:
            raise DrafterError(
                f"recycling state: a table of {size} token ids, not the target's vocabulary of {vocab}"
            )
        empty = ids < 0
        if np.isnan(logp).any() or (logp > 0).any() or np.isfinite(logp[empty]).any():
            raise DrafterError("recycling state: logp must be log-probabilities (<= 0), -inf where ids is -1")
        self.ids = torch.from_numpy(ids.copy())
        self.logp = torch.from_numpy(logp.astype(np.float32))

    # ---- table ----
    def _ensure(self, vocab: int) -> None:
        if self.ids is None or self.ids.shape[0] != vocab:
            self.ids = torch.full((vocab, self.width), -1, dtype=torch.long)
            self.logp = torch.full((vocab, self.width), -math.inf, dtype=torch.float32)

    def _check_ids(self, ids: torch.Tensor, what: str) -> None:
        """``DrafterError`` for ids that are not rows of the table: a negative id wrapped round to row V - k, and
        the table (which outlives the sequence) proposed what was written there."""
        if ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise DrafterError(f"recycling: {what} holds {ids.dtype} values, not token ids")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.ids.shape[0]):
            bad = ids[(ids < 0) | (ids >= self.ids.shape[0])][0]
            raise DrafterError(
                f"recycling: {what} holds token id {int(bad)}, outside the vocabulary of {self.ids.shape[0]}"
            )

    def update(self, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """Overwrite the rows of ``tokens`` ([S]) with the top-K of ``logits`` ([S, V]); later rows win."""
        self._ensure(int(logits.shape[-1]))
        self._check_ids(tokens, "a verified tree")
        lp = torch.log_softmax(logits.float(), dim=-1)
        k = min(
            self.width, int(lp.shape[-1])
        )  # a vocabulary smaller than the width: its columns past V stay empty
        top_lp, top_ids = lp.topk(k, dim=-1)  # [S, k]
        top_lp, top_ids = top_lp.cpu(), top_ids.cpu()  # the table lives on the CPU, next to tree building
        # index_put_ with repeated indices keeps an unspecified one: write in order, last occurrence wins
        last: dict[int, int] = {int(t): i for i, t in enumerate(tokens.tolist())}
        rows = torch.tensor(list(last.keys()), dtype=torch.long)
        src = torch.tensor(list(last.values()), dtype=torch.long)
        self.ids[rows, :k] = top_ids[src]
        self.logp[rows, :k] = top_lp[src]

    def seed_from_prompt(self, tokens: list[int]) -> None:
        """Rows never verified get the prompt's own bigram (what first followed v in the prompt) as one candidate,
        replacing an earlier prompt's seed (the table outlives a sequence): a row is a seed when its only entry
        carries ``prompt_prior`` (a verified row holds the top ``width`` of the target's logits)."""
        if self.ids is None or len(tokens) < 2:
            return
        first: dict[int, int] = {}
        for a, b in zip(tokens[:-1], tokens[1:]):
            first.setdefault(int(a), int(b))
        prev = torch.tensor(list(first.keys()), dtype=torch.long)
        nxt = torch.tensor(list(first.values()), dtype=torch.long)
        self._check_ids(torch.cat([prev, nxt]), "the prompt")
        only = self.ids[prev, 1] < 0 if self.ids.shape[1] > 1 else torch.ones(len(prev), dtype=torch.bool)
        seeded = only & (self.logp[prev, 0] == self.prompt_prior)
        empty = (self.ids[prev, 0] < 0) | seeded
        self.ids[prev[empty], 0] = nxt[empty]
        self.logp[prev[empty], 0] = self.prompt_prior

    # ---- Drafter protocol ----
    def reset(self, ctx: DraftContext) -> None:
        vocab = 0 if ctx.target is None else int(ctx.target.vocab_size)
        if vocab:
            self._ensure(vocab)
        self.seed_from_prompt(ctx.tokens)

    def _expand(self, frontier: list[int], g: GrowingTree) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.tensor([g.tokens[n] for n in frontier], dtype=torch.long)
        return self.logp[rows], self.ids[rows]  # [F, K] each, best first (topk order)

    def propose(self, ctx: DraftContext, shape: TreeShape) -> DraftTree:
        root = ctx.tokens[-1]
        if shape.depth == 0 or self.ids is None or not 0 <= root < self.ids.shape[0]:
            return DraftTree.root_only(root)
        return build_tree(self.tree, root, self._expand, shape)

    def observe(self, ctx: DraftContext, feedback: Feedback) -> None:
        tree = feedback.tree
        logits = getattr(feedback, "tree_logits", None)
        if logits is not None and logits.shape[0] == tree.num_nodes:
            self.update(tree.tokens, logits)  # every verified node (paper); the path is written again below
        if feedback.path_logits is not None:
            s = int(feedback.path_logits.shape[0])
            path_tokens = [int(tree.tokens[0]), *feedback.committed[: s - 1]]
            self.update(torch.tensor(path_tokens, dtype=torch.long), feedback.path_logits)
