"""Losslessness in one batch whose rows use different arms and tree shapes (as the batch-native engine verifies
them): rows padded to a common node count with ``num_nodes``, a root-only row, a chain, a wide tree and a deep tree
side by side; each group's first emitted token follows the target (chi-square, 10^5 draws in all), and a planted
wrong rule run on the same mixed batch fails."""

import pytest
import torch
from kernel_cases import chi_square, draft_trees, markov_table, planted_verify

from kernels import process_logits, verify

V = 6
SHAPES = [
    [-1],
    [-1, 0, 1, 2],
    [-1, 0, 0, 0, 1, 1, 2, 4],
    [-1, 0, 1, 1, 2, 3, 4],
]  # none, chain, tree, deep tree
PER_SHAPE = 25_000


def mixed_first_tokens(verify_fn, seed: int, stochastic: bool, **kw):
    gen = torch.Generator().manual_seed(seed)
    table = markov_table(torch.Generator().manual_seed(200 + seed), V)
    n = max(len(s) for s in SHAPES)
    rows = []
    for s in SHAPES:
        tokens, logits, q = draft_trees(gen, table, s, torch.zeros(PER_SHAPE, dtype=torch.int64), stochastic)
        pad = n - len(s)
        par = torch.tensor(s + [0] * pad)[None].expand(PER_SHAPE, n)
        rows.append((
            torch.nn.functional.pad(tokens, (0, pad)), par,
            torch.nn.functional.pad(logits, (0, 0, 0, pad)),
            None if q is None else torch.nn.functional.pad(q, (0, 0, 0, pad), value=1.0 / V),
            torch.full((PER_SHAPE,), len(s)),
        ))  # fmt: skip
    order = torch.randperm(PER_SHAPE * len(SHAPES), generator=gen)  # rows of every shape interleaved
    cat = [torch.cat([r[i] for r in rows])[order] if rows[0][i] is not None else None for i in range(5)]
    tokens, parents, logits, q, num = cat
    v = verify_fn(tokens, parents, logits, draft_probs=q, generator=gen, num_nodes=num, **kw)
    toks = tokens.gather(1, v.path.clamp(min=0))
    first = torch.where(v.accept_len >= 1, toks[:, 1], v.next_token)
    shape_of = torch.arange(len(SHAPES)).repeat_interleave(PER_SHAPE)[order]
    p = process_logits(table, kw.get("temperature", 1.0), kw.get("top_k", 0), kw.get("top_p", 1.0))[0]
    return [chi_square(torch.bincount(first[shape_of == k], minlength=V), p) for k in range(len(SHAPES))]


@pytest.mark.parametrize("stochastic", [False, True])
def test_mixed_batch_is_lossless(stochastic):
    for stat, crit in mixed_first_tokens(verify, 3, stochastic, temperature=0.9):
        assert stat < crit, (stat, crit)


def test_planted_wrong_rule_fails_on_the_mixed_batch():
    wrong = planted_verify("p/q", "p")  # the rejected token keeps its mass

    def with_num_nodes(tokens, parents, logits, *, num_nodes, **kw):
        n = parents.shape[1]
        pad = torch.arange(n)[None] >= num_nodes[:, None]
        parents = parents.masked_fill(pad, n)  # padding never tried by the planted scan
        return wrong(tokens, parents, logits, **kw)

    stats = mixed_first_tokens(with_num_nodes, 3, False, temperature=0.9)
    assert any(stat > crit for stat, crit in stats), stats
