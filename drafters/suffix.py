"""Suffix decoding (SuffixDecoding, arXiv 2411.04975): match the longest suffix of the context in suffix tries of
this request's tokens (prompt and answer so far) and of earlier requests' answers, and propose the most frequent
continuations as a tree, each node with a frequency-based probability.

Each trie holds, for every position of its text, the next ``depth_limit`` tokens (a suffix trie cut at that depth;
a node counts how often its path occurs), so appending a token costs ``depth_limit`` dictionary steps and a lookup
walks at most ``max_match`` nodes per match length tried: microseconds per token, not milliseconds. A node
keeps its children's counts summed and, once it has more than ``TOP_K`` children, its ``TOP_K`` best ranked, so a
proposal costs the same whatever the size of the global cache; a node with one continuation holds it without a
dict. The global trie keeps the answers of the last ``cache_requests`` requests (least recently added first out:
an evicted answer's counts are taken back); every fork of a drafter shares it, so requests served together learn
from each other.

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
from operator import attrgetter
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
from drafters.ngram import SeenTokens

TOP_K = 8  # children ranked once and kept ranked, per node with more than TOP_K (proposals of topk <= TOP_K)
_rank = attrgetter("count", "last")  # a child's rank among its siblings (never equal: ``last`` differs)


class _Node:
    """``count``: how often its path occurs; ``last``: when it last occurred (the trie's clock: equal counts prefer
    the most recent); ``total``: its children's counts summed. Children are stored compactly, as most nodes of a
    suffix trie have one continuation: ``None`` (a leaf), the one child itself (``tok`` is a node's own token) or a
    dict token -> child. ``top``: for a node with more than ``TOP_K`` children once a proposal has ranked them,
    its ``TOP_K`` highest-ranked children, best first (kept up to date as counts grow, dropped when one of them
    shrinks): a proposal reads it instead of ranking every child."""

    __slots__ = ("tok", "count", "last", "total", "_kids", "top")

    def __init__(self, tok: int) -> None:
        self.tok = tok
        self.count = 0
        self.last = 0
        self.total = 0
        self._kids: _Node | dict[int, _Node] | None = None
        self.top: list[_Node] | None = None

    @property
    def kids(self) -> dict[int, _Node]:
        """The children by token (a new dict, for reading)."""
        k = self._kids
        if k is None:
            return {}
        return {k.tok: k} if k.__class__ is _Node else dict(k)  # type: ignore[union-attr, dict-item]

    def child(self, tok: int) -> _Node | None:
        k = self._kids
        if k is None or k.__class__ is _Node:
            return k if k is not None and k.tok == tok else None  # type: ignore[union-attr, return-value]
        return k.get(tok)  # type: ignore[union-attr]

    def _drop(self, child: _Node) -> None:
        k = self._kids
        if k is child:
            self._kids = None
            return
        del k[child.tok]  # type: ignore[union-attr, index]
        if len(k) == 1:  # type: ignore[arg-type]
            self._kids = next(iter(k.values()))  # type: ignore[union-attr]


def _bump(top: list[_Node], child: _Node) -> None:
    """``child``'s count just grew: ``top`` stays its node's ``TOP_K`` highest-ranked children (only ``child``
    changed, and only upwards, so only it can enter; a ``top`` shorter than ``TOP_K`` holds every child)."""
    if child not in top:
        if len(top) == TOP_K:
            if _rank(child) < _rank(top[-1]):
                return
            top.pop()
        top.append(child)
    top.sort(key=_rank, reverse=True)


class SuffixTrie:
    """Suffix trie of one or more token sequences, cut at ``depth_limit`` tokens per path."""

    def __init__(self, depth_limit: int) -> None:
        self.depth_limit = depth_limit
        self.root = _Node(-1)
        self.clock = 0

    def open(self) -> list[_Node]:
        """The open suffixes of a new sequence (to ``extend``): only the empty one."""
        return [self.root]

    def extend(self, active: list[_Node], token: int) -> list[_Node]:
        """Append ``token`` to a sequence whose open suffixes end at ``active`` (shortest first)."""
        nxt = [self.root]
        self.clock += 1
        clock = self.clock
        for node in active[: self.depth_limit]:
            k = (
                node._kids
            )  # the child for ``token``, made if missing (inlined: this loop is the update's cost)
            if k is None:
                child = node._kids = _Node(token)
            elif k.__class__ is _Node:
                if k.tok == token:  # type: ignore[union-attr]
                    child = k  # type: ignore[assignment]
                else:
                    child = _Node(token)
                    node._kids = {k.tok: k, token: child}  # type: ignore[union-attr, dict-item]
            else:
                child = k.get(token)  # type: ignore[union-attr, assignment]
                if child is None:
                    child = k[token] = _Node(token)  # type: ignore[index]
            child.count += 1
            child.last = clock
            node.total += 1
            if node.top is not None:
                _bump(node.top, child)
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
                child = node.child(t)
                if child is None:
                    break
                child.count -= 1
                node.total -= 1
                if node.top is not None and child in node.top:
                    node.top = None  # a ranked child shrank: ranked again by the next proposal that needs it
                if child.count <= 0:
                    node._drop(child)
                    break
                node = child

    def match(self, tokens: list[int], max_match: int, min_match: int = 1) -> tuple[_Node | None, int]:
        """The node of the longest suffix of ``tokens`` (``min_match .. max_match`` long) that occurs followed
        by something; ``(None, 0)`` when none does."""
        longest = min(max_match, len(tokens), self.depth_limit - 1)
        for n in range(longest, min_match - 1, -1):
            node: _Node | None = self.root
            for t in tokens[len(tokens) - n :]:
                node = node.child(t)  # type: ignore[union-attr]
                if node is None:
                    break
            if node is not None and node._kids is not None:
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
        kids = node._kids
        if depth >= shape.depth or kids is None:
            return
        total = node.total  # its children's counts summed
        best: Any  # the shape.topk highest-ranked children, best first
        if kids.__class__ is _Node:
            best = (kids,)
        elif len(kids) <= TOP_K or shape.topk > TOP_K:  # type: ignore[arg-type]
            best = heapq.nlargest(shape.topk, kids.values(), key=_rank)  # type: ignore[union-attr]
        else:
            if node.top is None:
                node.top = heapq.nlargest(TOP_K, kids.values(), key=_rank)  # type: ignore[union-attr]
            best = node.top[: shape.topk]
        for kid in best:
            tick += 1
            heapq.heappush(heap, (-prob * kid.count / total, tick, index, kid.tok, kid))

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


def _check_ids(top: int, vocab: int) -> None:
    """A cache whose largest token id is ``top`` holds only ids of a vocabulary of ``vocab`` (``DrafterError``)."""
    if top >= vocab:
        raise DrafterError(f"suffix state: token id {top} is outside the target's vocabulary [0, {vocab})")


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
        self._seen = (
            SeenTokens()
        )  # the tokens indexed into the local trie (the caller may cut its list in place)
        self._prompt_len = 0
        self.last_match = 0

    @property
    def cross_request(self) -> bool:
        """Whether a proposal may read other requests' answers (the global cache is on)."""
        return self.cache_requests > 0

    def fork(self) -> SuffixDrafter:
        """A drafter for another sequence over the same global cache."""
        other = SuffixDrafter(self.depth_limit, self.max_match, self.cache_requests, self.choose)
        other.shared = self.shared
        return other

    def _remember_answer(self, tokens: list[int]) -> None:
        """The finished sequence's answer into the global trie (oldest answers out beyond ``cache_requests``)."""
        answer = tokens[self._prompt_len :]
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

    def restore(self, arrays: dict[str, np.ndarray], vocab: int | None = None) -> None:
        """The global cache rebuilt from ``carried()``'s arrays (checked; ``vocab``: every id within the target's
        vocabulary), in place: forks share it."""
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
        if vocab is not None and flat.size:
            _check_ids(int(flat.max()), vocab)
        trie, answers = SuffixTrie(self.depth_limit), deque()
        for i in range(n):
            answer = flat[off[i] : off[i + 1]].tolist()
            trie.add(answer)
            answers.append(answer)
        self.shared["trie"], self.shared["answers"] = trie, answers
        self.shared["max_id"] = int(flat.max()) if flat.size else -1  # checked against a target's vocabulary

    # ---- Drafter protocol ----
    def reset(self, ctx: DraftContext) -> None:
        if self._seen.tokens:
            self._remember_answer(self._seen.tokens)
        self._check_vocab(ctx)
        self._local = SuffixTrie(self.depth_limit)
        self._active = self._local.open()
        self._seen, self._prompt_len = SeenTokens(), ctx.prompt_len
        self._catch_up(ctx.tokens)

    def _catch_up(self, tokens: list[int]) -> None:
        """Index what ``tokens`` (the caller's list, which it may cut in place) added since the last call."""
        if self._seen.rewritten(tokens):  # start over
            self._local = SuffixTrie(self.depth_limit)
            self._active = self._local.open()
        for t in tokens[len(self._seen.tokens) :]:
            self._active = self._local.extend(self._active, t)
        self._seen.sync(tokens)

    def _check_vocab(self, ctx: DraftContext) -> None:
        """A restored cache holds only ids of the target's vocabulary (answers remembered here came from it)."""
        if ctx.target is not None:
            _check_ids(self.shared.get("max_id", -1), int(ctx.target.vocab_size))

    def propose(self, ctx: DraftContext, shape: TreeShape) -> DraftTree:
        root = ctx.tokens[-1]
        if shape.depth == 0:
            return DraftTree.root_only(root)
        self._check_vocab(ctx)
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
        self._remember_answer(list(ctx.tokens))
        self._local, self._seen = SuffixTrie(self.depth_limit), SeenTokens()
        self._active = self._local.open()
