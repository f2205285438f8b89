from drafters import DraftContext, DrafterError, NGramDrafter, TreeShape, make_drafter
from drafters.trees import chain, trie


def _ctx(tokens):
    return DraftContext(tokens=list(tokens), prompt_len=len(tokens))


def test_longest_match_first_and_most_recent():
    # "1 2 3" occurs twice before the suffix: the most recent continuation comes first
    toks = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    d = NGramDrafter(max_ngram=3)
    d.reset(_ctx(toks))
    assert d.continuations(toks, 3, 2) == [[7, 8, 1], [4, 5, 9]]
    tree = d.propose(_ctx(toks), TreeShape(depth=3))
    assert tree.tokens.tolist() == [3, 7, 8, 1]
    assert tree.parents.tolist() == [-1, 0, 1, 2]


def test_branches_form_a_trie_within_budget():
    toks = [5, 1, 2, 9, 9, 1, 2, 8, 8, 1, 2]
    d = NGramDrafter(max_ngram=2)
    d.reset(_ctx(toks))
    tree = d.propose(_ctx(toks), TreeShape(depth=2, topk=3, budget=3))
    assert tree.tokens.tolist() == [2, 8, 8, 9]
    assert tree.parents.tolist() == [-1, 0, 1, 0]


def test_the_longest_configured_ngram_wins():
    # "1 2" (a 2-gram) was followed by 7 once; "2" alone more recently by 5: with max_ngram=2 the 2-gram comes first
    toks = [1, 2, 7, 3, 2, 5, 1, 2]
    d = NGramDrafter(max_ngram=2, min_ngram=1)
    d.reset(_ctx(toks))
    assert d.continuations(toks, 1, 8) == [[7], [5]]
    assert d.propose(_ctx(toks), TreeShape(depth=1)).tokens.tolist() == [2, 7]


def test_each_ngram_length_keeps_max_matches():
    toks = [4, 9, 4, 8, 4]  # "4" matched twice before the suffix; max_matches=1: the most recent only
    d = NGramDrafter(max_ngram=1, max_matches=1)
    d.reset(_ctx(toks))
    assert d.continuations(toks, 1, 8) == [[8]]


def test_a_tree_arm_keeps_a_branch_per_match():
    # "7" was followed by 1 2 3 4 and by 5 6 8 9: depth 2, two children -> both branches, the most recent first
    toks = [7, 1, 2, 3, 4, 7, 5, 6, 8, 9, 7]
    d = NGramDrafter(max_ngram=1, max_depth=4)
    d.reset(_ctx(toks))
    tree = d.propose(_ctx(toks), TreeShape(depth=2, topk=2))
    assert (tree.tokens.tolist(), tree.parents.tolist()) == ([7, 5, 6, 1, 2], [-1, 0, 1, 0, 3])


def test_a_trie_keeps_to_its_budget_of_draft_nodes():
    small = trie(0, [[1, 2, 3], [4, 5]], budget=2)
    assert (small.tokens.tolist(), small.parents.tolist()) == ([0, 1, 2], [-1, 0, 1])


def test_no_match_gives_root_only_and_index_follows_growth():
    d = NGramDrafter(max_ngram=3, min_ngram=2)
    toks = [1, 2, 3, 4]
    d.reset(_ctx(toks))
    assert d.propose(_ctx(toks), TreeShape(depth=4)).num_nodes == 1
    toks = toks + [1, 2]  # now "1 2" matched at the start; continuation 3 4 1 2
    assert d.propose(_ctx(toks), TreeShape(depth=4)).tokens.tolist() == [2, 3, 4, 1, 2]


def test_shared_prefixes_merge():
    tree = trie(0, [[1, 2, 3], [1, 2, 4], [5]], budget=10)
    assert tree.tokens.tolist() == [0, 1, 2, 3, 4, 5]
    assert tree.parents.tolist() == [-1, 0, 1, 2, 2, 0]
    c = chain(7, [1, 2])
    assert c.parents.tolist() == [-1, 0, 1]


def test_unknown_drafter_lists_known_ones():
    try:
        make_drafter("nope")
    except DrafterError as err:
        assert "ngram" in str(err) and ", none" not in str(
            err
        )  # ("none" drafts nothing: no drafter to build)
    else:
        raise AssertionError("expected DrafterError")


def test_a_context_cut_and_grown_in_place_is_indexed_again():
    """The engine hands the drafter its row's own list and cuts it in place (a rollback, a retire's trim): the
    drafter proposes what a fresh one proposes on the same tokens, never from n-grams of tokens gone."""
    import random

    ctx = _ctx([7, 8, 9, 7])
    d = NGramDrafter(max_ngram=2)
    d.reset(ctx)
    assert d.propose(ctx, TreeShape(depth=2)).tokens.tolist() == [7, 8, 9]
    del ctx.tokens[2:]
    ctx.tokens += [4, 4]  # [7, 8, 4, 4]: "4" follows "4"
    assert d.propose(ctx, TreeShape(depth=2)).tokens.tolist() == [4, 4]
    rng = random.Random(0)
    for _ in range(300):  # random in-place edits against a fresh drafter on a copy
        if ctx.tokens and rng.random() < 0.3:
            del ctx.tokens[rng.randrange(len(ctx.tokens)) :]
        ctx.tokens += [rng.randrange(4) for _ in range(rng.randrange(1, 6))]
        shape = TreeShape(depth=3, topk=2, budget=5)
        fresh = NGramDrafter(max_ngram=2)
        fresh.reset(_ctx(ctx.tokens))
        got = d.propose(ctx, shape)
        want = fresh.propose(_ctx(ctx.tokens), shape)
        assert got.tokens.tolist() == want.tokens.tolist() and got.parents.tolist() == want.parents.tolist()
