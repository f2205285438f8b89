"""Token Recycling: the adjacency table follows the verified logits; proposals read it breadth first."""

from __future__ import annotations

import math

import torch

from drafters import DraftContext, DraftTree, Feedback, RecyclingDrafter, TreeShape
from tests.drafters.tiny import decode, tiny_loaded

V = 20


def _logits(top: list[int]) -> torch.Tensor:
    """Logits whose ranking starts with ``top`` (decreasing)."""
    x = torch.full((V,), -10.0)
    for r, t in enumerate(top):
        x[t] = 5.0 - r
    return x


def test_update_keeps_topk_and_last_occurrence_wins():
    d = RecyclingDrafter(width=2)
    d.update(torch.tensor([3, 4, 3]), torch.stack([_logits([1, 2]), _logits([5, 6]), _logits([7, 8])]))
    assert d.ids[3].tolist() == [7, 8]  # the later row of token 3 wins
    assert d.ids[4].tolist() == [5, 6]
    assert d.ids[0].tolist() == [-1, -1] and d.logp[0, 0] == -math.inf
    assert torch.allclose(d.logp[4].exp().sum(), torch.tensor(1.0), atol=1e-3)


def test_observe_uses_tree_logits_then_the_path():
    d = RecyclingDrafter(width=2)
    tree = DraftTree(tokens=torch.tensor([9, 3, 3]), parents=torch.tensor([-1, 0, 0]))
    logits = torch.stack([_logits([3, 1]), _logits([11, 12]), _logits([13, 14])])
    path = torch.tensor([0, 2])
    fb = Feedback(committed=[3, 13], tree=tree, path_logits=logits[path], path=path, tree_logits=logits)
    d.observe(DraftContext(tokens=[9, 3, 13], prompt_len=1), fb)
    assert d.ids[9].tolist() == [3, 1]
    assert d.ids[3].tolist() == [13, 14]  # node 2 (on the path) wins over node 1 with the same token
    d = RecyclingDrafter(width=2)  # a rejected node's row learns from the tree's logits too
    tree = DraftTree(tokens=torch.tensor([9, 3, 5]), parents=torch.tensor([-1, 0, 0]))
    path = torch.tensor([0, 1])
    fb = Feedback(committed=[3, 11], tree=tree, path_logits=logits[path], path=path, tree_logits=logits)
    d.observe(DraftContext(tokens=[9, 3, 11], prompt_len=1), fb)
    assert d.ids[5].tolist() == [13, 14] and d.ids[3].tolist() == [11, 12]


def test_the_default_tree_is_dynamic():
    """The default tree grows where the table is most probable (a chain of 0.9s), where a k-ary tree of the same
    budget takes both children of the root."""
    table = torch.full((4, V), 1e-9)
    for row, (a, b, pa) in enumerate([(2, 3, 0.9), (4, 5, 0.9), (6, 7, 0.5), (8, 9, 0.9)]):
        table[row, a], table[row, b] = pa, 1 - pa
    shape = TreeShape(depth=3, topk=2, budget=3)
    got = {}
    for kind in ("default", "kary"):
        d = RecyclingDrafter(width=2) if kind == "default" else RecyclingDrafter(width=2, tree="kary")
        d.update(torch.tensor([1, 2, 3, 4]), table.log())
        t = d.propose(DraftContext(tokens=[0, 1], prompt_len=1), shape)
        got[kind] = (t.tokens.tolist(), t.parents.tolist())
    assert got["default"] == ([1, 2, 4, 8], [-1, 0, 1, 2])
    assert got["kary"] != got["default"]


def test_propose_reads_the_table_breadth_first():
    d = RecyclingDrafter(width=3, tree="kary")
    d.update(
        torch.tensor([1, 2, 3]), torch.stack([_logits([2, 3, 4]), _logits([3, 5, 6]), _logits([1, 7, 8])])
    )
    t = d.propose(DraftContext(tokens=[0, 1], prompt_len=1), TreeShape(depth=3, topk=2, budget=6))
    assert t.tokens.tolist() == [1, 2, 3, 3, 5, 1, 7]  # level 1: 2, 3; level 2: 2 -> 3, 5; 3 -> 1, 7
    assert t.parents.tolist() == [-1, 0, 0, 1, 1, 2, 2]
    chain = d.propose(DraftContext(tokens=[0, 1], prompt_len=1), TreeShape(depth=4))
    assert chain.tokens.tolist() == [1, 2, 3, 1, 2]


def test_unknown_rows_give_no_children_and_prompt_seeds_empty_rows():
    d = RecyclingDrafter(width=2)
    d._ensure(V)
    assert d.propose(DraftContext(tokens=[4], prompt_len=1), TreeShape(depth=3)).num_nodes == 1
    d.seed_from_prompt([4, 6, 4, 7])
    assert d.ids[4, 0] == 6 and d.ids[6, 0] == 4  # the first bigram fills an empty row; later ones do not
    t = d.propose(DraftContext(tokens=[4], prompt_len=1), TreeShape(depth=3))
    assert t.tokens.tolist() == [4, 6, 4, 6]


def test_a_later_prompt_seeds_its_own_bigram_over_an_earlier_prompts():
    """The table outlives a sequence: request A's seed of row 7 blocked request B's own bigram (7 -> 42)."""
    d = RecyclingDrafter(width=2)
    d._ensure(64)
    d.seed_from_prompt([7, 11, 3])  # request A
    d.update(torch.tensor([3]), torch.log_softmax(torch.arange(64.0)[None], -1))  # row 3 verified
    d.seed_from_prompt([7, 42, 3, 9])  # request B
    assert d.ids[7].tolist() == [42, -1]  # B's seed replaces A's
    assert d.ids[3].tolist() == [63, 62]  # a verified row keeps what the target said
    t = d.propose(DraftContext(tokens=[5, 7], prompt_len=2), TreeShape(depth=1))
    assert t.tokens.tolist() == [7, 42]


def test_greedy_exact_on_tiny_target():
    loaded = tiny_loaded()
    prompt = [5, 17, 33, 17, 5, 60, 2, 8]
    ref, ref_steps = decode(loaded, None, prompt, 40)
    for arm in ("recycling-d4", "recycling-d5-k4-b12"):
        out, steps = decode(loaded, arm, prompt, 40)
        assert out == ref, arm
        assert steps < ref_steps, arm  # the tiny target loops: the table predicts it


def test_forks_share_one_table_across_requests():
    """Serving gives every request a fork of the first request's drafter: without ``fork`` each got a fresh, empty
    table, and recycling served every request but the first cold."""
    d = RecyclingDrafter(width=2)
    f = d.fork()
    d.update(torch.tensor([3]), torch.log_softmax(torch.tensor([[0.0, 1.0, 5.0, 2.0, -1.0]]), -1))
    assert f.ids is d.ids and f.ids[3].tolist() == [2, 3]
    later = f.fork()
    later.update(torch.tensor([1]), torch.log_softmax(torch.tensor([[4.0, 0.0, 0.0, 3.0, 0.0]]), -1))
    assert d.ids[1].tolist() == [0, 3] and d.ids[3].tolist() == [2, 3]
    assert (d.width, d.tree, d.prompt_prior) == (later.width, later.tree, later.prompt_prior)


def test_the_table_as_arrays_comes_back_whole_and_bad_arrays_are_refused():
    """``carried``/``restore`` (what a resumed recording keeps): the restored table is the original, shared with
    the forks; arrays from a hostile file are refused in one line."""
    import numpy as np
    import pytest

    from drafters import DrafterError

    d = RecyclingDrafter(width=2)
    assert d.carried() == {}
    d.update(torch.tensor([3, 4]), torch.stack([_logits([1, 2]), _logits([5, 6])]))
    state = d.carried()
    back = RecyclingDrafter(width=2)
    fork = back.fork()
    back.restore(state)
    assert torch.equal(fork.ids, d.ids) and torch.equal(fork.logp, d.logp)
    ids, logp = state["ids"], state["logp"]
    bad = [
        ({"ids": ids[:, :1], "logp": logp[:, :1]}, r"ids must be \[vocab, 2\]"),
        ({"ids": ids, "logp": logp[:-1]}, "logp must be a float array"),
        ({"ids": np.where(ids == 5, V, ids), "logp": logp}, "a token id outside"),
        ({"ids": ids, "logp": np.where(ids == 5, np.nan, logp)}, "log-probabilities"),
        ({"ids": ids, "logp": np.where(ids == 5, 0.5, logp)}, "log-probabilities"),
        ({"ids": ids, "logp": np.where(ids < 0, 0.0, logp)}, "-inf where ids is -1"),
        ({"ids": ids.astype(np.float32), "logp": logp}, "integer array"),
    ]
    for arrays, match in bad:
        with pytest.raises(DrafterError, match=match):
            RecyclingDrafter(width=2).restore(arrays)
    # a target's vocabulary, where known: a table of another size is refused (drafting would drop it, empty)
    RecyclingDrafter(width=2).restore(state, V)
    with pytest.raises(
        DrafterError, match=f"a table of {V} token ids, not the target's vocabulary of {V + 1}"
    ):
        RecyclingDrafter(width=2).restore(state, V + 1)


def test_ids_outside_the_vocabulary_never_reach_the_table():
    """A negative id wrapped round to row V - k: ``seed_from_prompt([10, -3, 77])`` wrote 77 into row V - 3, and
    row 10 proposed -3. The table outlives the sequence, so the damage outlived the call."""
    import pytest

    from drafters import DrafterError

    d = RecyclingDrafter(width=2)
    d._ensure(V)
    for prompt, bad in (([10, -3, 7], -3), ([10, V, 7], V)):
        with pytest.raises(
            DrafterError, match=f"the prompt holds token id {bad}, outside the vocabulary of {V}"
        ):
            d.seed_from_prompt(prompt)
    with pytest.raises(DrafterError, match="a verified tree holds token id -1"):
        d.update(torch.tensor([3, -1]), torch.stack([_logits([1, 2]), _logits([5, 6])]))
    with pytest.raises(DrafterError, match="holds torch.float32 values"):
        d.update(torch.tensor([3.0]), _logits([1, 2])[None])
    assert (d.ids == -1).all()  # nothing written
    with pytest.raises(
        DrafterError, match="holds id -2, outside the vocabulary"
    ):  # (a root of -2 proposed it)
        DraftContext(tokens=[4, -2], prompt_len=1)
