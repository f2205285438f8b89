"""Shared cases for the kernels tests: random padded trees, a literal per-sequence oracle of the verification
contract (DESIGN.md "Verification semantics"), a Markov toy target for losslessness tests, and a scipy-free
chi-square test. Everything takes an explicit torch.Generator."""

from __future__ import annotations

import importlib.util
import math
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import Tensor

from kernels import inverse_cdf, process_logits
from kernels.common import verdict_from_accepted

# where the Triton kernels run: on CUDA, or on the CPU under the interpreter (TRITON_INTERPRET=1, set before triton
# is imported: each Triton test file reruns itself so, through rerun_under_interpreter)
HAS_TRITON = importlib.util.find_spec("triton") is not None
CUDA = torch.cuda.is_available()
TRITON_MODE = HAS_TRITON and (CUDA or os.environ.get("TRITON_INTERPRET") == "1")
DEVICE = "cuda" if CUDA else "cpu"
needs_triton = pytest.mark.skipif(not TRITON_MODE, reason="needs CUDA or TRITON_INTERPRET=1 (see below)")
rerun_here = pytest.mark.skipif(
    not HAS_TRITON or TRITON_MODE, reason="triton missing, or already in Triton mode"
)


def rerun_under_interpreter(test_file: str, *pytest_args: str, timeout: int = 800) -> str:
    """Run ``test_file`` again in a subprocess with TRITON_INTERPRET=1 (set before triton is imported: the Triton
    kernels run on the CPU, slowly); asserts it passed and returns its output."""
    path = Path(test_file).resolve()
    repo = path.parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(repo), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path), *pytest_args]
    res = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]
    return res.stdout


def random_trees(gen: torch.Generator, B: int, N: int, branch: float = 0.5) -> tuple[Tensor, Tensor]:
    """parents int64 [B, N] (chain-biased random trees, garbage in padding) and num_nodes int64 [B]."""
    parents = torch.full((B, N), -1, dtype=torch.int64)
    for i in range(1, N):
        jump = torch.rand(B, generator=gen) < branch
        parents[:, i] = torch.where(jump, torch.randint(0, i, (B,), generator=gen), i - 1)
    num_nodes = torch.randint(1, N + 1, (B,), generator=gen)
    num_nodes[0] = N
    pad = torch.arange(N)[None, :] >= num_nodes[:, None]
    parents = torch.where(pad, torch.randint(-1, N, (B, N), generator=gen), parents)
    return parents, num_nodes


def oracle_verify(
    tokens: Tensor,
    parents: Tensor,
    logits: Tensor,
    num_nodes: Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    draft_probs: Tensor | None,
    coins: Tensor,
    final_coins: Tensor,
) -> list[tuple[list[int], int]]:
    """The contract, transcribed literally, one sequence at a time in Python floats: (path, next_token)."""
    out = []
    for b in range(tokens.shape[0]):
        n = int(num_nodes[b])
        par, tok = parents[b].tolist(), tokens[b].tolist()
        kids = {i: [c for c in range(1, n) if par[c] == i] for i in range(n)}
        cur, path = 0, [0]
        if temperature <= 0:
            while True:
                row = logits[b, cur].float().tolist()
                best = row.index(max(row))
                nxt = next((c for c in kids[cur] if tok[c] == best), None)
                if nxt is None:
                    out.append((path, best))
                    break
                cur = nxt
                path.append(cur)
            continue
        p = process_logits(logits[b, cur], temperature, top_k, top_p).tolist()
        descended = True
        while descended:
            descended = False
            for c in kids[cur]:
                x = tok[c]
                q = None if draft_probs is None else draft_probs[b, c].float().tolist()
                ratio = p[x] if q is None else (p[x] / q[x] if q[x] > 0 else math.inf)
                if float(coins[b, c]) <= ratio and p[x] > 0:
                    cur = c
                    path.append(c)
                    p = process_logits(logits[b, cur], temperature, top_k, top_p).tolist()
                    descended = True
                    break
                r = (
                    [v if t != x else 0.0 for t, v in enumerate(p)]
                    if q is None
                    else [max(a - bb, 0.0) for a, bb in zip(p, q)]
                )
                s = sum(r)
                if s > 0:
                    p = [v / s for v in r]
        total, acc, u = sum(p), 0.0, float(final_coins[b])
        nxt = max(t for t, v in enumerate(p) if v > 0)
        for t, v in enumerate(p):
            acc += v
            if acc > u * total:
                nxt = t
                break
        out.append((path, nxt))
    return out


# ---------------------------------------------------------------- losslessness harness (Markov toy target)


def markov_table(gen: torch.Generator, V: int, spread: float = 0.8) -> Tensor:
    """Toy target: logits of the next token given the last one, [V, V]."""
    return torch.randn(V, V, generator=gen) * spread


def draft_trees(
    gen: torch.Generator, table: Tensor, parents: list[int], roots: Tensor, stochastic: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Trees of a fixed shape rooted at `roots` [B]: tokens [B, N], target logits [B, N, V] (row i = table at
    token i) and draft_probs [B, N, V] or None. Deterministic drafts: tokens uniform (duplicates included).
    Node c's token ~ q_c, a fixed softmax table of (sibling rank, parent token), so drafts are informative and
    sibling duplicates occur; draft_probs carries q_c for stochastic drafts, None for deterministic ones (the
    verifier then treats each token as a point mass, which is lossless whatever drafted it)."""
    B, V, N = roots.shape[0], table.shape[0], len(parents)
    tokens = torch.zeros(B, N, dtype=torch.int64)
    tokens[:, 0] = roots
    qgen = torch.Generator().manual_seed(1234)  # the draft tables are fixed; samples use `gen`
    q_tab = torch.softmax(torch.randn(N, V, V, generator=qgen) * 1.5, -1)  # [rank, parent token, V]
    q_all = torch.zeros(B, N, V)
    for i in range(1, N):
        rank = sum(1 for j in range(1, i) if parents[j] == parents[i])
        q = q_tab[rank][tokens[:, parents[i]]]  # [B, V]
        q_all[:, i] = q
        tokens[:, i] = torch.multinomial(q, 1, generator=gen)[:, 0]
    return tokens, table[tokens], (q_all if stochastic else None)


def planted_verify(accept_rule: str, residual_rule: str) -> Callable:
    """A test-local verifier with switchable rules, to show the chi-square test has power. accept_rule:
    "p/q" (correct) or "p"; residual_rule: "max(p-q,0)" (correct) or "p" (no residual). q = onehot for
    deterministic drafts. Same scan as the reference otherwise."""

    def verify_fn(
        tokens, parents, logits, *, draft_probs=None, generator=None, temperature=1.0, top_k=0, top_p=1.0,
        coins=None, final_coins=None,
    ):  # fmt: skip
        B, N, V = logits.shape
        coins = torch.rand(B, N, generator=generator) if coins is None else coins
        final = torch.rand(B, generator=generator) if final_coins is None else final_coins
        probs = process_logits(logits, temperature, top_k, top_p)  # [B, N, V]
        q_all = torch.nn.functional.one_hot(tokens, V).float() if draft_probs is None else draft_probs
        cur, r = torch.zeros(B, dtype=torch.int64), probs[:, 0].clone()
        accepted = torch.zeros(B, N, dtype=torch.bool)
        accepted[:, 0] = True
        for i in range(1, N):
            tried = parents[:, i] == cur
            x, q = tokens[:, i : i + 1], q_all[:, i]
            rx, qx = r.gather(1, x)[:, 0], q.gather(1, x)[:, 0]
            acc = tried & (coins[:, i] <= (rx / qx if accept_rule == "p/q" else rx)) & (rx > 0)
            nr = (r - q).clamp(min=0) if residual_rule == "max(p-q,0)" else r
            s = nr.sum(-1, keepdim=True)
            r = torch.where((tried & ~acc)[:, None] & (s > 0), nr / s, r)
            cur = torch.where(acc, i, cur)
            r = torch.where(acc[:, None], probs[:, i], r)
            accepted[:, i] = acc
        return verdict_from_accepted(accepted, inverse_cdf(r, final), torch.zeros(B, N))

    return verify_fn


def first_two_tokens(
    verify_fn: Callable,
    gen: torch.Generator,
    table: Tensor,
    parents: list[int],
    B: int,
    stochastic: bool,
    **kw,
) -> tuple[Tensor, Tensor]:
    """Decode two tokens after root token 0 with speculative steps; returns (t1 [B], t2 [B])."""
    par = torch.tensor(parents)[None].expand(B, -1)

    def step(roots: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        tokens, logits, q = draft_trees(gen, table, parents, roots, stochastic)
        v = verify_fn(tokens, par[: roots.shape[0]], logits, draft_probs=q, generator=gen, **kw)
        toks = tokens.gather(1, v.path.clamp(min=0))  # [b, S]
        return v.accept_len, toks, v.next_token

    acc, toks, nxt = step(torch.zeros(B, dtype=torch.int64))
    t1 = torch.where(acc >= 1, toks[:, min(1, toks.shape[1] - 1)], nxt)
    t2 = torch.where(acc >= 2, toks[:, min(2, toks.shape[1] - 1)], nxt)
    again = acc == 0  # only one token emitted: a second step from t1
    if bool(again.any()):
        acc2, toks2, nxt2 = step(t1[again])
        t2[again] = torch.where(acc2 >= 1, toks2[:, min(1, toks2.shape[1] - 1)], nxt2)
    return t1, t2


def chi_square(counts: Tensor, probs: Tensor) -> tuple[float, float]:
    """(statistic, critical value at alpha = 1e-4) of observed counts against probabilities (same shape).
    Cells with zero probability must be empty (else the statistic is inf). Critical value by Wilson-Hilferty."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    n = counts.sum()
    live = probs > 0
    if bool((counts[~live] > 0).any()):
        return math.inf, 0.0
    e = probs[live] * n
    stat = float(((counts[live] - e) ** 2 / e).sum())
    k = int(live.sum()) - 1
    z = statistics.NormalDist().inv_cdf(1 - 1e-4)
    crit = k * (1 - 2 / (9 * k) + z * math.sqrt(2 / (9 * k))) ** 3
    return stat, crit
