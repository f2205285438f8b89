"""Losslessness: speculative sampling over trees emits exactly the target's distribution (SpecInfer, arXiv
2305.09781; EAGLE, arXiv 2401.15077). Chi-square tests with 10^5 seeded draws on a tiny vocabulary, for the first
emitted token and the joint of the first two, on chains and branching trees, with deterministic drafts and with
draft_probs; and planted wrong rules that the same test rejects."""

import pytest
import torch
from kernel_cases import chi_square, first_two_tokens, markov_table

from kernels import inverse_cdf, process_logits, verify, verify_reference

V = 6
DRAWS = 100_000
CHAIN = [-1, 0, 1, 2]
TREE = [-1, 0, 0, 0, 1, 1, 2, 4]  # three root children, depth 3


def target_joint(table: torch.Tensor, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """P(t1) after root token 0 and P(t1, t2) for the Markov toy target."""
    p = process_logits(table, kw.get("temperature", 1.0), kw.get("top_k", 0), kw.get("top_p", 1.0))  # [V, V]
    return p[0], p[0][:, None] * p


def lossless_stats(verify_fn, shape: list[int], stochastic: bool, seed: int, **kw) -> list[tuple[float, float]]:
    table = markov_table(torch.Generator().manual_seed(100 + seed), V)
    gen = torch.Generator().manual_seed(seed)
    t1, t2 = first_two_tokens(verify_fn, gen, table, shape, DRAWS, stochastic, **kw)
    p1, p12 = target_joint(table, **kw)
    c1 = torch.bincount(t1, minlength=V)
    c12 = torch.bincount(t1 * V + t2, minlength=V * V).view(V, V)
    return [chi_square(c1, p1), chi_square(c12, p12)]


CASES = [
    (CHAIN, False, dict(temperature=1.0)),
    (TREE, False, dict(temperature=0.8, top_k=4)),
    (CHAIN, True, dict(temperature=1.0)),
    (TREE, True, dict(temperature=1.2, top_p=0.9)),
]


@pytest.mark.parametrize("shape,stochastic,kw", CASES)
def test_lossless(shape: list[int], stochastic: bool, kw: dict) -> None:
    for stat, crit in lossless_stats(verify, shape, stochastic, seed=1, **kw):
        assert stat < crit, (stat, crit)


def accept_min_1_p(tokens, parents, logits, *, draft_probs=None, **kw):
    """Planted wrong rule: stochastic drafts tested with min(1, p[x]) instead of min(1, p[x] / q[x]), residual
    p with x removed instead of max(p - q, 0)."""
    return verify_reference(tokens, parents, logits, **kw)


def no_residual(tokens, parents, logits, *, draft_probs=None, generator=None, **kw):
    """Planted wrong rule: after rejections, the bonus token is drawn from the fresh p, not the residual."""
    B, N = tokens.shape
    coins, final = torch.rand(B, N, generator=generator), torch.rand(B, generator=generator)
    v = verify_reference(tokens, parents, logits, draft_probs=draft_probs, coins=coins, final_coins=final, **kw)
    last = v.path.gather(1, v.accept_len[:, None])[:, 0]
    p = process_logits(logits[torch.arange(B), last], kw["temperature"], kw.get("top_k", 0), kw.get("top_p", 1.0))
    object.__setattr__(v, "next_token", inverse_cdf(p, final))
    return v


@pytest.mark.parametrize(
    "wrong,shape,stochastic", [(accept_min_1_p, CHAIN, True), (no_residual, TREE, False), (no_residual, CHAIN, True)]
)
def test_planted_wrong_rule_is_rejected(wrong, shape: list[int], stochastic: bool) -> None:
    stats = lossless_stats(wrong, shape, stochastic, seed=1, temperature=1.0)
    assert any(stat > crit for stat, crit in stats), stats
