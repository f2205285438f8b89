"""Greedy verification (T = 0): hand-made trees with known answers, the literal oracle, and equality with greedy
autoregressive decoding."""

import torch
from kernel_cases import markov_table, oracle_verify, random_trees

from kernels import argmax_lastdim, verify, verify_reference
from kernels.reference import first_ok_chain, greedy_walk_lists

V = 10


def one_hot_logits(argmaxes: list[list[int]]) -> torch.Tensor:
    """logits [B, N, V] whose row i has its maximum at argmaxes[b][i]."""
    logits = torch.zeros(len(argmaxes), len(argmaxes[0]), V)
    for b, row in enumerate(argmaxes):
        for i, t in enumerate(row):
            logits[b, i, t] = 5.0
    return logits


def test_chain_full_partial_and_none() -> None:
    parents = torch.tensor([[-1, 0, 1, 2]] * 3)
    tokens = torch.tensor([[9, 1, 2, 3], [9, 1, 2, 4], [9, 5, 2, 3]])
    logits = one_hot_logits([[1, 2, 3, 7], [1, 2, 3, 7], [1, 2, 3, 7]])
    v = verify(tokens, parents, logits)
    assert v.accept_len.tolist() == [3, 2, 0]
    assert v.path.tolist() == [[0, 1, 2, 3], [0, 1, 2, -1], [0, -1, -1, -1]]
    assert v.next_token.tolist() == [7, 3, 1]
    assert v.accepted.tolist() == [[True] * 4, [True, True, True, False], [True, False, False, False]]


def test_branching_first_matching_child_wins() -> None:
    # root children 1, 2, 3 carry tokens 4, 6, 6; argmax after the root is 6: node 2 wins over its duplicate 3,
    # then node 5 (child of 2) matches; node 4 (child of 3) never gets tried.
    parents = torch.tensor([[-1, 0, 0, 0, 3, 2]])
    tokens = torch.tensor([[0, 4, 6, 6, 8, 8]])
    logits = one_hot_logits([[6, 1, 8, 8, 1, 2]])
    v = verify(tokens, parents, logits)
    assert v.path.tolist() == [[0, 2, 5]] and v.accept_len.tolist() == [2] and v.next_token.tolist() == [2]


def test_padding_never_accepted() -> None:
    parents = torch.tensor([[-1, 0, 1, 2], [-1, 0, 1, 2]])
    tokens = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]])
    logits = one_hot_logits([[1, 2, 3, 4], [1, 2, 3, 4]])
    v = verify(tokens, parents, logits, num_nodes=torch.tensor([4, 2]))
    assert v.accept_len.tolist() == [3, 1] and v.next_token.tolist() == [4, 2]
    assert v.path.tolist() == [[0, 1, 2, 3], [0, 1, -1, -1]]
    assert v.node_prob[1, 2:].tolist() == [0.0, 0.0]


def test_node_prob_is_softmax_of_parent_row() -> None:
    gen = torch.Generator().manual_seed(0)
    parents = torch.tensor([[-1, 0, 0, 1, 2]])
    tokens = torch.randint(0, V, (1, 5), generator=gen)
    logits = torch.randn(1, 5, V, generator=gen)
    p = torch.softmax(logits, -1)
    want = [1.0] + [p[0, parents[0, i], tokens[0, i]].item() for i in range(1, 5)]
    torch.testing.assert_close(
        verify(tokens, parents, logits).node_prob[0], torch.tensor(want), atol=1e-7, rtol=0
    )


def test_random_trees_match_oracle_and_vectorized_walk() -> None:
    gen = torch.Generator().manual_seed(3)
    for B, N, Vr in ((7, 9, 13), (5, 33, 3000), (3, 1, 5)):
        parents, num_nodes = random_trees(gen, B, N)
        logits = torch.randn(B, N, Vr, generator=gen)
        tokens = torch.randint(0, Vr, (B, N), generator=gen)
        hit = torch.rand(B, N, generator=gen) < 0.7  # make most nodes their parent's argmax
        am = logits.argmax(-1)
        tokens = torch.where(
            hit, am.gather(1, torch.where(num_nodes[:, None] > torch.arange(N), parents, 0).clamp(0)), tokens
        )
        v = verify_reference(tokens, parents, logits, num_nodes=num_nodes)
        want = oracle_verify(tokens, parents, logits, num_nodes, 0.0, 0, 1.0, None, None, None)
        assert [p[p >= 0].tolist() for p in v.path] == [w[0] for w in want]
        assert v.next_token.tolist() == [w[1] for w in want]
        # the plain-Python small-batch walk and the vectorized pointer-jumping walk agree
        valid = torch.arange(N)[None] < num_nodes[:, None]
        par = torch.where(valid, parents, 0).clamp(min=0)
        path, acc_len, nxt, accepted = greedy_walk_lists(tokens, par, am, valid)
        ok = (tokens == am.gather(1, par)) & valid
        assert torch.equal(first_ok_chain(ok, par), accepted) and torch.equal(path, v.path)


def test_speculative_greedy_equals_autoregressive_greedy() -> None:
    gen = torch.Generator().manual_seed(5)
    Vm = 50
    table = markov_table(gen, Vm)  # toy target: next-token logits given the last token
    ar = [0]
    for _ in range(40):
        ar.append(int(table[ar[-1]].argmax()))
    out, kept, rejected = [0], 0, 0
    shape = [-1, 0, 0, 1, 1, 2, 3, 5]
    while len(out) < 41:
        tokens = torch.randint(0, Vm, (1, len(shape)), generator=gen)
        tokens[0, 0] = out[-1]
        for i in range(1, len(shape)):  # a drafter that is right half of the time
            if torch.rand(1, generator=gen).item() < 0.5:
                tokens[0, i] = table[tokens[0, shape[i]]].argmax()
        v = verify(tokens, torch.tensor([shape]), table[tokens])
        path = v.path[0, 1:][v.path[0, 1:] >= 0]
        out += tokens[0, path].tolist() + v.next_token.tolist()
        last = int(path[-1]) if path.numel() else 0
        kept, rejected = (
            kept + path.numel(),
            rejected + int(last in shape),
        )  # the path stopped at a node with children
    assert out[:41] == ar
    assert kept > 0 and rejected > 0  # both paths of verification were taken


def test_argmax_lastdim_matches_torch() -> None:
    gen = torch.Generator().manual_seed(2)
    for shape in ((3, 5000), (2, 3, 4096), (1, 9000), (4, 17)):
        x = torch.round(torch.randn(*shape, generator=gen) * 2)  # many ties: first index must win
        assert torch.equal(argmax_lastdim(x), x.argmax(-1))
        x[..., -1] = 100.0  # maximum in the tail
        assert torch.equal(argmax_lastdim(x), x.argmax(-1))
    xb = torch.randn(2, 5000).bfloat16()
    assert torch.equal(argmax_lastdim(xb), xb.argmax(-1))
