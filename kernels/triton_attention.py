"""Fused Triton attention of a few new nodes per row over a KV cache under an explicit mask (a decoding step, a
draft chain or tree being verified), split over the keys: flash-decoding (Dao et al. 2023, "Flash-Decoding for
long-context inference"; the online softmax of FlashAttention, arXiv 2205.14135).

Why: with an explicit mask and grouped-query heads, ``scaled_dot_product_attention`` on an H200 picked a cuDNN
kernel of 64-query tiles for a 5-node chain that took 29 µs per layer (one CTA per head, serial over the keys;
5 µs for one node) and converted the boolean mask to an additive one at every layer: most of what a verify step
cost more than a decoding step (``python -m env.bench_device_step --profile``).

Two launches per call:
  1. ``_split_kernel``, one program per (row, KV head, chunk of keys; at most MAX_SPLITS chunks a row): the query
     heads that share the KV head and every node are one [G * Q, D] tile (GQA as in transformers: query head h
     reads KV head h // G), scores by ``tl.dot`` in fp32, the mask read as bytes, an online softmax over the chunk's
     key blocks; writes the chunk's max, normaliser and unnormalised output; a block of keys no node sees is skipped.
  2. ``_combine_kernel``, one program per (row, KV head) (or ``_combine_rows_kernel``, one per tile row: MERGE):
     merges the chunks (a chunk whose keys are all masked adds nothing) and writes [B, Q, H, D] in the output's
     dtype, the layout the output projection reads.
Same results as ``kernels.reference_tree.tree_attention_reference`` (SDPA) within float rounding (a node that sees
no key, which a step never has, gets zeros).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_S = 64  # keys per block within a program
# keys per program: the fewest (a power of two, at least a block) that keep a row's chunks within MAX_SPLITS. On an
# H200 a step's 21 programs of 256 keys each (3 KV heads, 1,792 keys) took 9.5 µs a layer and the serial merge
# of their 7 chunks 4.8 (`python -m env.bench_device_step --profile`): more, shorter programs, and a merge that
# loads every chunk at once
MAX_SPLITS = 32
# the merge: "kv", one program per (row, KV head) over every chunk (measured: ~10.5 µs a layer at 28 chunks on an
# H200, the attention's slowest launch), or "rows", one program per (row, KV head, tile row) — written after that
# measurement, not yet timed on a GPU (`python -m env.bench_device_step --attention-merge rows` compares them)
MERGE = "kv"
MERGES = ("kv", "rows")
MAX_ROWS = 128  # query heads per KV head x nodes that one tile holds


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, pm_ptr, pl_ptr, pacc_ptr,
    HKV, G, Q, S, scale, SPLITS,
    sqb, sqh, sqq, sqd, skb, skh, sks, skd, svb, svh, svs, svd, smb, smq, sms,
    CHUNK: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)  # b * HKV + kv head
    split = tl.program_id(1)
    b = pid // HKV
    kvh = pid % HKV
    rows = tl.arange(0, BLOCK_M)  # tile row r: query head kvh * G + r // Q, node r % Q
    qi = rows % Q
    h = kvh * G + rows // Q
    rmask = rows < G * Q
    offs_d = tl.arange(0, D)
    b64 = b.to(tl.int64)
    qt = tl.load(
        q_ptr + b64 * sqb + h[:, None].to(tl.int64) * sqh + qi[:, None] * sqq + offs_d[None, :] * sqd,
        mask=rmask[:, None], other=0.0,
    )  # fmt: skip
    kbase = k_ptr + b64 * skb + kvh.to(tl.int64) * skh
    vbase = v_ptr + b64 * svb + kvh.to(tl.int64) * svh
    mbase = mask_ptr + b64 * smb + qi[:, None].to(tl.int64) * smq
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_sum = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    for j in tl.static_range(0, CHUNK, BLOCK_S):
        offs_s = split * CHUNK + j + tl.arange(0, BLOCK_S)
        smask = offs_s < S
        vis = tl.load(
            mbase + offs_s[None, :].to(tl.int64) * sms, mask=rmask[:, None] & smask[None, :], other=0
        )
        # a block no node sees (the cache's unused tail) adds nothing: its keys and values are not read
        if tl.max(tl.max(vis, axis=1), axis=0) != 0:
            kt = tl.load(kbase + offs_s[None, :].to(tl.int64) * sks + offs_d[:, None] * skd, mask=smask[None, :],
                         other=0.0)  # fmt: skip
            if IEEE:
                sc = tl.dot(qt, kt, input_precision="ieee") * scale
            else:
                sc = tl.dot(qt, kt) * scale  # [BLOCK_M, BLOCK_S], fp32
            sc = tl.where(vis != 0, sc, float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, axis=1))
            # a row whose keys in this block are all masked adds nothing: exp(-inf - -inf) would be NaN
            alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp(m - m_new))
            p = tl.where(sc == float("-inf"), 0.0, tl.exp(sc - m_new[:, None]))
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            vt = tl.load(vbase + offs_s[:, None].to(tl.int64) * svs + offs_d[None, :] * svd, mask=smask[:, None],
                         other=0.0)  # fmt: skip
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
            m = m_new
    out = (pid.to(tl.int64) * SPLITS + split) * BLOCK_M + rows
    tl.store(pm_ptr + out, m)
    tl.store(pl_ptr + out, l_sum)
    tl.store(pacc_ptr + out[:, None] * D + offs_d[None, :], acc)


@triton.jit
def _combine_kernel(
    pm_ptr, pl_ptr, pacc_ptr, o_ptr, HKV, G, Q, SPLITS, sob, soq, soh, sod,
    BLOCK_M: tl.constexpr, D: tl.constexpr, SPLITS_P2: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    b = pid // HKV
    kvh = pid % HKV
    rows = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    base = pid.to(tl.int64) * SPLITS * BLOCK_M
    # every chunk's max and normaliser in one load ([SPLITS_P2, BLOCK_M]), then the outputs unrolled with masks (no
    # loop-carried load: the loads are independent, issued together)
    offs_p = tl.arange(0, SPLITS_P2)
    at2 = base + offs_p[:, None] * BLOCK_M + rows[None, :]
    pmask = (offs_p < SPLITS)[:, None]
    ms2 = tl.load(pm_ptr + at2, mask=pmask, other=float("-inf"))
    mx = tl.max(ms2, axis=0)
    w2 = tl.where(ms2 == float("-inf"), 0.0, tl.exp(ms2 - mx[None, :]))
    den = tl.sum(w2 * tl.load(pl_ptr + at2, mask=pmask, other=0.0), axis=0)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    for s in tl.static_range(0, SPLITS_P2):
        on = (rows * 0 + s) < SPLITS  # [BLOCK_M]: this chunk exists
        at = base + s * BLOCK_M + rows
        ms = tl.load(pm_ptr + at, mask=on, other=float("-inf"))
        w = tl.where(ms == float("-inf"), 0.0, tl.exp(ms - mx))
        acc += w[:, None] * tl.load(pacc_ptr + at[:, None] * D + offs_d[None, :], mask=on[:, None], other=0.0)
    res = acc / tl.where(den > 0, den, 1.0)[:, None]  # a node that sees no key (never in a step) gets zeros
    qi = rows % Q
    h = kvh * G + rows // Q
    rmask = rows < G * Q
    ptr = o_ptr + b.to(tl.int64) * sob + qi[:, None] * soq + h[:, None] * soh + offs_d[None, :] * sod
    tl.store(ptr, res.to(o_ptr.dtype.element_ty), mask=rmask[:, None])


@triton.jit
def _combine_rows_kernel(
    pm_ptr, pl_ptr, pacc_ptr, o_ptr, HKV, G, Q, SPLITS, sob, soq, soh, sod,
    BLOCK_M: tl.constexpr, D: tl.constexpr, SPLITS_P2: tl.constexpr,
):  # fmt: skip
    """The merge with one program per (row, KV head, tile row): a tile row's chunks as one [SPLITS_P2, D] load and
    one weighted sum (``MERGE = "rows"``)."""
    pid = tl.program_id(0)
    r = tl.program_id(1)  # tile row: query head kvh * G + r // Q, node r % Q
    b = pid // HKV
    kvh = pid % HKV
    offs_d = tl.arange(0, D)
    offs_p = tl.arange(0, SPLITS_P2)
    pmask = offs_p < SPLITS
    at = pid.to(tl.int64) * SPLITS * BLOCK_M + offs_p * BLOCK_M + r  # [SPLITS_P2]
    ms = tl.load(pm_ptr + at, mask=pmask, other=float("-inf"))
    mx = tl.max(ms, axis=0)
    w = tl.where(ms == float("-inf"), 0.0, tl.exp(ms - mx))  # a chunk whose keys are all masked adds nothing
    den = tl.sum(w * tl.load(pl_ptr + at, mask=pmask, other=0.0), axis=0)
    acc = tl.load(
        pacc_ptr + at[:, None] * D + offs_d[None, :], mask=pmask[:, None], other=0.0
    )  # [SPLITS_P2, D]
    res = tl.sum(w[:, None] * acc, axis=0) / tl.where(den > 0, den, 1.0)
    qi = r % Q
    h = kvh * G + r // Q
    ptr = o_ptr + b.to(tl.int64) * sob + qi * soq + h * soh + offs_d * sod
    tl.store(ptr, res.to(o_ptr.dtype.element_ty))


# The shapes verified on an H200 (tests/kernels/test_triton_attention.py): fp32 at head sizes 16 to 64 with up to
# 128 tile rows; bf16 at head size 64 with 16 to 64 rows (a 128-row tile of head size 32 did not return within the
# call's limit there, undiagnosed). Other shapes attend through SDPA until measured.
FP32_MAX_HEAD = 64
HALF_HEAD_SIZES = (64,)
HALF_MAX_ROWS = 64


def supported(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> bool:
    """Whether ``tree_attention_triton`` takes these tensors: q [B, H, Q, D], k and v [B, Hkv, S, D] of q's dtype,
    a boolean mask of exactly [B, 1, Q, S] (a broadcast one goes to SDPA), query heads a multiple of the KV heads,
    and a verified shape: fp32 at a power-of-two head size from 16 to FP32_MAX_HEAD with at most MAX_ROWS query heads
    per KV head x nodes; bf16 and fp16 on CUDA at HALF_HEAD_SIZES with at most HALF_MAX_ROWS."""
    if mask is None or mask.dtype != torch.bool or q.dim() != 4:
        return False
    B, H, Q, D = q.shape
    hkv, S = k.shape[1], k.shape[2]
    if tuple(mask.shape) != (B, 1, Q, S) or k.shape != v.shape or tuple(k.shape) != (B, hkv, S, D):
        return False
    if k.dtype != q.dtype or v.dtype != q.dtype or H % hkv or D < 16 or D & (D - 1):
        return False
    rows = (H // hkv) * Q
    if q.dtype == torch.float32:
        return D <= FP32_MAX_HEAD and rows <= MAX_ROWS
    return q.is_cuda and D in HALF_HEAD_SIZES and rows <= HALF_MAX_ROWS


def tree_attention_triton(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Triton twin of ``kernels.reference_tree.tree_attention_reference``: q [B, H, Q, D], k and v [B, Hkv, S, D] (any
    strides: a view of a cache), mask bool [B, 1, Q, S] (True: the node sees the key); returns [B, Q, H, D] in
    q's dtype."""
    B, H, Q, D = q.shape
    hkv, S = k.shape[1], k.shape[2]
    G = H // hkv
    block_m = max(16, triton.next_power_of_2(G * Q))
    chunk = max(BLOCK_S, triton.next_power_of_2(triton.cdiv(S, MAX_SPLITS)))
    splits = triton.cdiv(S, chunk)
    dev = q.device
    pm = torch.empty(B * hkv * splits * block_m, dtype=torch.float32, device=dev)
    pl = torch.empty_like(pm)
    pacc = torch.empty(B * hkv * splits * block_m, D, dtype=torch.float32, device=dev)
    out = torch.empty(B, Q, H, D, dtype=q.dtype, device=dev)
    mask8 = mask.view(torch.uint8)
    ieee = q.dtype == torch.float32  # fp32 stays fp32 (no TF32 products)
    _split_kernel[(B * hkv, splits)](
        q, k, v, mask8, pm, pl, pacc, hkv, G, Q, S, float(scale), splits,
        *q.stride(), *k.stride(), *v.stride(), mask8.stride(0), mask8.stride(2), mask8.stride(3),
        CHUNK=chunk, BLOCK_S=BLOCK_S, BLOCK_M=block_m, D=D, IEEE=ieee,
    )  # fmt: skip
    if MERGE not in MERGES:
        raise ValueError(f"kernels.triton_attention.MERGE must be one of {MERGES}, not {MERGE!r}")
    merge = _combine_rows_kernel[(B * hkv, G * Q)] if MERGE == "rows" else _combine_kernel[(B * hkv,)]
    merge(
        pm, pl, pacc, out, hkv, G, Q, splits, *out.stride(), BLOCK_M=block_m, D=D,
        SPLITS_P2=triton.next_power_of_2(splits),
    )  # fmt: skip
    return out
