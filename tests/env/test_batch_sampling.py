"""Sampling through the batch engine is lossless: every token a row samples, on admission and as the first token of
each speculative step, follows the target's processed distribution there (temperature, then top-k, then top-p),
with rows of no draft, a chain and a wide tree (a duplicate child, a child of probability zero) and of different
lengths verified side by side in one forward. Chi-square on the tiny target: each draw's rank in the exact distribution (the
transformers model without a cache) against the ranks' summed probabilities; the same test fails when the
engine's verifier keeps a rejected token's mass (a planted wrong rule). ``tests/kernels/test_verify_lossless.py``
tests the rules alone; this tests what the engine passes them and does with their verdicts (the seeded-sampling
tests pass with an engine that decodes greedily)."""

from __future__ import annotations

import copy

import pytest
import torch

import kernels
from drafters import DraftTree
from env.batch import BatchEngine
from env.engine import Sampling, parse_arm
from kernels import process_logits
from tests.drafters.tiny import tiny_loaded
from tests.kernels.kernel_cases import chi_square, planted_verify

pytestmark = pytest.mark.slow

PROMPT = [13, 70, 49, 76, 31, 8]
SAMPLING = Sampling(temperature=1.8, top_k=6)  # hot: rejections are frequent, every rank is drawn
ROWS, STEPS = 200, 6
ARMS = [parse_arm("none"), parse_arm("ngram-d2"), parse_arm("ngram-d1-k4-b4")]


def next_probs(loaded, seqs: list[list[int]], s: Sampling = SAMPLING) -> torch.Tensor:
    """[B, V]: the target's processed distribution of the token after each sequence (transformers, no cache)."""
    n = max(map(len, seqs))
    ids = torch.tensor([q + [0] * (n - len(q)) for q in seqs])  # right padding: causal, so it is never seen
    with torch.no_grad():
        logits = loaded.model(ids).logits[torch.arange(len(seqs)), torch.tensor([len(q) - 1 for q in seqs])]
    return process_logits(logits, s.temperature, s.top_k, s.top_p)


def tree_for(i: int, root: int, p: torch.Tensor) -> DraftTree:
    """Row i's draft after its root (``p``: the target's distribution after it): none, a chain starting with the
    likely token, or a tree whose children are the second-likely token, the likely one twice (a duplicate sibling)
    and one outside the top-k (never right)."""
    top = p.argsort(descending=True).tolist()
    if i % 3 == 0:
        return DraftTree.root_only(root)
    if i % 3 == 1:
        return DraftTree(tokens=torch.tensor([root, top[0], top[1]]), parents=torch.tensor([-1, 0, 1]))
    toks = [root, top[1], top[0], top[0], top[-1]]
    return DraftTree(tokens=torch.tensor(toks), parents=torch.tensor([-1, 0, 0, 0, 0]))


class RankTally:
    """Counts of emitted tokens by their rank in the distribution they were drawn from (rank k: outside the top-k,
    probability zero), and the expected counts: the sum over draws of each rank's probability."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.counts = torch.zeros(k + 1, dtype=torch.float64)
        self.expected = torch.zeros(k + 1, dtype=torch.float64)

    def add(self, probs: torch.Tensor, emitted: list[int]) -> None:
        k = self.k
        ranked = probs.double().sort(dim=-1, descending=True)
        self.expected[:k] += ranked.values[:, :k].sum(0)
        for row, t in enumerate(emitted):
            r = int((ranked.indices[row] == t).nonzero()[0])
            self.counts[min(r, k) if probs[row, t] > 0 else k] += 1

    def chi_square(self) -> tuple[float, float]:
        """Ranks expected fewer than 5 times pooled into one cell; the zero-probability cell kept apart."""
        k = self.k
        c, e = self.counts[:k], self.expected[:k]
        big = e >= 5
        counts = torch.cat([c[big], c[~big].sum()[None], self.counts[k:]])
        probs = torch.cat([e[big], e[~big].sum()[None], torch.zeros(1, dtype=torch.float64)])
        return chi_square(counts, probs / probs.sum())


def sample(loaded, s: Sampling = SAMPLING, n_rows: int = ROWS, steps: int = STEPS) -> RankTally:
    """``n_rows`` rows admitted (each samples its first token) and stepped ``steps`` times with a mix of drafts;
    every row's first emitted token of each step (and of its admission) tallied against the target's distribution
    there."""
    engine = BatchEngine(loaded, max_rows=n_rows, sampling=s, seed=7)
    pf = engine.begin_prefill(PROMPT)
    engine.prefill_chunk(pf)
    tally = RankTally(s.top_k)
    firsts = [engine.admit(PROMPT, {}, prefill=copy.copy(pf))[1] for _ in range(n_rows)]  # prefilled once
    tally.add(next_probs(loaded, [PROMPT], s).expand(n_rows, -1), firsts)
    arms = [ARMS[i % 3] for i in range(n_rows)]
    for _ in range(steps):
        rows = engine.target.rows
        probs = next_probs(loaded, [row.tokens for row in rows], s)  # the root is the last token of each
        trees = [tree_for(i, row.tokens[-1], probs[i]) for i, row in enumerate(rows)]
        results = engine.verify(arms, trees, [0.0] * n_rows)
        tally.add(probs, [res.committed[0] for res in results])
    assert len({len(row.tokens) for row in engine.target.rows}) > 1  # rows of different lengths, one forward
    return tally


def test_engine_sampling_follows_the_target_and_a_planted_wrong_rule_fails(monkeypatch):
    loaded = tiny_loaded()
    tally = sample(loaded)
    stat, crit = tally.chi_square()
    assert stat < crit, (stat, crit, tally.counts.tolist(), tally.expected.tolist())
    assert tally.counts[1:].sum() > 0.1 * tally.counts.sum()  # not greedy: the likely token is not all

    wrong = planted_verify("p/q", "p")  # deterministic drafts: the rejected token keeps its mass

    def wrong_verify(tokens, parents, logits, *, num_nodes, **kw):
        n = parents.shape[1]
        pad = torch.arange(n)[None] >= num_nodes[:, None]
        return wrong(tokens, parents.masked_fill(pad, n), logits, **kw)  # padding never tried

    monkeypatch.setattr(kernels, "verify", wrong_verify)
    stat, crit = sample(loaded).chi_square()
    assert stat > crit, (stat, crit)


def test_a_rows_sampled_text_does_not_depend_on_the_rows_beside_it():
    """The engine drew every row's coins from one generator as one [rows, widest tree] block, so a request's
    sampled text changed with its slot, the other rows' trees and when they came and went. Each row now draws
    from its own generator (the seed and its admission number): the same request, admitted first, samples the
    same text alone and beside a row drafting a deep tree."""
    from drafters import make_drafter
    from env.engine import NO_DRAFT
    from env.step import Stepper

    loaded = tiny_loaded()

    def serve(neighbour: list[int] | None) -> list[int]:
        engine = BatchEngine(loaded, max_rows=2, sampling=Sampling(temperature=1.0), seed=11)
        st = Stepper(engine, [NO_DRAFT, parse_arm("ngram-d2"), parse_arm("ngram-d8-k2-b16")])
        seq = st.start(PROMPT, 24, {"ngram": make_drafter("ngram")})
        if neighbour is not None:
            st.start(neighbour, 40, {"ngram": make_drafter("ngram")})
        while not seq.done:
            for s in [s for s in st.seqs if s.done]:
                st.retire(s)
            st.step([1 if s is seq else 2 for s in st.seqs])
        return list(seq.tokens)

    alone = serve(None)
    assert serve([5, 17, 33, 8, 5, 17, 33, 8, 5, 17]) == alone
    assert len(set(alone)) > 3  # sampled, not one token over and over


def test_engine_sampling_keeps_to_the_nucleus_and_an_engine_that_drops_top_p_fails(monkeypatch):
    """top-p as the engine passes it to the verifier: the tokens outside the nucleus have probability zero there,
    so one drawn is the chi-square's zero cell. The planted wrong rule verifies with the top-k alone (top-p 1)."""
    loaded = tiny_loaded()
    s = Sampling(temperature=1.8, top_k=8, top_p=0.6)
    tally = sample(loaded, s, n_rows=100, steps=3)
    stat, crit = tally.chi_square()
    assert stat < crit, (stat, crit, tally.counts.tolist(), tally.expected.tolist())
    assert tally.counts[-1] == 0 and tally.counts[1:].sum() > 0.1 * tally.counts.sum()
    assert (tally.expected[:-1] == 0).any()  # the nucleus is narrower than the top-k: ranks it never holds

    real = kernels.verify
    monkeypatch.setattr(kernels, "verify", lambda *a, **kw: real(*a, **{**kw, "top_p": 1.0}))
    wrong = sample(loaded, s, n_rows=100, steps=3)
    assert wrong.counts[-1] > 0 and wrong.chi_square()[0] > wrong.chi_square()[1]


def test_a_request_with_its_own_seed_samples_the_same_text_whatever_order_it_entered_in():
    """A row's stream follows the engine's seed and its admission number; a request with its own seed
    (``Request.seed``, as vLLM's ``SamplingParams.seed``) samples the same text alone and entering third beside two
    others, and the rows beside it keep theirs. Bad seeds are one line."""
    from dataclasses import replace

    from env.serving import Request, ServeError, serve

    loaded = tiny_loaded()

    def run(requests: list, concurrency: int) -> dict[str, list[int]]:
        engine = BatchEngine(loaded, max_rows=3, sampling=Sampling(temperature=1.0), seed=5)
        return {s.rid: s.token_ids for s in serve(engine, requests, concurrency=concurrency)}

    mine = Request("mine", PROMPT, parse_arm("ngram-d2"), 24, seed=7)
    others = [
        Request(f"o{i}", [5, 17, 33, 8, 5, 17][: 3 + i], parse_arm("ngram-d8-k2-b16"), 30) for i in range(2)
    ]
    alone = run([mine], 1)["mine"]
    together = run([*others, mine], 3)
    assert together["mine"] == alone and len(set(alone)) > 3
    assert {k: v for k, v in together.items() if k != "mine"} == run(
        others, 3
    )  # the others' streams as before
    assert run([*others, replace(mine, seed=None)], 3)["mine"] != alone  # (without: the third row's stream)
    for bad in (-1, 2**64, 1.5, True):
        with pytest.raises(ServeError, match="request mine: seed must be an integer in"):
            run([replace(mine, seed=bad)], 1)
