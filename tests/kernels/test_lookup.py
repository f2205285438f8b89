"""Prompt lookup on the device (kernels.prompt_lookup): the torch reference against a plain Python scan, and the
Triton kernel against the reference (on CUDA; on a CPU `test_under_interpreter` reruns this file with
TRITON_INTERPRET=1): rows of several lengths (a root with no earlier tokens too), n-grams of 1 to 4, chains of 1 to
16 drafts, continuations that run into the root, rows longer than one block of the kernel."""

import pytest
import torch
from kernel_cases import DEVICE, TRITON_MODE, rerun_here, rerun_under_interpreter

from kernels import prompt_lookup, prompt_lookup_reference, triton_enabled


def python_lookup(row: list[int], depth: int, ngram: int) -> list[int]:
    """The rule in plain Python: the most recent earlier match of the longest suffix (n = ngram .. 1) that occurs."""
    cur = len(row)
    for n in range(ngram, 0, -1):
        if cur < n + 1:
            continue
        tail = row[cur - n :]
        for j in range(cur - 2, n - 2, -1):  # a match ends at j < cur - 1
            if row[j - n + 1 : j + 1] == tail:
                return [row[min(j + 1 + k, cur - 1)] for k in range(depth)]
    return [row[-1]] * depth


def make_rows(seed: int, B: int, L: int, vocab: int):
    gen = torch.Generator().manual_seed(seed)
    hist = torch.randint(0, vocab, (B, L), generator=gen)
    cur = torch.randint(1, L + 1, (B,), generator=gen)
    cur[0] = 1  # only the root
    cur[1 : min(B - 1, 4)] = torch.tensor([2, 3, 4])[
        : min(B - 1, 4) - 1
    ]  # shorter than or as long as a 4-gram
    cur[-1] = L  # a full row
    return hist, cur


@pytest.mark.parametrize("seed,B,L,vocab", [(0, 5, 40, 3), (1, 4, 300, 6), (2, 3, 2500, 20)])
@pytest.mark.parametrize("depth,ngram", [(1, 1), (4, 3), (16, 2), (7, 4)])
def test_reference_is_the_rule(seed, B, L, vocab, depth, ngram) -> None:
    hist, cur = make_rows(seed, B, L, vocab)
    got = prompt_lookup_reference(hist, cur, depth, ngram)
    for b in range(B):
        assert got[b].tolist() == python_lookup(hist[b, : int(cur[b])].tolist(), depth, ngram), b


@pytest.mark.skipif(not TRITON_MODE, reason="needs CUDA or TRITON_INTERPRET=1 (see below)")
@pytest.mark.parametrize("seed,B,L,vocab", [(0, 5, 40, 3), (2, 3, 2500, 20)])
@pytest.mark.parametrize("depth,ngram", [(1, 1), (4, 3), (16, 2), (7, 4)])
def test_triton_matches_the_reference(seed, B, L, vocab, depth, ngram) -> None:
    hist, cur = make_rows(seed, B, L, vocab)
    hist, cur = hist.to(DEVICE), cur.to(DEVICE)
    assert triton_enabled(hist)
    assert torch.equal(
        prompt_lookup(hist, cur, depth, ngram), prompt_lookup_reference(hist, cur, depth, ngram)
    )


@rerun_here
def test_under_interpreter() -> None:
    out = rerun_under_interpreter(__file__, "-k", "triton_matches", timeout=600)
    assert "\n8 passed" in out, out[-2000:]
