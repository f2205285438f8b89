"""Fused Triton tree verification: greedy, sampling with deterministic drafts, sampling with draft_probs.

Lossless multi-draft rejection sampling over a token tree:
  SpecInfer (Miao et al. 2023, arXiv 2305.09781), Sec. 4 "multi-step speculative sampling";
  EAGLE (Li et al. 2024, arXiv 2401.15077), tree verification with draft distributions.
Same contract and results as `kernels.reference.verify_reference` (DESIGN.md "Verification semantics").

Two launches, no [B, N, V] probability tensor:
  1. Row statistics (`kernels.triton_stats`). Sampling: `row_stats_kernel`, one program per (sequence, node) row,
     fuses temperature, top-k and top-p into three numbers per row (max, normaliser and a threshold on the
     order-preserving key of the tempered logits). Greedy: `greedy_stats_kernel`, one program per (row, chunk of
     common.GREEDY_CHUNK tokens): a row of 49,152 tokens is 6 short programs, each one load, one max-and-index
     reduction and one sum (latency, not bytes, bounds a small verify).
  2. `_walk_kernel`, one program per sequence: greedy first merges the chunks' statistics of its rows, then finds
     the accepted path without a serial loop (node i is good iff its token is its parent's argmax and no earlier
     sibling's is; accepted iff every node from it to the root is good: pointer jumping over parents, log2 N
     steps); sampling scans nodes in index order (node i is tried iff its parent is the current node) on register
     vectors of parents, tokens, coins and node probabilities, tests each child, keeps the draft_probs residual
     max(r - q, 0) in a per-sequence [2, V] fp32 scratch (ping-pong), and draws the bonus token by a blocked
     inverse CDF with `final_coin`.
Symbols: p target (processed), q draft, x child token, r residual.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import common
from kernels.common import (
    Verdict,
    VerifyBuffers,
    draw_coins,
    valid_mask,
    verdict_from_accepted,
)
from kernels.triton_stats import greedy_stats_kernel, order_key, row_stats_kernel

_GREEDY, _DETERMINISTIC, _DRAFT_PROBS = 0, 1, 2
# the greedy walk without a serial loop up to this many nodes ([BLOCK_N, BLOCK_N] tiles); a serial scan above it
PARALLEL_WALK_MAX = 64
# warps of the parallel greedy walk's program ([BLOCK_N, BLOCK_N] tiles); `python -m kernels.bench --walk-warps`
# times the choices: on an H200 8 was the fastest or within 0.5 µs of it at B in {1, 8}, N in {8, 32, 64} (at B = 1,
# N = 64: 21.0 µs in a graph against 24.4 with 4 warps)
WALK_WARPS = 8
# the greedy statistics' program: tokens per load (a chunk of kernels.common.GREEDY_CHUNK in one block when equal:
# one max-and-index reduction and one sum, no serial loop) and its warps; `python -m kernels.bench --greedy-settings`
GREEDY_BLOCK = 8192
GREEDY_WARPS = 8


@triton.jit
def _p_block(row_ptr, offs, mask, inv_t, m, s, thr):
    """Processed target probabilities p(t) of one row at token ids `offs`."""
    z = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
    return tl.where(mask & (order_key(z) >= thr), tl.exp(z - m) / s, 0.0)


@triton.jit
def _walk_kernel(
    tokens_ptr, parents_ptr, num_nodes_ptr, logits_ptr, dp_ptr, coins_ptr, fcoins_ptr,
    m_ptr, s_ptr, thr_ptr, am_ptr, scratch_ptr, acc_ptr, nprob_ptr, next_ptr, path_ptr, alen_ptr,
    pm_ptr, ps_ptr, pa_ptr, N, V, inv_t, SPLITS,
    MODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, WRITE_PATH: tl.constexpr,
    SPLITS_P2: tl.constexpr, LOG_N: tl.constexpr, PARALLEL: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    n = tl.load(num_nodes_ptr + b).to(tl.int32)
    base = b.to(tl.int64) * N  # row index of (b, 0)
    offs_n = tl.arange(0, BLOCK_N)
    nmask = offs_n < n
    tok = tl.load(tokens_ptr + base + offs_n, mask=nmask, other=0)  # [BLOCK_N]
    par = tl.load(parents_ptr + base + offs_n, mask=nmask & (offs_n > 0), other=0)
    p32 = par.to(tl.int32)
    # the parent row's logit of each node's token: independent of the statistics, so issued first
    prow = base + par
    lx = tl.load(logits_ptr + prow * V + tok, mask=nmask, other=0.0).to(tl.float32)
    if MODE == 0:  # merge the chunks' greedy statistics of this sequence's rows into m, s, am
        offs_s = tl.arange(0, SPLITS_P2)
        smask = nmask[:, None] & (offs_s[None, :] < SPLITS)
        idx = (base + offs_n)[:, None] * SPLITS + offs_s[None, :]  # [BLOCK_N, SPLITS_P2]
        qm = tl.load(pm_ptr + idx, mask=smask, other=float("-inf"))
        rm = tl.max(qm, axis=1)
        qs = tl.load(ps_ptr + idx, mask=smask, other=0.0)
        rs = tl.sum(tl.where(smask & (qm > float("-inf")), qs * tl.exp(qm - rm[:, None]), 0.0), axis=1)
        qa = tl.load(pa_ptr + idx, mask=smask, other=0)
        # the earliest chunk holding the max
        ra = tl.min(tl.where(smask & (qm == rm[:, None]), qa, V), axis=1)
        tl.store(m_ptr + base + offs_n, rm, mask=nmask)
        tl.store(s_ptr + base + offs_n, rs, mask=nmask)
        tl.store(am_ptr + base + offs_n, ra, mask=nmask)
        if PARALLEL:
            # each node's parent row's statistics straight from the registers (one selected value and zeros in
            # each sum: exact), not through memory and a barrier
            selp = p32[:, None] == offs_n[None, :]  # [i, j]: j is i's parent
            pm = tl.sum(tl.where(selp, rm[None, :], 0.0), axis=1)
            ps = tl.sum(tl.where(selp, rs[None, :], 0.0), axis=1)
            amp = tl.sum(tl.where(selp, ra.to(tl.int32)[None, :], 0), axis=1)
        else:
            tl.debug_barrier()  # the rows' statistics are read back below by parent index
            pm = tl.load(m_ptr + prow, mask=nmask, other=0.0)
            ps = tl.load(s_ptr + prow, mask=nmask, other=1.0)
            amp = tl.load(am_ptr + prow, mask=nmask, other=-1)  # argmax of each node's parent row
    else:
        pm = tl.load(m_ptr + prow, mask=nmask, other=0.0)
        ps = tl.load(s_ptr + prow, mask=nmask, other=1.0)
    # node_prob[i] = p_{parent(i)}(token_i)
    if MODE == 0:
        prob = tl.exp(lx - pm) / ps
    else:
        z = lx * inv_t
        pthr = tl.load(thr_ptr + prow, mask=nmask, other=0)
        prob = tl.where(order_key(z) >= pthr, tl.exp(z - pm) / ps, 0.0)
    prob = tl.where(offs_n == 0, 1.0, prob)
    tl.store(nprob_ptr + base + offs_n, tl.where(nmask, prob, 0.0), mask=offs_n < N)

    # The walk: scalars come out of the register vectors above (no dependent global loads in the loop).
    offs_v = tl.arange(0, BLOCK_V)
    cur = tl.zeros((), tl.int64)
    accv = (offs_n == 0).to(tl.int8)  # accepted flags
    if MODE == 0:
        if PARALLEL:
            # good: the token is its parent's argmax and no earlier sibling's is (the walk takes the first);
            # accepted: every node from it to the root is good (pointer jumping: after k steps, g covers a node
            # and its 2^k - 1 nearest ancestors; the root is its own parent and good)
            hit = nmask & (offs_n > 0) & (tok == amp)
            # [i, j]: j is an earlier sibling of i
            sib = (offs_n[None, :] < offs_n[:, None]) & (p32[None, :] == p32[:, None])
            earlier = tl.sum((sib & hit[None, :]).to(tl.int32), axis=1)
            g = ((hit & (earlier == 0)) | (offs_n == 0)).to(tl.int32)
            anc = p32
            for _ in tl.static_range(LOG_N):
                # the ancestor's flag and its ancestor in one word: one [N, N] reduction per step, not two
                sel = anc[:, None] == offs_n[None, :]  # [i, j]: j is anc(i)
                w = tl.sum(tl.where(sel, (anc * 2 + g)[None, :], 0), axis=1)
                g = g & (w & 1)
                anc = w >> 1
            on = (g > 0) & nmask
            accv = (on | (offs_n == 0)).to(tl.int8)
            cur = tl.max(tl.where(on, offs_n, 0), axis=0).to(tl.int64)  # the path's deepest node
            tl.store(next_ptr + b, _pick(ra, offs_n, cur))
        else:
            code = par * 2 + (tok == amp).to(tl.int64)  # parent and "token is the parent's argmax", one word
            for i in range(1, n):
                c = _pick(code, offs_n, i)
                ok = ((c >> 1) == cur) & ((c & 1) == 1)
                accv = tl.where((offs_n == i) & ok, 1, accv)
                cur = tl.where(ok, i, cur)
            tl.store(next_ptr + b, tl.load(am_ptr + base + cur))
    else:
        coins = tl.load(coins_ptr + base + offs_n, mask=nmask, other=1.0)
        if MODE == 2:  # q_i(token_i) for every node
            qx_all = tl.load(dp_ptr + (base + offs_n) * V + tok, mask=nmask, other=1.0).to(tl.float32)
        removed = tl.zeros((), tl.float32)  # deterministic drafts: mass of the rejected tokens at cur
        fresh = tl.full((), 1, tl.int1)  # draft_probs: residual is still p_cur (not in scratch)
        S = tl.full((), 1.0, tl.float32)  # draft_probs: normaliser of the residual held in scratch
        buf = tl.zeros((), tl.int64)
        rejected = tl.full((), -1, tl.int64)  # the last child rejected at cur (-1: none yet)
        scr = scratch_ptr + b.to(tl.int64) * 2 * V  # scratch: [B, 2, V]
        for i in range(1, n):
            tried = _pick(par, offs_n, i) == cur
            x = _pick(tok, offs_n, i)
            coin = _pick(coins, offs_n, i)
            px = _pick(prob, offs_n, i)  # p_cur(x) when tried
            if MODE == 1:  # q = onehot(x): p[x] = 0 and renormalise on reject
                dup = (
                    tl.sum(((offs_n < i) & (offs_n > 0) & (par == cur) & (tok == x)).to(tl.int32), axis=0) > 0
                )
                # the last child left at cur holds all the mass that remains: accepted for sure (the reference
                # renormalises to exactly 1; the running sum of the removed mass can leave it a few roundings under)
                rest = 1.0 - removed
                rx = tl.where(dup, 0.0, tl.where(px >= rest * (1.0 - 4e-6), 1.0, px / rest))
                acc = tried & (coin <= rx) & (rx > 0)
                removed = tl.where(tried & ~acc & ~dup, removed + px, removed)
            else:  # accept iff coin <= r[x] / q[x]; on reject r = normalize(max(r - q, 0))
                rx = tl.where(fresh, px, tl.load(scr + buf * V + x) / S)
                acc = tried & (coin <= rx / _pick(qx_all, offs_n, i)) & (rx > 0)
                if tried & ~acc:
                    row = logits_ptr + (base + cur) * V
                    cm = tl.load(m_ptr + base + cur)
                    cs = tl.load(s_ptr + base + cur)
                    cthr = tl.load(thr_ptr + base + cur)
                    q_row = dp_ptr + (base + i) * V
                    total = tl.zeros((), tl.float32)
                    for v0 in range(0, V, BLOCK_V):
                        vm = v0 + offs_v < V
                        r_old = tl.load(scr + buf * V + v0 + offs_v, mask=vm, other=0.0) / S
                        r_old = tl.where(fresh, _p_block(row, v0 + offs_v, vm, inv_t, cm, cs, cthr), r_old)
                        q = tl.load(q_row + v0 + offs_v, mask=vm, other=0.0).to(tl.float32)
                        nr = tl.where(vm, tl.maximum(r_old - q, 0.0), 0.0)
                        tl.store(scr + (1 - buf) * V + v0 + offs_v, nr, mask=vm)
                        total += tl.sum(nr, axis=0)
                    tl.debug_barrier()
                    if total > 0:  # an all-zero residual (rounding) keeps the old one
                        buf = 1 - buf
                        S = total
                        fresh = tl.zeros((), tl.int1)
            accv = tl.where((offs_n == i) & acc, 1, accv)
            rejected = tl.where(acc, -1, tl.where(tried & ~acc, x.to(tl.int64), rejected))
            cur = tl.where(acc, i, cur)
            removed = tl.where(acc, 0.0, removed)
            fresh = fresh | acc
        m = tl.load(m_ptr + base + cur)
        s = tl.load(s_ptr + base + cur)
        thr = tl.load(thr_ptr + base + cur)
        # final draw from the residual at cur: next = min{t : cumsum_t > u * total}
        cur_row = logits_ptr + (base + cur) * V
        ctok = tl.where(nmask & (offs_n > 0) & (par == cur), tok, -1)  # rejected children of cur
        total = tl.zeros((), tl.float32)
        last_pos = tl.full((), -1, tl.int64)
        for v0 in range(0, V, BLOCK_V):
            r = _residual_block(
                cur_row, scr + buf * V, v0 + offs_v, V, inv_t, m, s, thr, S, fresh, ctok, MODE
            )
            total += tl.sum(r, axis=0)
            last_pos = tl.maximum(last_pos, tl.max(tl.where(r > 0, v0 + offs_v, -1), axis=0).to(tl.int64))
        target = tl.load(fcoins_ptr + b) * total
        count = tl.zeros((), tl.int64)
        carry = tl.zeros((), tl.float32)
        for v0 in range(0, V, BLOCK_V):
            vm = v0 + offs_v < V
            r = _residual_block(
                cur_row, scr + buf * V, v0 + offs_v, V, inv_t, m, s, thr, S, fresh, ctok, MODE
            )
            cs = tl.cumsum(r, axis=0) + carry
            count += tl.sum(((cs <= target) & vm).to(tl.int64), axis=0)
            carry = tl.max(tl.where(vm, cs, carry), axis=0)
        drawn = tl.where(count >= V, last_pos, count)
        # a residual that rounding left empty (the rejected children held all of p): the last one rejected, the
        # token that exact arithmetic would have accepted — never -1
        tl.store(next_ptr + b, tl.where((total > 0) | (rejected < 0), drawn, rejected))
    tl.store(acc_ptr + base + offs_n, accv, mask=offs_n < N)
    if WRITE_PATH:  # path[k] = the k-th accepted node (they lie on one chain, in increasing index); -1 after
        acc32 = accv.to(tl.int32)
        rank = tl.cumsum(acc32, axis=0) - 1  # [BLOCK_N]: position on the path of each accepted node
        total = tl.sum(acc32, axis=0)
        # scattered by rank (no [N, N] tile): the accepted nodes fill [0, total), -1 the rest
        tl.store(path_ptr + base + rank, offs_n.to(tl.int64), mask=acc32 == 1)
        tl.store(
            path_ptr + base + offs_n, tl.full((BLOCK_N,), -1, tl.int64), mask=(offs_n >= total) & (offs_n < N)
        )
        tl.store(alen_ptr + b, (total - 1).to(tl.int64))


@triton.jit
def _pick(vec, offs, i):
    """vec[i] of a register vector, as a scalar."""
    return tl.sum(tl.where(offs == i, vec, 0), axis=0)


@triton.jit
def _residual_block(cur_row, scr_row, offs, V, inv_t, m, s, thr, S, fresh, ctok, MODE: tl.constexpr):
    """Residual r(t) at the current node for token ids `offs` (all children of the node were rejected)."""
    vm = offs < V
    p = _p_block(cur_row, offs, vm, inv_t, m, s, thr)
    if MODE == 1:
        excl = tl.sum((offs[:, None] == ctok[None, :]).to(tl.int32), axis=1) > 0  # [BLOCK_V]
        r = tl.where(excl, 0.0, p)
    else:
        r = tl.where(fresh, p, tl.load(scr_row + offs, mask=vm, other=0.0) / S)
    return r


def verify_triton(
    tokens: Tensor,
    parents: Tensor,
    logits: Tensor,
    *,
    num_nodes: Tensor | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    draft_probs: Tensor | None = None,
    coins: Tensor | None = None,
    final_coins: Tensor | None = None,
    generator: torch.Generator | None = None,
    out: VerifyBuffers | None = None,
) -> Verdict:
    """Triton twin of `kernels.reference.verify_reference` (same signature, same results). With ``out`` (a
    `kernels.VerifyBuffers` of this shape) nothing is allocated and nothing read back: the kernels write the
    buffers, the path included ([B, N], -1 padded), and the Verdict returned holds them (sampling: coins drawn from a
    generator on the logits' device, or given)."""
    B, N, V = logits.shape
    device = logits.device
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if interpret and logits.dtype not in (torch.float32, torch.float16):
        logits = logits.float()  # the interpreter has no bf16
    logits = logits.contiguous()
    tokens = tokens.to(device=device, dtype=torch.int64).contiguous()
    parents = parents.to(device=device, dtype=torch.int64).contiguous()
    greedy = common.is_greedy(temperature)
    mode = _GREEDY if greedy else (_DETERMINISTIC if draft_probs is None else _DRAFT_PROBS)
    if out is not None:
        out.check(B, N, V, device, mode == _DRAFT_PROBS)
    if num_nodes is None:
        num_nodes = (
            out.all_nodes if out is not None else torch.full((B,), N, dtype=torch.int64, device=device)
        )
    num_nodes = num_nodes.to(device=device, dtype=torch.int64).contiguous()
    if greedy:
        if out is not None:
            coins, final_coins = out.coins, out.final_coins  # unread
        else:
            coins = torch.zeros(B, N, device=device)
            final_coins = torch.zeros(B, device=device)
    else:
        if out is not None and coins is None and _same_device(generator, device):
            torch.rand(B, N, generator=generator, out=out.coins)  # draw_coins' order: coins first
            coins = out.coins
        if out is not None and final_coins is None and _same_device(generator, device):
            torch.rand(B, generator=generator, out=out.final_coins)
            final_coins = out.final_coins
        coins, final_coins = draw_coins(B, N, device, coins, final_coins, generator)
        coins, final_coins = coins.contiguous(), final_coins.contiguous()
    if mode == _DRAFT_PROBS:
        dp = draft_probs.to(device).contiguous()
        if interpret and dp.dtype != torch.float32:
            dp = dp.float()
        scratch = out.scratch if out is not None else torch.empty(B, 2, V, dtype=torch.float32, device=device)
    else:
        dp = logits  # unused
        scratch = out.scratch if out is not None else torch.empty(1, dtype=torch.float32, device=device)
    inv_t = 1.0 if greedy else 1.0 / temperature
    use_top_k = (not greedy) and 0 < top_k < V
    use_top_p = (not greedy) and top_p < 1.0

    if out is not None:
        m, s, thr, am = out.m, out.s, out.thr, out.am
    else:
        m = torch.zeros(B, N, dtype=torch.float32, device=device)
        s = torch.ones(B, N, dtype=torch.float32, device=device)
        thr = torch.zeros(B, N, dtype=torch.int64, device=device)
        am = torch.zeros(B, N, dtype=torch.int64, device=device)
    splits = common.greedy_splits(V) if greedy else 1
    if not greedy:
        pm = ps = pa = m  # unused
        row_stats_kernel[(B * N,)](
            logits, num_nodes, m, s, thr, am, N, V, inv_t, int(top_k), float(top_p),
            USE_TOP_K=use_top_k, USE_TOP_P=use_top_p, BLOCK_V=1024,
        )  # fmt: skip
    else:
        if out is not None:
            pm, ps, pa = out.part_m, out.part_s, out.part_am
        else:
            pm = torch.empty(B * N * splits, dtype=torch.float32, device=device)
            ps = torch.empty(B * N * splits, dtype=torch.float32, device=device)
            pa = torch.empty(B * N * splits, dtype=torch.int64, device=device)
        greedy_stats_kernel[(B * N, splits)](
            logits, num_nodes, pm, ps, pa, N, V, splits, CHUNK=common.GREEDY_CHUNK,
            BLOCK_V=min(GREEDY_BLOCK, common.GREEDY_CHUNK), num_warps=GREEDY_WARPS,
        )  # fmt: skip

    block_n = max(16, triton.next_power_of_2(N))
    parallel = greedy and block_n <= PARALLEL_WALK_MAX
    block_v = max(64, min(1024, 16384 // block_n))
    if out is not None:
        accepted, node_prob, next_token = out.accepted8, out.node_prob, out.next_token
        path, alen = out.path, out.accept_len
    else:
        accepted = torch.zeros(B, N, dtype=torch.int8, device=device)
        node_prob = torch.empty(B, N, dtype=torch.float32, device=device)
        next_token = torch.empty(B, dtype=torch.int64, device=device)
        path = alen = next_token  # unwritten
    _walk_kernel[(B,)](
        tokens, parents, num_nodes, logits, dp, coins, final_coins,
        m, s, thr, am, scratch, accepted, node_prob, next_token, path, alen, pm, ps, pa, N, V, inv_t, splits,
        MODE=mode, BLOCK_N=block_n, BLOCK_V=block_v, WRITE_PATH=out is not None,
        SPLITS_P2=triton.next_power_of_2(splits), LOG_N=block_n.bit_length() - 1, PARALLEL=parallel,
        # the serial greedy walk: its reductions in one warp
        num_warps=(WALK_WARPS if parallel else 1) if greedy else 4,
    )  # fmt: skip
    if out is not None:
        return out.verdict()
    valid = valid_mask(num_nodes, B, N, device)
    return verdict_from_accepted(accepted.bool() & valid, next_token, node_prob)


def _same_device(generator: torch.Generator | None, device: torch.device) -> bool:
    """Whether coins can be drawn straight into buffers on ``device`` (a generator elsewhere, e.g. on the CPU,
    draws there and copies: an allocation and a transfer per call, which a captured step cannot have)."""
    if generator is None:
        return True
    gen = generator.device
    return gen.type == device.type and (gen.index or 0) == (device.index or 0)
