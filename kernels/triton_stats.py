"""Row statistics of tree verification (the first of `kernels.triton_verify`'s two launches): per (sequence, node)
row of target logits, what the walk needs to know of its distribution without a [B, N, V] probability tensor.

- Sampling: `row_stats_kernel`, one program per row, fuses temperature, top-k and top-p into three numbers (max m,
  normaliser s, and a threshold on the order-preserving integer key of z = l * fp32(1/T)), so that
  p(t) = [key(z_t) >= thr] * exp(z_t - m) / s anywhere later; top-k / top-p thresholds are found by bisection over
  the 2^32 keys (exact, ties kept together as in the reference), each step a blocked pass over V.
- Greedy: `greedy_stats_kernel`, one program per (row, chunk of `kernels.common.GREEDY_CHUNK` tokens), keeps the
  argmax and the T = 1 softmax statistics of its chunk; the walk merges a row's chunks.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def order_key(z):
    """Order-preserving int32 key of fp32 values (a < b iff key(a) < key(b), -0.0 just below +0.0)."""
    bits = z.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _count_ge(row_ptr, V, inv_t, t, BLOCK_V: tl.constexpr):
    """Number of tokens with key(z) >= t."""
    offs = tl.arange(0, BLOCK_V)
    cnt = tl.zeros((), tl.int64)
    for v0 in range(0, V, BLOCK_V):
        mask = v0 + offs < V
        z = tl.load(row_ptr + v0 + offs, mask=mask, other=0.0).to(tl.float32) * inv_t
        cnt += tl.sum(((order_key(z) >= t) & mask).to(tl.int64), axis=0)
    return cnt


@triton.jit
def _mass_above(row_ptr, V, inv_t, m, s, thr_k, t, BLOCK_V: tl.constexpr):
    """Probability mass (after top-k) of tokens with key(z) > t."""
    offs = tl.arange(0, BLOCK_V)
    acc = tl.zeros((), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        mask = v0 + offs < V
        z = tl.load(row_ptr + v0 + offs, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
        k = order_key(z)
        p = tl.where(mask & (k >= thr_k) & (k > t), tl.exp(z - m), 0.0)
        acc += tl.sum(p, axis=0)
    return acc / s


@triton.jit
def row_stats_kernel(
    logits_ptr, num_nodes_ptr, m_ptr, s_ptr, thr_ptr, am_ptr,
    N, V, inv_t, top_k, top_p,
    USE_TOP_K: tl.constexpr, USE_TOP_P: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    b = row // N
    i = row % N
    n = tl.load(num_nodes_ptr + b)
    if i < n:
        row_ptr = logits_ptr + row.to(tl.int64) * V  # logits: [B, N, V]
        offs = tl.arange(0, BLOCK_V)
        # online max / argmax / sum of exp(z - m) over all tokens
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        best = tl.zeros((), tl.int64)
        kmin = tl.full((), 2147483647, tl.int64)
        for v0 in range(0, V, BLOCK_V):
            mask = v0 + offs < V
            z = tl.load(row_ptr + v0 + offs, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
            bm = tl.max(z, axis=0)
            bi = tl.argmax(z, axis=0).to(tl.int64) + v0
            best = tl.where(bm > m, bi, best)  # strict: the earliest block keeps ties
            m_new = tl.maximum(m, bm)
            alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp(m - m_new))  # a block of -inf adds nothing
            s = s * alpha + tl.sum(tl.where(mask & (z > float("-inf")), tl.exp(z - m_new), 0.0), axis=0)
            m = m_new
            kmin = tl.minimum(kmin, tl.min(tl.where(mask, order_key(z), 2147483647), axis=0).to(tl.int64))
        thr = kmin
        kmax = order_key(m).to(tl.int64)
        if USE_TOP_K:  # largest t with count(key >= t) >= k: the k-th largest key
            lo = kmin
            hi = kmax
            while lo < hi:
                mid = lo + (hi - lo + 1) // 2
                if _count_ge(row_ptr, V, inv_t, mid, BLOCK_V) >= top_k:
                    lo = mid
                else:
                    hi = mid - 1
            thr = lo
            s = tl.zeros((), tl.float32)
            for v0 in range(0, V, BLOCK_V):
                mask = v0 + offs < V
                z = tl.load(row_ptr + v0 + offs, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
                s += tl.sum(tl.where(mask & (order_key(z) >= thr), tl.exp(z - m), 0.0), axis=0)
        if USE_TOP_P:  # smallest t with mass(key > t) < top_p; keep key >= t
            lo = thr - 1
            hi = kmax
            while lo < hi:
                mid = lo + (hi - lo) // 2
                if _mass_above(row_ptr, V, inv_t, m, s, thr, mid, BLOCK_V) < top_p:
                    hi = mid
                else:
                    lo = mid + 1
            thr = tl.maximum(thr, lo)
            s = tl.zeros((), tl.float32)
            for v0 in range(0, V, BLOCK_V):
                mask = v0 + offs < V
                z = tl.load(row_ptr + v0 + offs, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
                s += tl.sum(tl.where(mask & (order_key(z) >= thr), tl.exp(z - m), 0.0), axis=0)
        tl.store(m_ptr + row, m)
        tl.store(s_ptr + row, s)
        tl.store(thr_ptr + row, thr)
        tl.store(am_ptr + row, best)


@triton.jit
def greedy_stats_kernel(
    logits_ptr, num_nodes_ptr, pm_ptr, ps_ptr, pa_ptr, N, V, SPLITS,
    CHUNK: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """Greedy statistics of one chunk of one row: max, sum of exp(l - max) and the earliest argmax of tokens
    [chunk * CHUNK, (chunk + 1) * CHUNK), into the row's partials (merged by the walk)."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    b = row // N
    i = row % N
    n = tl.load(num_nodes_ptr + b)
    if i < n:
        start = part * CHUNK
        row_ptr = logits_ptr + row.to(tl.int64) * V + start  # logits: [B, N, V]
        offs = tl.arange(0, BLOCK_V)
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        best = tl.zeros((), tl.int64)
        for v0 in tl.static_range(0, CHUNK, BLOCK_V):
            mask = start + v0 + offs < V
            z = tl.load(row_ptr + v0 + offs, mask=mask, other=float("-inf")).to(tl.float32)
            # the block's max and its earliest index in one reduction
            bm, bi = tl.max(z, axis=0, return_indices=True, return_indices_tie_break_left=True)
            bi = bi.to(tl.int64) + start + v0
            best = tl.where(bm > m, bi, best)  # strict: the earliest block keeps ties
            m_new = tl.maximum(m, bm)
            # a block of -inf (past V, or masked tokens) adds nothing: exp(-inf - -inf) would be NaN
            alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp(m - m_new))
            s = s * alpha + tl.sum(tl.where(mask & (z > float("-inf")), tl.exp(z - m_new), 0.0), axis=0)
            m = m_new
        out = row.to(tl.int64) * SPLITS + part
        tl.store(pm_ptr + out, m)
        tl.store(ps_ptr + out, s)
        tl.store(pa_ptr + out, best)
