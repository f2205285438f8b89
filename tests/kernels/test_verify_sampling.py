"""Sampling verification (T > 0) against the literal oracle of the contract, plus hand-made cases."""

import pytest
import torch
from kernel_cases import oracle_verify, random_trees

from kernels import inverse_cdf, process_logits, verify, verify_reference


@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 4, 1.0), (1.3, 0, 0.8)])
def test_random_trees_match_oracle(stochastic: bool, temperature: float, top_k: int, top_p: float) -> None:
    gen = torch.Generator().manual_seed(11)
    B, N, V = 40, 11, 7
    parents, num_nodes = random_trees(gen, B, N, branch=0.6)
    logits = torch.randn(B, N, V, generator=gen) * 1.5
    tokens = torch.randint(0, V, (B, N), generator=gen)  # tiny V: duplicate siblings are frequent
    par = torch.where(torch.arange(N)[None] < num_nodes[:, None], parents, 0).clamp(min=0)
    likely = logits.argmax(-1).gather(1, par)  # the parent row's top token, often accepted
    tokens = torch.where(torch.rand(B, N, generator=gen) < 0.5, likely, tokens)
    q = torch.softmax(torch.randn(B, N, V, generator=gen), -1) if stochastic else None
    coins, final_coins = torch.rand(B, N, generator=gen), torch.rand(B, generator=gen)
    kw = dict(
        temperature=temperature, top_k=top_k, top_p=top_p, draft_probs=q, coins=coins, final_coins=final_coins
    )
    v = verify_reference(tokens, parents, logits, num_nodes=num_nodes, **kw)
    want = oracle_verify(tokens, parents, logits, num_nodes, temperature, top_k, top_p, q, coins, final_coins)
    assert [p[p >= 0].tolist() for p in v.path] == [w[0] for w in want]
    assert v.next_token.tolist() == [w[1] for w in want]
    assert v.accept_len.tolist() == [len(w[0]) - 1 for w in want]
    assert int(v.accept_len.sum()) > B // 4  # the case exercises acceptances
    # node_prob: p of the node's token under its parent's processed distribution
    probs = process_logits(logits, temperature, top_k, top_p)
    valid = torch.arange(N)[None] < num_nodes[:, None]
    want_np = probs[torch.arange(B)[:, None], par, tokens]
    want_np[:, 0] = 1.0
    torch.testing.assert_close(v.node_prob, torch.where(valid, want_np, 0.0), atol=1e-7, rtol=0)


def test_generator_draws_coins_then_final_coins() -> None:
    gen = torch.Generator().manual_seed(0)
    parents, num_nodes = random_trees(gen, 6, 8)
    logits, tokens = torch.randn(6, 8, 5, generator=gen), torch.randint(0, 5, (6, 8), generator=gen)
    a = verify(
        tokens,
        parents,
        logits,
        num_nodes=num_nodes,
        temperature=1.0,
        generator=torch.Generator().manual_seed(7),
    )
    g = torch.Generator().manual_seed(7)
    coins, final = torch.rand(6, 8, generator=g), torch.rand(6, generator=g)
    b = verify(tokens, parents, logits, num_nodes=num_nodes, temperature=1.0, coins=coins, final_coins=final)
    assert torch.equal(a.path, b.path) and torch.equal(a.next_token, b.next_token)


def test_hand_made_deterministic_drafts() -> None:
    # root distribution p = [0.5, 0.3, 0.2, 0]; children tokens 0, 0 (duplicate), 1, 3 (zero probability)
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    logits = p.clamp(min=1e-30).log().expand(1, 5, 4).clone()
    logits[0, :, 3] = float("-inf")
    parents = torch.tensor([[-1, 0, 0, 0, 0]])
    tokens = torch.tensor([[2, 0, 0, 1, 3]])

    def run(coins: list[float], u: float):
        return verify(tokens, parents, logits, temperature=1.0, coins=torch.tensor([[0.0] + coins]),
                      final_coins=torch.tensor([u]))  # fmt: skip

    assert run([0.49, 0.0, 0.0, 0.0], 0.5).path.tolist() == [[0, 1]]
    # node 1 rejected -> p = [0, 0.6, 0.4, 0]; the duplicate node 2 is rejected even with coin 0;
    # node 3 (token 1) accepted iff coin <= 0.6
    assert run([0.51, 0.0, 0.59, 0.0], 0.5).path.tolist() == [[0, 3]]
    v = run([0.51, 0.0, 0.61, 0.0], 0.5)  # residual [0, 0, 1, 0]: node 4 (token 3, p = 0) rejected, draw 2
    assert v.path.tolist() == [[0]] and v.next_token.tolist() == [2]


def test_hand_made_draft_probs() -> None:
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.25, 0.25, 0.5])
    logits = p.log().expand(1, 2, 3).clone()
    parents, tokens = torch.tensor([[-1, 0]]), torch.tensor([[0, 2]])
    dp = q.expand(1, 2, 3).clone()

    def run(coin: float, u: float):
        return verify(tokens, parents, logits, temperature=1.0, draft_probs=dp, coins=torch.tensor([[0.0, coin]]),
                      final_coins=torch.tensor([u]))  # fmt: skip

    assert run(0.39, 0.0).accept_len.tolist() == [1]  # p/q = 0.4 for token 2
    # rejected: residual max(p - q, 0) = [0.25, 0.05, 0] / 0.3
    assert run(0.41, 0.80).next_token.tolist() == [0] and run(0.41, 0.86).next_token.tolist() == [1]


def test_a_final_coin_on_a_boundary_never_draws_a_token_of_probability_zero() -> None:
    """The last draw is min{t : sum_{j<=t} r_j > u * sum(r)}, strictly greater: a coin of exactly 0 (``torch.rand``
    can give it) or one landing on a cumulative sum moves on to the next token of positive mass; with <= the draw
    would be a token of mass zero (excluded by top-k, top-p or a -inf logit) or one token too early."""
    r = torch.tensor([[0.0, 0.5, 0.5], [0.25, 0.25, 0.5], [0.25, 0.0, 0.75]])
    assert inverse_cdf(r, torch.tensor([0.0, 0.5, 0.25])).tolist() == [1, 2, 2]
    logits = torch.tensor([[[float("-inf"), 0.0, 0.0]]])  # the root alone: the bonus token is the final draw
    v = verify(torch.tensor([[1]]), torch.tensor([[-1]]), logits, temperature=1.0, coins=torch.zeros(1, 1),
               final_coins=torch.tensor([0.0]))  # fmt: skip
    assert v.next_token.tolist() == [1]
