"""Losslessness: speculative sampling over trees emits exactly the target's distribution (SpecInfer, arXiv
2305.09781; EAGLE, arXiv 2401.15077). Chi-square tests with 10^5 seeded draws on a tiny vocabulary, for the first
emitted token and the joint of the first two, on chains and branching trees, with deterministic drafts and with
draft_probs; and planted wrong rules that the same test rejects."""

import pytest
import torch
from kernel_cases import chi_square, first_two_tokens, markov_table, planted_verify

from kernels import process_logits, verify

V = 6
DRAWS = 100_000
CHAIN = [-1, 0, 1, 2]
TREE = [-1, 0, 0, 0, 1, 1, 2, 4]  # three root children, depth 3


def target_joint(table: torch.Tensor, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """P(t1) after root token 0 and P(t1, t2) for the Markov toy target."""
    p = process_logits(table, kw.get("temperature", 1.0), kw.get("top_k", 0), kw.get("top_p", 1.0))  # [V, V]
    return p[0], p[0][:, None] * p


def lossless_stats(
    verify_fn, shape: list[int], stochastic: bool, seed: int, **kw
) -> list[tuple[float, float]]:
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


def test_planted_harness_correct_rule_passes() -> None:
    stats = lossless_stats(planted_verify("p/q", "max(p-q,0)"), TREE, True, seed=2, temperature=1.0)
    assert all(stat < crit for stat, crit in stats), stats


@pytest.mark.parametrize(
    "accept_rule,residual_rule,shape,stochastic",
    [
        ("p", "max(p-q,0)", CHAIN, True),  # acceptance min(1, p) instead of min(1, p / q)
        ("p/q", "p", TREE, True),  # residual p instead of normalize(max(p - q, 0))
        ("p/q", "p", TREE, False),  # deterministic drafts: the rejected token keeps its mass
    ],
)
def test_planted_wrong_rule_is_rejected(
    accept_rule: str, residual_rule: str, shape: list[int], stochastic: bool
) -> None:
    wrong = planted_verify(accept_rule, residual_rule)
    stats = lossless_stats(wrong, shape, stochastic, seed=2, temperature=1.0)
    assert any(stat > crit for stat, crit in stats), stats
