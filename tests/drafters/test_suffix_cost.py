"""What keeps the suffix and n-gram drafters at microseconds per token: the O(1) check that the caller's token list
still starts with what was indexed (and that a cut and regrown list is still seen), the children ranked once per
node instead of at every proposal (proposals identical to ranking every child: a slow reference, the trie and
tree growth as they were before, serves the same seeded workloads), and restored ids checked against the target's
vocabulary."""

from __future__ import annotations

import heapq
import random
from types import SimpleNamespace

import numpy as np
import pytest

import drafters.suffix as suffix
from drafters import DraftContext, DrafterError, NGramDrafter, SuffixDrafter, TreeShape
from drafters.ngram import SeenTokens

# ---- the slow reference: a dict of children per node, every child ranked at every proposal ----


class _RefNode:
    __slots__ = ("count", "kids", "last")

    def __init__(self) -> None:
        self.count, self.kids, self.last = 0, {}, 0


class _RefTrie:
    def __init__(self, depth_limit: int) -> None:
        self.depth_limit, self.root, self.clock = depth_limit, _RefNode(), 0

    def open(self):
        return [self.root]

    def extend(self, active, token):
        nxt = [self.root]
        self.clock += 1
        for node in active[: self.depth_limit]:
            child = node.kids.get(token)
            if child is None:
                child = node.kids[token] = _RefNode()
            child.count += 1
            child.last = self.clock
            nxt.append(child)
        return nxt

    def add(self, tokens):
        active = self.open()
        for t in tokens:
            active = self.extend(active, t)

    def remove(self, tokens):
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

    def match(self, tokens, max_match, min_match=1):
        for n in range(min(max_match, len(tokens), self.depth_limit - 1), min_match - 1, -1):
            node = self.root
            for t in tokens[len(tokens) - n :]:
                node = node.kids.get(t)
                if node is None:
                    break
            if node is not None and node.kids:
                return node, n
        return None, 0


def _ref_grow(start, root_token, shape):
    tokens, parents, probs, depths = [root_token], [-1], [1.0], [0]
    heap, tick = [], 0

    def push_kids(node, index, prob, depth):
        nonlocal tick
        if depth >= shape.depth or not node.kids:
            return
        total = sum(k.count for k in node.kids.values())
        best = heapq.nlargest(shape.topk, node.kids.items(), key=lambda kv: (kv[1].count, kv[1].last))
        for tok, kid in best:
            tick += 1
            heapq.heappush(heap, (-prob * kid.count / total, tick, index, tok, kid))

    push_kids(start, 0, 1.0, 0)
    while heap and len(tokens) - 1 < shape.max_nodes:
        neg, _, parent, tok, node = heapq.heappop(heap)
        tokens.append(tok)
        parents.append(parent)
        probs.append(-neg)
        depths.append(depths[parent] + 1)
        push_kids(node, len(tokens) - 1, -neg, depths[-1])
    return tokens, parents, probs


def _workload(seed: int) -> list[tuple]:
    """Seeded requests served by a drafter and a fork over one cache (answers evicted, the cache restored from its
    arrays midway, contexts cut and regrown in place); every proposal as (tokens, parents, scores)."""
    rng = random.Random(seed)
    vocab = rng.choice([3, 6, 40])
    depth_limit = rng.choice([3, 5, 8, 32])
    d = SuffixDrafter(
        depth_limit=depth_limit,
        max_match=rng.randrange(1, depth_limit),
        cache_requests=rng.choice([0, 1, 3, 50]),
        choose=rng.choice(["merge", "match", "score"]),
    )
    drafters = [d, d.fork()]
    out = []

    def token():  # a common token (7) followed by many different ones: nodes of more than TOP_K children
        return 7 if rng.random() < 0.3 else rng.randrange(vocab + 20 if vocab == 40 else vocab)

    for request in range(12):
        dr = drafters[request % 2]
        ctx = DraftContext(tokens=[token() for _ in range(rng.randrange(2, 30))], prompt_len=0)
        ctx.prompt_len = len(ctx.tokens)
        dr.reset(ctx)
        for _ in range(rng.randrange(5, 40)):
            shape = TreeShape(
                depth=rng.randrange(1, 7), topk=rng.choice([1, 2, 3, 8, 10]), budget=rng.randrange(0, 20)
            )
            t = dr.propose(ctx, shape)
            out.append(
                (t.tokens.tolist(), t.parents.tolist(), t.scores.tolist() if t.scores is not None else None)
            )
            if rng.random() < 0.1 and len(ctx.tokens) > ctx.prompt_len + 2:  # cut and regrown in place
                del ctx.tokens[rng.randrange(ctx.prompt_len + 1, len(ctx.tokens)) :]
            ctx.tokens.extend(token() for _ in range(rng.randrange(1, 4)))
        if request == 6:
            d.restore(d.carried())
        if rng.random() < 0.5:
            dr.finish(ctx)
    return out


@pytest.mark.parametrize("seed", range(12))
def test_proposals_are_those_of_ranking_every_child(seed, monkeypatch):
    fast = _workload(seed)
    with monkeypatch.context() as m:
        m.setattr(suffix, "SuffixTrie", _RefTrie)
        m.setattr(suffix, "_grow", _ref_grow)
        slow = _workload(seed)
    assert fast == slow


def test_a_ranked_node_stays_ranked_as_counts_grow_and_shrink():
    trie, ref = suffix.SuffixTrie(3), _RefTrie(3)
    rng = random.Random(0)
    answers = [[x for _ in range(30) for x in (7, rng.randrange(40))] for _ in range(6)]
    shape = TreeShape(depth=2, topk=4, budget=12)
    for i, answer in enumerate(answers):
        for t in (trie, ref):
            t.add(answer)
            if i >= 3:
                t.remove(answers[i - 3])
        node, ref_node = trie.match([7], 1)[0], ref.match([7], 1)[0]
        assert len(node.kids) > suffix.TOP_K
        assert suffix._grow(node, 7, shape) == _ref_grow(ref_node, 7, shape)
        assert node.total == sum(k.count for k in node.kids.values())


# ---- the token list cut and regrown in place ----


def _index_of(d: NGramDrafter):
    return {k: list(v) for k, v in d._index.items()}


@pytest.mark.parametrize("far", [False, True])
def test_a_list_cut_and_regrown_differently_is_reindexed(far):
    """The caller cuts its list and regrows it with other tokens (``env.batch_calibrate`` rolls rows back): the
    drafters see it at their next call as long as it shows in the list's length or its last ``TAIL`` tokens; a
    new list object is compared whole."""
    rng = random.Random(1)
    base = [rng.randrange(50) for _ in range(300)]
    for make in (NGramDrafter, SuffixDrafter):
        tokens = list(base)
        d = make()
        d.reset(DraftContext(tokens=tokens, prompt_len=10))
        cut = 20 if far else len(tokens) - 5
        del tokens[cut:]  # cut, regrown to the same length with one token different at the cut
        tokens.extend([base[cut] + 1, *base[cut + 1 :]])
        if far:  # beyond the tail checked in place: seen when handed as a new list (or after a shorter one)
            tokens = list(tokens)
        fresh = make()
        fresh.reset(DraftContext(tokens=list(tokens), prompt_len=10))
        shape = TreeShape(depth=4, topk=2)
        got = d.propose(DraftContext(tokens=tokens, prompt_len=10), shape)
        want = fresh.propose(DraftContext(tokens=list(tokens), prompt_len=10), shape)
        assert got.tokens.tolist() == want.tokens.tolist() and got.parents.tolist() == want.parents.tolist()
        if make is NGramDrafter:
            assert _index_of(d) == _index_of(fresh)


def test_the_check_follows_one_list_and_sees_cuts_in_its_tail_and_length():
    seen, tokens = SeenTokens(), list(range(100))
    assert not seen.rewritten(tokens)
    seen.sync(tokens)
    tokens.append(5)
    assert not seen.rewritten(tokens)  # grown: nothing to redo
    seen.sync(tokens)
    del tokens[90:]
    assert seen.rewritten(tokens) and seen.tokens == []  # shorter: rebuilt
    seen.sync(tokens)
    del tokens[80:]
    tokens.extend([1] + list(range(81, 90)))  # same length, a token changed within the tail
    assert seen.rewritten(tokens)
    seen.sync(tokens)
    assert not seen.rewritten(list(tokens))  # an equal new list: compared whole, not rewritten
    other = list(tokens)
    other[0] = 99
    assert seen.rewritten(other)  # a new list differing anywhere


# ---- restored ids and the target's vocabulary ----


def test_restored_ids_outside_the_vocabulary_are_refused_once_the_target_is_known():
    d = SuffixDrafter()
    d.restore(
        {"answers": np.array([5, 10**12, 7], dtype=np.int64), "answer_off": np.array([0, 3], dtype=np.int64)}
    )
    target = SimpleNamespace(vocab_size=1000)
    with pytest.raises(DrafterError, match="outside the target's vocabulary"):
        d.reset(DraftContext(tokens=[1, 5], prompt_len=2, target=target))
    with pytest.raises(DrafterError, match="outside the target's vocabulary"):
        d.fork().propose(DraftContext(tokens=[1, 5], prompt_len=2, target=target), TreeShape(depth=2))
    with pytest.raises(
        DrafterError, match=r"token id 1000000000000 is outside the target's vocabulary \[0, 1000\)"
    ):
        SuffixDrafter().restore(  # the vocabulary known at the restore: refused there
            {
                "answers": np.array([5, 10**12, 7], dtype=np.int64),
                "answer_off": np.array([0, 3], dtype=np.int64),
            },
            1000,
        )
    ok = SuffixDrafter()
    ok.restore(
        {"answers": np.array([5, 999, 7], dtype=np.int64), "answer_off": np.array([0, 3], dtype=np.int64)},
        1000,
    )
    ctx = DraftContext(tokens=[1, 5], prompt_len=2, target=target)
    ok.reset(ctx)
    assert ok.propose(ctx, TreeShape(depth=2)).tokens.tolist() == [5, 999, 7]
