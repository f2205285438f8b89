"""Suffix decoding (SuffixDecoding, arXiv 2411.04975): match the longest suffix of the context in suffix tries of
this request's tokens (prompt and answer so far) and of earlier requests' answers, and propose the most frequent
continuations as a tree, each node with a frequency-based probability.

Each trie holds, for every position of its text, the next ``depth_limit`` tokens (a suffix trie cut at that depth;
a node counts how often its path occurs), so appending a token costs ``depth_limit`` dictionary steps and a lookup
walks at most ``max_match`` nodes per match length tried: microseconds per token, not milliseconds. The global
trie keeps the answers of the last ``cache_requests`` requests (least recently added first out: an evicted answer's
counts are taken back); every fork of a drafter shares it, so requests served together learn from each other.

A proposal grows best-first from the matched node: a node's probability is its parent's times its share of the
parent's continuations; the ``shape.max_nodes`` most probable nodes are kept, at most ``shape.topk`` children per
node and ``shape.depth`` levels; children of equal counts go most recent first (as n-gram lookup's most recent
match). The local and the global candidate trees are merged (``choose="merge"``, the default: the union cut to the
most probable nodes, ``drafters.hybrid.merge_trees``); ``"match"`` proposes the one with the longer match (then the
larger expected accepted length, the sum of node probabilities), ``"score"`` the larger expected accepted length.
On the Spec-Bench prompts outside the benchmark's (350, 70 per category, greedy bf16 answers of the embedded model,
``drafters.offline``), merging with the recency tie-break took ``suffix-d12-k4-b24`` from τ 2.47 to 2.64 and
``suffix-d8`` from 2.19 to 2.26 (n-gram 2.24 and 2.04), ahead of n-gram in every category.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Any

import numpy as np
import torch

from drafters.base import (
    DraftContext,
    DrafterError,
    DraftTree,
    Feedback,
    TreeShape,
    choice_option,
    int_array,
    int_option,
)


class _Node:
    __slots__ = ("count", "kids", "last")

    def __init__(self) -> None:
        self.count = 0
        self.kids: dict[int, _Node] = {}
        self.last = 0  # when its path last occurred (the trie's clock): equal counts prefer the most recent


class SuffixTrie:
    """Suffix trie of one or more token sequences, cut at ``depth_limit`` tokens per path."""

    def __init__(self, depth_limit: int) -> None:
        self.depth_limit = depth_limit
        self.root = _Node()
        self.clock = 0

    def open(self) -> list[_Node]:
        """The open suffixes of a new sequence (to ``extend``): only the empty one."""
        return [self.root]

    def extend(self, active: list[_Node], token: int) -> list[_Node]:
        """Append ``token`` to a sequence whose open suffixes end at ``active`` (shortest first)."""
        nxt = [self.root]
        self.clock += 1
        for node in active[: self.depth_limit]:
            child = node.kids.get(token)
            if child is None:
                child = node.kids[token] = _Node()
            child.count += 1
            child.last = self.clock
            nxt.append(child)
        return nxt

    def add(self, tokens: list[int]) -> None:
        active = self.open()
        for t in tokens:
            active = self.extend(active, t)

    def remove(self, tokens: list[int]) -> None:
        """Take back what ``add(tokens)`` counted (nodes whose count drops to 0 go)."""
        for start in range(len(tokens)):
            node = self.root
            for t in tokens[start : start + self.depth_limit]:
                child = node.kids.get(t)
                if child is None:
                    break
                child.count -= 1
                if child.count <= 0:
                    del node.kids[t]
                    break
                node = child

    def match(self, tokens: list[int], max_match: int, min_match: int = 1) -> tuple[_Node | None, int]:
        """The node of the longest suffix of ``tokens`` (``min_match .. max_match`` long) that occurs followed
        by something; ``(None, 0)`` when none does."""
        longest = min(max_match, len(tokens), self.depth_limit - 1)
        for n in range(longest, min_match - 1, -1):
            node = self.root
            for t in tokens[len(tokens) - n :]:
                node = node.kids.get(t)  # type: ignore[assignment]
                if node is None:
                    break
            if node is not None and node.kids:
                return node, n
        return None, 0


CHOOSE = ("match", "score", "merge")
MAX_DEPTH_LIMIT, MAX_CACHE_REQUESTS = 1024, 1_000_000  # option bounds (far beyond any useful value)


def _tree(tokens: list[int], parents: list[int], probs: list[float]) -> DraftTree:
    return DraftTree(
        torch.tensor(tokens, dtype=torch.long),
        torch.tensor(parents, dtype=torch.long),
        scores=torch.tensor(probs, dtype=torch.float32).log(),
    )


def _grow(start: _Node, root_token: int, shape: TreeShape) -> tuple[list[int], list[int], list[float]]:
    """Best-first tree from ``start``: tokens, parents (root first) and each node's path probability."""
    tokens, parents, probs = [root_token], [-1], [1.0]
    budget = shape.max_nodes
    heap: list[tuple[float, int, int, int, _Node]] = []  # (-prob, tiebreak, parent index, token, node)
    tick = 0

    def push_kids(node: _Node, index: int, prob: float, depth: int) -> None:
        nonlocal tick
        if depth >= shape.depth or not node.kids:
            return
        total = sum(k.count for k in node.kids.values())
        best = heapq.nlargest(shape.topk, node.kids.items(), key=lambda kv: (kv[1].count, kv[1].last))
        for tok, kid in best:
            tick += 1
            heapq.heappush(heap, (-prob * kid.count / total, tick, index, tok, kid))

    depths = [0]
    push_kids(start, 0, 1.0, 0)
    while heap and len(tokens) - 1 < budget:
        neg, _, parent, tok, node = heapq.heappop(heap)
        tokens.append(tok)
        parents.append(parent)
        probs.append(-neg)
        depths.append(depths[parent] + 1)
        push_kids(node, len(tokens) - 1, -neg, depths[-1])
    return tokens, parents, probs


class SuffixDrafter:
    """``depth_limit``: trie depth (match + continuation); ``max_match``: longest suffix matched;
    ``cache_requests``: earlier answers kept in the shared global trie (0: no cross-request cache); ``choose``:
    how the local and global candidates combine (``merge`` | ``match`` | ``score``)."""

    name = "suffix"
    exact_replay = False  # the global cache makes a proposal depend on the requests served before

    def __init__(
        self, depth_limit: int = 32, max_match: int = 16, cache_requests: int = 256, choose: str = "merge"
    ) -> None:
        # bounds: a token costs depth_limit trie steps (and nodes); the cache holds cache_requests answers
        depth_limit = int_option("suffix", "depth_limit", depth_limit, 2, MAX_DEPTH_LIMIT)
        max_match = int_option("suffix", "max_match", max_match, 1, MAX_DEPTH_LIMIT)
        cache_requests = int_option("suffix", "cache_requests", cache_requests, 0, MAX_CACHE_REQUESTS)
        if max_match >= depth_limit:
            raise DrafterError(
                "suffix needs depth_limit >= 2, 1 <= max_match < depth_limit and cache_requests >= 0, got "
                f"{depth_limit}, {max_match}, {cache_requests}"
            )
        choose = choice_option("suffix", "choose", choose, CHOOSE)
        self.depth_limit, self.max_match, self.cache_requests = depth_limit, max_match, cache_requests
        self.choose = choose
        self.shared: dict[str, Any] = {"trie": SuffixTrie(depth_limit), "answers": deque()}
        self.max_shape = TreeShape(depth=depth_limit - 1, topk=4, budget=64)
        self._local = SuffixTrie(depth_limit)
        self._active: list[_Node] = []
        self._tokens: list[int] = []
        self._prompt_len = 0
        self._seen = 0
        self.last_match = 0

    def fork(self) -> SuffixDrafter:
        """A drafter for another sequence over the same global cache."""
        other = SuffixDrafter(self.depth_limit, self.max_match, self.cache_requests, self.choose)
        other.shared = self.shared
        return other

    def _remember_answer(self) -> None:
        """The finished sequence's answer into the global trie (oldest answers out beyond ``cache_requests``)."""
        answer = self._tokens[self._prompt_len :]
        if self.cache_requests == 0 or len(answer) < 2:
            return
        trie, answers = self.shared["trie"], self.shared["answers"]
        trie.add(answer)
        answers.append(answer)
        while len(answers) > self.cache_requests:
            trie.remove(answers.popleft())

    # ---- the cross-request cache as arrays (``drafters.base.Carries``) ----
    def carried(self) -> dict[str, np.ndarray]:
        """The cached answers, oldest first: ``answers`` (their tokens end to end) and ``answer_off`` (offsets)."""
        answers = list(self.shared["answers"])
        off = np.concatenate([[0], np.cumsum([len(a) for a in answers], dtype=np.int64)]).astype(np.int64)
        flat = np.asarray([t for a in answers for t in a], dtype=np.int64)
        return {"answers": flat, "answer_off": off}

    def restore(self, arrays: dict[str, np.ndarray]) -> None:
        """The global cache rebuilt from ``carried()``'s arrays (checked), in place: forks share it."""
        flat = int_array("suffix", "answers", arrays, 1)
        off = int_array("suffix", "answer_off", arrays, 1)
        n = off.shape[0] - 1
        if n < 0 or off[0] != 0 or off[-1] != flat.shape[0] or (np.diff(off) < 2).any():
            raise DrafterError(
                "suffix state: answer_off must run from 0 to the end of answers, >= 2 tokens apart"
            )
        if n > self.cache_requests:
            raise DrafterError(
                f"suffix state: {n} answers, more than this drafter's cache_requests ({self.cache_requests})"
            )
        if flat.size and flat.min() < 0:
            raise DrafterError("suffix state: a negative token id")
        trie, answers = SuffixTrie(self.depth_limit), deque()
        for i in range(n):
            answer = flat[off[i] : off[i + 1]].tolist()
            trie.add(answer)
            answers.append(answer)
        self.shared["trie"], self.shared["answers"] = trie, answers

    # ---- Drafter protocol ----
    def reset(self, ctx: DraftContext) -> None:
        if self._tokens:
            self._remember_answer()
        self._local = SuffixTrie(self.depth_limit)
        self._active = self._local.open()
        self._tokens, self._seen, self._prompt_len = [], 0, ctx.prompt_len
        self._catch_up(ctx.tokens)

    def _catch_up(self, tokens: list[int]) -> None:
        """Index what ``tokens`` (the caller's list, which it may cut in place) added since the last call;
        ``self._tokens`` is a copy of the ``self._seen`` tokens indexed."""
        n = self._seen
        if len(tokens) < n or tokens[:n] != self._tokens:  # rewritten: start over
            self._local, self._seen, self._tokens = SuffixTrie(self.depth_limit), 0, []
            self._active = self._local.open()
        new = tokens[self._seen :]
        for t in new:
            self._active = self._local.extend(self._active, t)
        self._tokens.extend(new)
        self._seen = len(tokens)

    def propose(self, ctx: DraftContext, shape: TreeShape) -> DraftTree:
        root = ctx.tokens[-1]
        if shape.depth == 0:
            return DraftTree.root_only(root)
        self._catch_up(ctx.tokens)
        best: tuple[tuple[float, ...], tuple[list[int], list[int], list[float]]] | None = None
        grown_all = []
        self.last_match = 0  # the longest suffix matched by this proposal (a hybrid arm trusts long ones)
        for trie in (self._local, self.shared["trie"]):
            node, n = trie.match(ctx.tokens, self.max_match)
            if node is None:
                continue
            grown = _grow(node, root, shape)
            grown_all.append(grown)
            self.last_match = max(self.last_match, n)
            score = sum(grown[2][1:])  # expected accepted length
            rank = (n, score) if self.choose == "match" else (score, n)
            if best is None or rank > best[0]:  # a tie keeps this request's own trie (the first)
                best = (rank, grown)
        if best is None:
            return DraftTree.root_only(root)
        if self.choose == "merge" and len(grown_all) == 2:
            from drafters.hybrid import merge_trees

            trees = [_tree(*g) for g in grown_all]
            return merge_trees(trees, [g[2] for g in grown_all], shape)
        return _tree(*best[1])

    def observe(self, ctx: DraftContext, feedback: Feedback) -> None:
        pass  # the local trie catches up from ctx.tokens at the next proposal

    def finish(self, ctx: DraftContext) -> None:
        """The sequence ended: its answer goes into the global cache now (a fork serves one request and is never
        reset again, so waiting for the next ``reset`` would lose it). The answer is the context as it ended (the
        engine may have cut a last step's overshoot): read as it is, not indexed into this request's trie, which
        is dropped."""
        self._tokens = list(ctx.tokens)
        self._remember_answer()
        self._local, self._tokens, self._seen = SuffixTrie(self.depth_limit), [], 0
        self._active = self._local.open()
