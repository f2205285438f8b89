"""The suffix drafter: its suffix trie (counts, removal), frequency-ranked proposals, the cross-request cache
shared by forks (on, off, evicted)."""

from __future__ import annotations

import pytest

from drafters import DraftContext, SuffixDrafter, TreeShape
from drafters.suffix import SuffixTrie


def _ctx(tokens, prompt_len=None):
    return DraftContext(tokens=list(tokens), prompt_len=len(tokens) if prompt_len is None else prompt_len)


def test_the_trie_counts_paths_and_removal_takes_them_back():
    t = SuffixTrie(depth_limit=3)
    t.add([1, 2, 1, 2])
    assert t.root.kids[1].count == 2 and t.root.kids[1].kids[2].count == 2
    assert t.root.kids[2].kids[1].kids[2].count == 1  # cut at 3 tokens per path
    t.add([7, 1])
    t.remove([1, 2, 1, 2])
    assert set(t.root.kids) == {7, 1} and t.root.kids[1].count == 1 and not t.root.kids[1].kids


def test_the_most_frequent_continuation_comes_first():
    toks = [5, 1, 2, 9, 1, 2, 8, 1, 2, 8, 3, 1, 2]  # after "1 2": 8 twice, 9 once
    d = SuffixDrafter()
    d.reset(_ctx(toks))
    chain = d.propose(_ctx(toks), TreeShape(depth=2))
    assert chain.tokens.tolist()[:2] == [2, 8]
    tree = d.propose(_ctx(toks), TreeShape(depth=1, topk=2))
    assert sorted(tree.tokens.tolist()[1:]) == [8, 9] and tree.tokens.tolist()[1] == 8
    assert tree.scores is not None and float(tree.scores[1].exp()) == pytest.approx(2 / 3)


def test_an_earlier_answer_is_proposed_to_a_later_request_and_not_without_the_cache():
    answer = [40, 41, 42, 43, 44, 45]
    for cache, expect in ((8, [41, 42, 43]), (0, [])):
        d = SuffixDrafter(cache_requests=cache)
        d.reset(_ctx([1, 2, 3]))
        d.propose(_ctx([1, 2, 3, *answer], prompt_len=3), TreeShape(depth=3))
        other = d.fork()  # another row of the same server: the same global cache
        other.reset(_ctx([9, 9]))
        d.reset(_ctx([7, 8, 40]))  # the first answer goes into the cache at the next reset
        got = d.propose(_ctx([7, 8, 40]), TreeShape(depth=3)).tokens.tolist()[1:]
        assert got == expect
        assert other.propose(_ctx([9, 9, 40]), TreeShape(depth=3)).tokens.tolist()[1:] == expect


def test_the_cache_keeps_the_last_requests_only():
    d = SuffixDrafter(cache_requests=1)
    for i, answer in enumerate(([40, 41, 42], [50, 51, 52], [60, 61, 62])):
        d.reset(_ctx([i]))
        d.propose(_ctx([i, *answer], prompt_len=1), TreeShape(depth=2))
    d.reset(_ctx([0, 40]))  # [60, 61, 62] is the one cached now
    assert d.propose(_ctx([0, 40]), TreeShape(depth=2)).num_nodes == 1
    assert d.propose(_ctx([0, 60]), TreeShape(depth=2)).tokens.tolist() == [60, 61, 62]


def test_a_fork_gives_its_answer_to_the_cache_when_its_row_retires():
    """In serving every request drafts with a fork that is never reset again: the answer enters the shared
    cache when the engine retires the row (``finish``), and a later request's fork proposes from it."""
    from drafters.suffix import SuffixDrafter
    from env.batch import BatchEngine
    from env.engine import parse_arm
    from tests.drafters.tiny import tiny_loaded

    loaded = tiny_loaded()
    eng = BatchEngine(loaded, max_rows=2)
    first = SuffixDrafter()
    d = first.fork()
    row, _ = eng.admit([5, 17, 33, 8], {"suffix": d})
    for _ in range(6):
        eng.step([parse_arm("none")])
    answer = row.tokens[4:]
    eng.retire(row)
    assert list(first.shared["answers"]) == [answer]
    later = first.fork()
    ctx_tokens = [60, 61, *answer[:3]]
    row2, _ = eng.admit(ctx_tokens[:-1], {"suffix": later})
    row2.ctx.tokens[-1:] = ctx_tokens[-1:]  # root = answer[2]: the cache continues with answer[3:]
    from drafters import TreeShape

    t = later.propose(row2.ctx, TreeShape(depth=2))
    assert t.tokens[1:].tolist() == answer[3:5]


def test_equal_counts_prefer_the_most_recent_continuation():
    from drafters import DraftContext, TreeShape
    from drafters.suffix import SuffixDrafter

    d = SuffixDrafter(cache_requests=0)
    tokens = [1, 2, 7, 8, 9, 1, 2, 5, 6, 9, 1, 2]  # "1 2" was followed by 7 8, then by 5 6
    ctx = DraftContext(tokens=tokens, prompt_len=len(tokens))
    d.reset(ctx)
    assert d.propose(ctx, TreeShape(depth=2)).tokens[1:].tolist() == [5, 6]


def test_each_finished_request_is_cached_once():
    """Requests served one after another (reset, propose, finish, as ``drafters.offline.greedy_tau`` does): each
    answer enters the cache once, when it finishes; the next reset does not cache it again (a duplicate would
    push an earlier answer out of a cache of two)."""
    d = SuffixDrafter(cache_requests=2)
    seen = []
    for prompt, answer in (([1], [40, 41, 42]), ([2], [50, 51, 52]), ([3], [60, 61, 62])):
        ctx = _ctx(prompt)
        d.reset(ctx)
        seen.append([list(a) for a in d.shared["answers"]])
        ctx.tokens.extend(answer)
        d.propose(ctx, TreeShape(depth=2))
        d.finish(ctx)
    assert seen == [[], [[40, 41, 42]], [[40, 41, 42], [50, 51, 52]]]


def _cached(choose: str, answer: list[int], here: list[int]) -> tuple[SuffixDrafter, DraftContext]:
    d = SuffixDrafter(choose=choose)
    d.reset(_ctx([0], 1))
    d.finish(_ctx([0, *answer], 1))
    ctx = _ctx(here)
    d.reset(ctx)
    return d, ctx


def test_match_drafts_from_the_longer_match_and_a_tie_from_this_request():
    """``choose="match"``: here "1 2 4" (a match of 3) continues with 9 or 8, the cache's "4" (a match of 1) with
    5, more often: the longer match drafts, not the higher score; at equal matches this request's own text wins.
    ``last_match`` is the longer match of the two whichever drafts (the hybrid's skip rule reads it)."""
    here = [1, 2, 4, 9, 1, 2, 4, 8, 1, 2, 4]
    for choose in ("match", "merge"):
        d, ctx = _cached(choose, [3, 4, 5, 6, 3, 4, 5, 6], here)
        tree = d.propose(ctx, TreeShape(depth=1))
        assert d.last_match == 3, choose
    assert tree.tokens.tolist() == [4, 5]  # merge: the cache's continuation, the more probable
    d, ctx = _cached("match", [3, 4, 5, 6, 3, 4, 5, 6], here)
    assert d.propose(ctx, TreeShape(depth=1)).tokens.tolist() == [4, 8]
    d, ctx = _cached("match", [0, 1, 2, 8, 7], [1, 2, 9, 5, 1, 2])  # "1 2" in both, once each
    assert d.propose(ctx, TreeShape(depth=1)).tokens.tolist() == [2, 9]


def test_local_and_global_candidates_are_merged():
    """With ``choose="merge"`` a proposal holds this request's continuation and the cache's; ``match`` only the
    longer match's."""
    from drafters import DraftContext, TreeShape
    from drafters.suffix import SuffixDrafter

    def paths(t):
        toks, pars = t.tokens.tolist(), t.parents.tolist()
        out: list[tuple[int, ...]] = [()]
        for i in range(1, len(toks)):
            out.append((*out[pars[i]], toks[i]))
        return set(out[1:])

    got = {}
    for choose in ("merge", "match"):
        d = SuffixDrafter(choose=choose)
        d.reset(DraftContext(tokens=[40, 41], prompt_len=1))
        d.finish(DraftContext(tokens=[40, 41, 3, 4, 5, 6, 3, 4, 8], prompt_len=1))  # cache: "3 4" -> 5 / 8
        ctx = DraftContext(tokens=[20, 3, 4, 9, 3, 4], prompt_len=6)  # here "3 4" -> 9
        d.reset(ctx)
        got[choose] = paths(d.propose(ctx, TreeShape(depth=1, topk=3, budget=3)))
    assert {(9,), (8,)} <= got["merge"]
    assert len(got["match"]) < len(got["merge"])


def test_an_unknown_choice_is_refused():
    from drafters.suffix import SuffixDrafter

    with pytest.raises(ValueError, match="choose"):
        SuffixDrafter(choose="best")


@pytest.mark.parametrize("concurrency", [1, 3])
def test_serving_rows_with_suffix_and_other_arms_is_exact(concurrency):
    """Greedy serving with suffix rows (chains and trees, forks sharing one cross-request cache) next to other arms,
    requests joining and leaving: every request gets its plain greedy tokens, and some suffix drafts are accepted
    (the prompts repeat, so the cross-request cache holds answers a later request may draft from; which drafts
    came from it is not checked here: the tests above check the cache itself)."""
    import torch

    from env.batch import BatchEngine
    from env.engine import parse_arm
    from env.serving import Request, serve
    from tests.drafters.tiny import decode, tiny_loaded

    loaded = tiny_loaded()
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (7, 15, 10)]
    arms = ["suffix-d4", "none", "suffix-d4-k2-b6", "suffix-d3", "ngram-d3", "suffix-d6-k3-b10"]
    reqs = [Request(str(i), p, parse_arm(a), 16) for i, (p, a) in enumerate(zip(prompts * 2, arms))]
    out = serve(BatchEngine(loaded, max_rows=3), reqs, concurrency=concurrency)
    for r, o in zip(reqs, out):
        assert o.token_ids == decode(loaded, None, r.prompt_ids, 16)[0], (r.arm.name, r.rid)
    assert sum(o.accepted for o, r in zip(out, reqs) if r.arm.drafter == "suffix") > 0


def test_the_cache_learns_only_the_tokens_a_request_emitted():
    """A step may commit past ``max_new_tokens`` (a draft accepted beyond it): the sequence counts only what it
    may emit, and the suffix drafter's cross-request cache must learn that answer, not the overshoot."""
    from drafters.suffix import SuffixDrafter
    from drafters.trees import chain
    from env.batch import BatchEngine
    from env.engine import NO_DRAFT, parse_arm
    from env.step import Stepper
    from tests.drafters.tiny import tiny_loaded

    loaded = tiny_loaded()
    prompt = [5, 17, 33, 8]
    ar = Stepper(BatchEngine(loaded, max_rows=1), [NO_DRAFT])
    seq = ar.start(prompt, 8, {})
    while not seq.done:
        ar.step([0])
    greedy = list(seq.tokens)
    ar.retire(seq)
    assert len(greedy) == 8  # (the tiny model ends no sequence early)

    first = SuffixDrafter()
    st = Stepper(BatchEngine(loaded, max_rows=1), [NO_DRAFT, parse_arm("suffix-d6")])
    fork = first.fork()
    seq = st.start(prompt, 3, {"suffix": fork})
    fork.propose = lambda ctx, shape: chain(
        greedy[0], greedy[1:7]
    )  # a step that overshoots the request's end
    out = st.step([1])[0]
    assert out.result.accepted == 6 and seq.tokens == greedy[:3] and seq.done  # 7 committed, 3 counted
    st.retire(seq)
    assert list(first.shared["answers"]) == [greedy[:3]]


def test_finishing_after_the_context_was_cut_does_not_reindex_it(monkeypatch):
    """The engine cuts a last step's overshoot from the row's list in place, then finishes the drafter: the answer
    goes to the cache as cut, without indexing the whole context again into a trie that is dropped."""
    d = SuffixDrafter()
    toks = [1, 2, 3] + [4, 5, 6, 7] * 50
    ctx = DraftContext(tokens=toks, prompt_len=3)
    d.reset(ctx)
    d.propose(ctx, TreeShape(depth=4))
    del toks[-3:]  # in place, as Stepper.retire cuts
    extended = []
    real = SuffixTrie.extend
    cache = d.shared["trie"]  # the cache learns the answer, as it should; no other trie learns anything
    monkeypatch.setattr(
        SuffixTrie, "extend", lambda self, *a: (self is not cache and extended.append(1)) or real(self, *a)
    )
    d.finish(ctx)
    assert extended == [] and list(d.shared["answers"]) == [toks[3:]]
    monkeypatch.undo()
    d.reset(DraftContext(tokens=[4, 5, 6], prompt_len=3))  # the next request: the cache knows what follows
    assert d.propose(DraftContext(tokens=[4, 5, 6], prompt_len=3), TreeShape(depth=3)).tokens.tolist()[
        1:
    ] == [7, 4, 5]


def test_the_cache_as_arrays_comes_back_whole_and_bad_arrays_are_refused():
    """``carried``/``restore`` (what a resumed recording keeps): the restored cache proposes as the original, to
    its forks too; arrays from a hostile file are refused in one line."""
    import numpy as np

    from drafters import DrafterError

    d = SuffixDrafter(cache_requests=2)
    for i, answer in enumerate(([40, 41, 42], [50, 51, 52])):
        d.reset(_ctx([i]))
        d.propose(_ctx([i, *answer], prompt_len=1), TreeShape(depth=2))
    d.reset(_ctx([9]))
    state = d.carried()
    assert state["answer_off"].tolist() == [0, 3, 6]
    back = SuffixDrafter(cache_requests=2)
    fork = back.fork()
    back.restore(state)
    for token in (40, 50):
        want = d.propose(_ctx([0, token]), TreeShape(depth=2)).tokens.tolist()
        assert (
            fork.propose(_ctx([0, token]), TreeShape(depth=2)).tokens.tolist()
            == want
            == [token, token + 1, token + 2]
        )
    bad = [
        ({"answers": state["answers"], "answer_off": np.array([0, 3, 7])}, "answer_off must run"),
        ({"answers": state["answers"].astype(float), "answer_off": state["answer_off"]}, "integer array"),
        ({"answers": -state["answers"], "answer_off": state["answer_off"]}, "negative token"),
        ({"answers": state["answers"], "answer_off": np.array([0, 1, 6])}, ">= 2 tokens apart"),
    ]
    for arrays, match in bad:
        with pytest.raises(DrafterError, match=match):
            SuffixDrafter(cache_requests=2).restore(arrays)
    with pytest.raises(DrafterError, match="2 answers, more than this drafter's cache_requests"):
        SuffixDrafter(cache_requests=1).restore(state)
