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


class SeenTokens:
    """A copy of the tokens a drafter has indexed from the caller's list, and a check, O(1) per call, that the list
    still starts with them (the engine appends to one list per sequence and may cut it and regrow it in place:
    ``env.batch_calibrate`` rolls rows back).

    Guarantee: another list object is compared whole (O(n), once: it becomes the list followed). The same list
    is taken as rewritten when it is shorter than what was indexed or when any of the last ``TAIL`` indexed
    positions changed. A list cut and regrown past its old length between two calls, differing only more than
    ``TAIL`` tokens before that length, is not seen: in place, no O(1) check can see it (a prefix hash of the
    caller's list costs reading the list). The engine proposes at every drafting step, committing at most a
    tree's depth + 1 tokens in between, and ``env.batch_calibrate`` cuts back to a length the drafter has indexed
    past, so its cuts show as a shorter list; a caller that rewrites further back calls ``reset`` or hands a new
    list."""

    TAIL = 32

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self._source: list[int] | None = None  # the caller's list they were copied from

    def rewritten(self, tokens: list[int]) -> bool:
        """Whether ``tokens`` no longer starts with the copy; if so the copy is dropped (the index is rebuilt)."""
        n = len(self.tokens)
        if tokens is self._source:
            changed = len(tokens) < n or tokens[max(0, n - self.TAIL) : n] != self.tokens[-self.TAIL :]
        else:
            changed = len(tokens) < n or tokens[:n] != self.tokens
        if changed:
            self.tokens = []
        return changed

    def sync(self, tokens: list[int]) -> None:
        """``tokens`` (which starts with the copy) is now indexed whole."""
        self.tokens.extend(tokens[len(self.tokens) :])
        self._source = tokens


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
        self._seen = SeenTokens()  # the tokens indexed: the caller's list may be cut and grown in place

    def reset(self, ctx: DraftContext) -> None:
        self._index = {}
        self._indexed = 0
        self._seen = SeenTokens()
        self._update(ctx.tokens)

    def _update(self, tokens: list[int]) -> None:
        if self._seen.rewritten(tokens):
            self._index, self._indexed = {}, 0  # the context was rewritten: rebuild
        for end in range(self._indexed, len(tokens)):
            for n in range(self.min_ngram, min(self.max_ngram, end + 1) + 1):
                self._index.setdefault(tuple(tokens[end - n + 1 : end + 1]), []).append(end)
        self._indexed = len(tokens)
        self._seen.sync(tokens)

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
