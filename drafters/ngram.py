"""Prompt lookup / n-gram drafter: match the last n committed tokens (n from ``max_ngram`` down to ``min_ngram``)
against the prompt and the text generated so far, and propose what followed the most recent matches. Several
matches with different continuations become branches of a tree.

References: Prompt Lookup Decoding (Saxena, 2023); "Spec-Bench" (arXiv 2401.07851) for its per-task behaviour;
SAM decoding (arXiv 2411.10666) for suffix matching over the context.
"""

from __future__ import annotations

from drafters.base import DraftContext, DrafterError, DraftTree, Feedback, TreeShape, int_option
from drafters.trees import prune, trie

MAX_NGRAM, MAX_MATCHES, MAX_DEPTH = 64, 1024, 1024  # option bounds (far beyond any useful value)


class NGramDrafter:
    """Stateless in the replay sense: the proposal is a function of the committed tokens only.

    An index maps every n-gram (``min_ngram <= n <= max_ngram``) to the positions where it ends, appended as the
    context grows, so a lookup is O(1) per n and a step costs O(new tokens * max_ngram) to update.

    Every proposal is ``prune(largest, shape)`` (``drafters.trees.prune``), where ``largest`` is the trie of every
    distinct continuation of length ``max_depth`` the index offers (at most ``max_matches`` per n-gram size), best
    first: longest n-gram, then most recent. A chain (``topk == 1``) is the best continuation cut to ``depth``; a
    tree keeps the first ``topk`` children of each node (the best branches), then the first ``budget`` nodes in
    node order. A recorded trace stores ``largest`` (``max_shape``) per position, so replay of any arm of depth
    <= ``max_depth`` is exact.
    """

    name = "ngram"
    exact_replay = True

    def __init__(
        self,
        max_ngram: int = 4,
        min_ngram: int = 1,
        max_matches: int = 8,
        max_depth: int = 16,
    ) -> None:
        # bounds: the index holds (max_ngram - min_ngram + 1) n-grams per token; the largest tree is
        # max_depth x max_matches per n-gram size
        max_ngram = int_option("ngram", "max_ngram", max_ngram, 1, MAX_NGRAM)
        min_ngram = int_option("ngram", "min_ngram", min_ngram, 1, MAX_NGRAM)
        max_matches = int_option("ngram", "max_matches", max_matches, 1, MAX_MATCHES)
        max_depth = int_option("ngram", "max_depth", max_depth, 1, MAX_DEPTH)
        if min_ngram > max_ngram:
            raise DrafterError(f"ngram sizes need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_matches = max_matches
        # the largest tree: every continuation found (the trie never has more branches than that)
        self.max_shape = TreeShape(depth=max_depth, topk=max_matches * (max_ngram - min_ngram + 1))
        self._index: dict[tuple[int, ...], list[int]] = {}
        self._indexed = 0  # n-grams ending before this position are in the index
        self._tokens: list[int] = []

    def reset(self, ctx: DraftContext) -> None:
        self._index = {}
        self._indexed = 0
        self._tokens = []
        self._update(ctx.tokens)

    def _update(self, tokens: list[int]) -> None:
        n = len(self._tokens)  # a copy of what is indexed: the caller's list may be cut and grown in place
        if len(tokens) < n or tokens[:n] != self._tokens:
            self._index, self._indexed, self._tokens = {}, 0, []  # the context was rewritten: rebuild
        self._tokens.extend(tokens[len(self._tokens) :])
        for end in range(self._indexed, len(tokens)):
            for n in range(self.min_ngram, min(self.max_ngram, end + 1) + 1):
                self._index.setdefault(tuple(tokens[end - n + 1 : end + 1]), []).append(end)
        self._indexed = len(tokens)

    def continuations(self, tokens: list[int], depth: int, limit: int) -> list[list[int]]:
        """Up to ``limit`` distinct continuations of length <= ``depth``: longest n-gram first, then most recent."""
        self._update(tokens)
        last = len(tokens) - 1
        found: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        for n in range(min(self.max_ngram, len(tokens)), self.min_ngram - 1, -1):
            ends = self._index.get(tuple(tokens[last - n + 1 :]))
            if not ends:
                continue
            checked = 0
            for end in reversed(ends):
                if end == last:
                    continue
                cont = tokens[end + 1 : end + 1 + depth]
                checked += 1
                key = tuple(cont)
                if key not in seen:
                    seen.add(key)
                    found.append(cont)
                    if len(found) >= limit:
                        return found
                if checked >= self.max_matches:
                    break
        return found

    def propose(self, ctx: DraftContext, shape: TreeShape) -> DraftTree:
        root = ctx.tokens[-1]
        if shape.depth == 0:
            return DraftTree.root_only(root)
        depth = max(self.max_shape.depth, shape.depth)  # deeper arms grow the largest tree (no longer exact)
        conts = self.continuations(ctx.tokens, depth, self.max_shape.topk)
        largest = trie(root, conts, depth * self.max_shape.topk)
        return prune(largest, shape)

    def observe(self, ctx: DraftContext, feedback: Feedback) -> None:
        pass  # the index catches up lazily from ctx.tokens at the next proposal
