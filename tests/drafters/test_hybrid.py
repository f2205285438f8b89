"""Hybrid trees: the union of two drafters' trees cut to the most probable nodes within the arm's shape; greedy
decoding with them stays exact; the model drafter is skipped when the cheap tree is strong enough."""

from __future__ import annotations

import math

import pytest
import torch

from drafters import DraftContext, DrafterError, DraftTree, TreeShape, make_drafter
from drafters.hybrid import HybridDrafter, merge_trees, node_probs
from tests.drafters.tiny import decode, decode_counts


def _tree(tokens, parents, probs=None):
    scores = None if probs is None else torch.tensor([math.log(p) for p in probs], dtype=torch.float32)
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), scores=scores)


def _paths(t: DraftTree) -> set[tuple[int, ...]]:
    toks, pars = t.tokens.tolist(), t.parents.tolist()
    paths: list[tuple[int, ...]] = [()]
    for i in range(1, len(toks)):
        paths.append((*paths[pars[i]], toks[i]))
    return set(paths[1:])


def test_merge_unites_shared_prefixes_and_keeps_the_most_probable():
    a = _tree([9, 1, 2, 3], [-1, 0, 1, 2], [1.0, 0.9, 0.8, 0.5])  # chain 1-2-3
    b = _tree([9, 1, 4, 5], [-1, 0, 1, 0], [1.0, 0.95, 0.7, 0.2])  # 1-4 and 5
    m = merge_trees([a, b], [node_probs(a, 0.5), node_probs(b, 0.5)], TreeShape(depth=3, topk=2, budget=4))
    assert _paths(m) == {(1,), (1, 2), (1, 4), (1, 2, 3)}  # 5 (0.2) is cut, shared (1,) is one node
    assert m.num_draft == 4
    probs = m.scores.exp().tolist()
    assert probs[1] == pytest.approx(0.95)  # the larger of the two estimates
    for i, p in enumerate(m.parents.tolist()[1:], start=1):
        assert p < i and probs[i] <= probs[p] + 1e-6


def test_merge_respects_topk_and_depth():
    a = _tree([9, 1, 2, 3, 4], [-1, 0, 0, 0, 3], [1.0, 0.9, 0.8, 0.7, 0.6])
    b = _tree([9, 5], [-1, 0], [1.0, 0.85])
    m = merge_trees([a, b], [node_probs(a, 0.5), node_probs(b, 0.5)], TreeShape(depth=1, topk=2, budget=8))
    assert _paths(m) == {(1,), (5,)}  # two children of the root at most, one level
    # the budget left over: topk still binds (the root's third child 3 is left out for 5 below 1)
    a = _tree([9, 1, 2, 3], [-1, 0, 0, 0], [1.0, 0.9, 0.8, 0.7])
    b = _tree([9, 1, 5], [-1, 0, 1], [1.0, 0.9, 0.6])
    m = merge_trees([a, b], [node_probs(a, 0.5), node_probs(b, 0.5)], TreeShape(depth=2, topk=2, budget=4))
    assert (m.tokens.tolist(), m.parents.tolist()) == ([9, 1, 2, 5], [-1, 0, 0, 1])
    # and so does the depth: the chain 1-2-3 is cut at two levels, the budget going to the other tree's 4
    c = _tree([9, 1, 2, 3], [-1, 0, 1, 2], [1.0, 0.9, 0.8, 0.7])
    d = _tree([9, 4], [-1, 0], [1.0, 0.1])
    m = merge_trees([c, d], [node_probs(c, 0.5), node_probs(d, 0.5)], TreeShape(depth=2, topk=2))
    assert (m.tokens.tolist(), m.parents.tolist()) == ([9, 1, 2, 4], [-1, 0, 1, 0])


@pytest.mark.parametrize("skip_at, skip_match, skipped", [(2.5, 4, 1), (3.0, 4, 1), (3.0, 5, 0), (3.5, 0, 0)])
def test_the_skip_rule_at_its_thresholds(skip_at, skip_match, skipped):
    """The second part is skipped where the first's tree expects at least ``skip_at`` accepted tokens (the root,
    always kept, not counted) from a match of at least ``skip_match``: here a match of 4 ("1 2 3 4") continued by
    5 6 9, each of probability 1 — 3 expected tokens."""
    toks = [1, 2, 3, 4, 5, 6, 9, 1, 2, 3, 4]
    d = HybridDrafter("suffix,ngram", skip_at=skip_at, skip_match=skip_match)
    ctx = DraftContext(tokens=list(toks), prompt_len=len(toks))
    d.reset(ctx)
    d.propose(ctx, TreeShape(depth=3))
    assert (d.parts[0].last_match, d.skipped) == (4, skipped)


def test_unscored_nodes_decay_per_level():
    t = _tree([9, 1, 2], [-1, 0, 1])
    assert node_probs(t, 0.5) == [1.0, 0.5, 0.25]


def test_unscored_siblings_share_their_parent():
    """Four one-off continuations of one token: siblings share their parent's probability (geometrically, best
    first), so the expected accepted length stays below the depth and does not make the skip rule drop the
    second part."""
    t = _tree([9, 1, 2, 3, 4, 5, 6, 7, 8], [-1, 0, 1, 0, 3, 0, 5, 0, 7])  # four chains of two
    p = node_probs(t, 0.6)
    assert p[1] == pytest.approx(0.6) and p[2] == pytest.approx(0.36)  # the first chain as a chain alone
    first = [p[i] for i in (1, 3, 5, 7)]
    assert sum(first) <= 1.0 and first == sorted(first, reverse=True)
    assert sum(p[1:]) < 2  # a depth-2 tree accepts at most 2


def test_bad_parts_are_refused():
    for parts in ("suffix", "suffix,suffix", "suffix,hybrid"):
        with pytest.raises(DrafterError, match="hybrid needs two different drafters as parts"):
            make_drafter("hybrid", parts=parts)
    with pytest.raises(DrafterError, match="unknown hybrid part 'medusa'"):
        make_drafter("hybrid", parts="suffix,medusa")
    with pytest.raises(DrafterError, match="unscored must be a number in"):
        make_drafter("hybrid", parts="suffix,ngram", unscored=0.0)


@pytest.fixture(scope="module")
def tiny(trained_tiny):
    return trained_tiny("eagle3")  # a head that drafts: hybrid rows see eagle3 drafts accepted and rejected


@pytest.mark.parametrize("parts", ["suffix,eagle3", "ngram,eagle3", "suffix,ngram"])
def test_greedy_exact_on_tiny_target(tiny, parts):
    loaded, path = tiny
    prompt = [5, 17, 33, 17, 5, 60, 2, 8, 44, 9, 5, 17, 33]
    ref, _ = decode(loaded, None, prompt, 40)
    opts = {"parts": parts, "options": {"eagle3": {"weights": str(path)}}, "skip_at": 1.5}
    kept = rejected = 0
    for arm in ("hybrid-d4", "hybrid-d4-k2-b8", "hybrid-d6-k3-b12"):
        out, accepted, drafted = decode_counts(loaded, arm, prompt, 40, opts)
        assert out == ref, (parts, arm)
        kept, rejected = kept + accepted, rejected + drafted - accepted
    assert kept > 0 and rejected > 0, (parts, kept, rejected)


def test_serving_rows_with_hybrid_and_other_arms(tiny):
    from env.batch import BatchEngine
    from env.engine import parse_arm
    from env.serving import Request, serve

    loaded, path = tiny
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (6, 19, 11, 8)]
    arms = ["hybrid-d4-k2-b8", "eagle3-d3", "none", "hybrid-d3"]
    reqs = [Request(str(i), p, parse_arm(a), 20) for i, (p, a) in enumerate(zip(prompts, arms))]
    opts = {"hybrid": {"parts": "suffix,eagle3", "options": {"eagle3": {"weights": str(path)}}},
            "eagle3": {"weights": str(path)}}  # fmt: skip
    out = serve(BatchEngine(loaded, max_rows=3), reqs, concurrency=3, drafter_options=opts)
    for r, o in zip(reqs, out):
        assert o.token_ids == decode(loaded, None, r.prompt_ids, 20)[0], r.arm.name
        if r.arm.drafter is not None:
            assert 0 < o.accepted < o.drafted, (r.arm.name, o.accepted, o.drafted)


def test_the_model_drafter_is_skipped_when_the_cheap_tree_is_strong(tiny):
    """A prompt that repeats itself: the suffix tree alone expects >= skip_at tokens, so the eagle3 part is not
    asked for it; with skip_at 0 it always is."""
    from drafters import DraftContext
    from env.batch import BatchTarget

    loaded, path = tiny
    target = BatchTarget(loaded, max_rows=1)
    tokens = [5, 6, 7, 8, 9, 10, 11] * 4 + [5, 6]
    hidden = loaded.model.config.hidden_size
    ctx = DraftContext(tokens=tokens, prompt_len=len(tokens), target=target,
                       last_aux=torch.randn(2 * hidden), aux_layers=target.aux_layers)  # fmt: skip
    for skip_at, skipped in ((1.0, 1), (0.0, 0)):
        d = HybridDrafter("suffix,eagle3", skip_at=skip_at, options={"eagle3": {"weights": str(path)}})
        d.reset(ctx)
        t = d.propose(ctx, TreeShape(depth=4, topk=2, budget=8))
        assert d.skipped == skipped
        assert (7, 8, 9, 10) in _paths(t)  # the repeat is proposed either way


def test_a_short_suffix_match_does_not_skip_the_model(tiny):
    """A one-token match with a single continuation has probability 1 on every node: not evidence enough."""
    from drafters import DraftContext
    from env.batch import BatchTarget

    loaded, path = tiny
    target = BatchTarget(loaded, max_rows=1)
    tokens = [5, 6, 7, 8, 3, 9, 5]
    ctx = DraftContext(tokens=tokens, prompt_len=len(tokens), target=target,
                       last_aux=torch.randn(2 * loaded.model.config.hidden_size), aux_layers=target.aux_layers)  # fmt: skip
    d = HybridDrafter("suffix,eagle3", skip_at=1.0, options={"eagle3": {"weights": str(path)}})
    d.reset(ctx)
    d.propose(ctx, TreeShape(depth=3))
    assert d.parts[0].last_match == 1 and d.skipped == 0
