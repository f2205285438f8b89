"""Triton prompt lookup: one program per row scans its tokens block by block for the most recent earlier match of
its last 1..NGRAM tokens (the longest n that occurs wins) and gathers the ``depth`` tokens after it. One launch in
place of the ~10 tensor operations per n-gram length of ``kernels.lookup.prompt_lookup_reference`` (on an H200 the
reference took 0.12 ms of a 2.5 ms device-loop step). Same results as the reference."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _lookup_kernel(
    hist_ptr, cur_ptr, out_ptr, L, stride_h, depth,
    NGRAM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    row = hist_ptr + b.to(tl.int64) * stride_h
    cur = tl.load(cur_ptr + b)
    offs = tl.arange(0, BLOCK)
    # the row's last NGRAM tokens (c0 = the root); positions before 0 are never compared (see `valid`)
    c0 = tl.load(row + tl.maximum(cur - 1, 0))
    c1 = tl.load(row + tl.maximum(cur - 2, 0))
    c2 = tl.load(row + tl.maximum(cur - 3, 0))
    c3 = tl.load(row + tl.maximum(cur - 4, 0))
    b1 = tl.full((), -1, tl.int64)
    b2 = tl.full((), -1, tl.int64)
    b3 = tl.full((), -1, tl.int64)
    b4 = tl.full((), -1, tl.int64)
    for j0 in range(0, L, BLOCK):
        j = (j0 + offs).to(tl.int64)
        inside = j <= cur - 2  # a match ends before the root
        h0 = tl.load(row + j, mask=inside & (j < L), other=-1)
        h1 = tl.load(row + j - 1, mask=inside & (j >= 1), other=-1)
        h2 = tl.load(row + j - 2, mask=inside & (j >= 2), other=-1)
        h3 = tl.load(row + j - 3, mask=inside & (j >= 3), other=-1)
        m1 = inside & (h0 == c0)
        b1 = tl.maximum(b1, tl.max(tl.where(m1, j, -1), axis=0))
        if NGRAM >= 2:
            m2 = m1 & (j >= 1) & (h1 == c1)
            b2 = tl.maximum(b2, tl.max(tl.where(m2, j, -1), axis=0))
            if NGRAM >= 3:
                m3 = m2 & (j >= 2) & (h2 == c2)
                b3 = tl.maximum(b3, tl.max(tl.where(m3, j, -1), axis=0))
                if NGRAM >= 4:
                    m4 = m3 & (j >= 3) & (h3 == c3)
                    b4 = tl.maximum(b4, tl.max(tl.where(m4, j, -1), axis=0))
    best = b1
    best = tl.where(b2 >= 0, b2, best)
    best = tl.where(b3 >= 0, b3, best)
    best = tl.where(b4 >= 0, b4, best)
    k = tl.arange(0, BLOCK_D).to(tl.int64)
    take = tl.maximum(tl.minimum(best + 1 + k, cur - 1), 0)
    tok = tl.load(row + take, mask=k < depth, other=0)
    tok = tl.where(best >= 0, tok, c0)
    tl.store(out_ptr + b.to(tl.int64) * depth + k, tok, mask=k < depth)


def prompt_lookup_triton(hist: Tensor, cur_len: Tensor, depth: int, ngram: int) -> Tensor:
    """Triton twin of ``kernels.lookup.prompt_lookup_reference`` (ngram 1 to 4)."""
    if not 1 <= ngram <= 4:
        raise ValueError(f"ngram must be 1..4 for the Triton lookup, got {ngram}")
    B, L = hist.shape
    hist = hist if hist.stride(1) == 1 else hist.contiguous()
    out = torch.empty(B, depth, dtype=hist.dtype, device=hist.device)
    cur = cur_len.to(torch.int64).contiguous()
    _lookup_kernel[(B,)](
        hist, cur, out, L, hist.stride(0), depth,
        NGRAM=ngram, BLOCK=1024, BLOCK_D=max(16, triton.next_power_of_2(depth)),
    )  # fmt: skip
    return out
