"""Triton tree index tables: depth, ancestor mask, first child, next sibling, root-to-leaf paths.

Tree attention as in SpecInfer (Miao et al. 2023, arXiv 2305.09781, Sec. 4.2). One program per sequence; the
[N, N] ancestor matrix lives in registers and is built row by row (row i = row parent(i) | e_i, parents < i).
Same results as `kernels.reference_tree.tree_buffers_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.common import TreeBuffers


@triton.jit
def _tree_kernel(
    parents_ptr, num_nodes_ptr, depth_ptr, anc_ptr, fc_ptr, ns_ptr, paths_ptr, nleaves_ptr,
    N, BLOCK_N: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    n = tl.load(num_nodes_ptr + b).to(tl.int32)
    base = b.to(tl.int64) * N
    offs = tl.arange(0, BLOCK_N)
    rows = offs[:, None]  # node i
    cols = offs[None, :]  # node j
    valid = offs < n
    par = tl.load(parents_ptr + base + offs, mask=valid & (offs > 0), other=-1)
    real = valid & (offs > 0) & (par >= 0)  # nodes with a parent
    par = tl.where(real, par, offs)  # root and padding point at themselves

    anc = (rows == cols).to(tl.int32)  # anc: [BLOCK_N, BLOCK_N]
    depth = tl.zeros((BLOCK_N,), tl.int64)
    for i in range(1, n):
        p = tl.load(parents_ptr + base + i)
        prow = tl.sum(tl.where(rows == p, anc, 0), axis=0)  # row p of anc: [BLOCK_N]
        anc = tl.where(rows == i, (prow[None, :] > 0).to(tl.int32) | (cols == i).to(tl.int32), anc)
        dp = tl.sum(tl.where(offs == p, depth, 0), axis=0) + (p >= 0).to(tl.int64)
        depth = tl.where(offs == i, dp, depth)

    child = (par[None, :] == rows) & real[None, :]  # child[i, j]: j is a child of i
    fc = tl.min(tl.where(child, cols, BLOCK_N), axis=1)
    fc = tl.where(fc == BLOCK_N, -1, fc)
    sib = (par[None, :] == par[:, None]) & real[None, :] & real[:, None] & (cols > rows)
    ns = tl.min(tl.where(sib, cols, BLOCK_N), axis=1)
    ns = tl.where(ns == BLOCK_N, -1, ns)
    is_leaf = valid & (fc < 0)
    rank = tl.cumsum(is_leaf.to(tl.int32), axis=0) - 1  # leaf order = node order

    inb = offs < N
    tl.store(depth_ptr + base + offs, depth, mask=inb)
    tl.store(fc_ptr + base + offs, fc, mask=inb)
    tl.store(ns_ptr + base + offs, ns, mask=inb)
    tl.store(nleaves_ptr + b, tl.sum(is_leaf.to(tl.int64), axis=0))
    mat = b.to(tl.int64) * N * N
    inb2 = (rows < N) & (cols < N)
    tl.store(anc_ptr + mat + rows * N + cols, anc.to(tl.int8), mask=inb2)
    # paths_full[b, rank(leaf i), depth(j)] = j for every ancestor j of leaf i
    put = inb2 & is_leaf[:, None] & (anc > 0)
    tl.store(paths_ptr + mat + rank[:, None] * N + depth[None, :], cols.to(tl.int64) + rows * 0, mask=put)


def tree_buffers_triton(parents: Tensor, num_nodes: Tensor | None = None) -> TreeBuffers:
    """Triton twin of `kernels.reference_tree.tree_buffers_reference`."""
    B, N = parents.shape
    device = parents.device
    parents = parents.to(torch.int64).contiguous()
    if num_nodes is None:
        num_nodes = torch.full((B,), N, dtype=torch.int64, device=device)
    num_nodes = num_nodes.to(device=device, dtype=torch.int64).contiguous()
    depth = torch.empty(B, N, dtype=torch.int64, device=device)
    anc = torch.empty(B, N, N, dtype=torch.int8, device=device)
    fc = torch.empty(B, N, dtype=torch.int64, device=device)
    ns = torch.empty(B, N, dtype=torch.int64, device=device)
    paths = torch.full((B, N, N), -1, dtype=torch.int64, device=device)
    num_leaves = torch.empty(B, dtype=torch.int64, device=device)
    if B > 0:
        block_n = max(16, triton.next_power_of_2(N))
        _tree_kernel[(B,)](parents, num_nodes, depth, anc, fc, ns, paths, num_leaves, N, BLOCK_N=block_n)
    L = int(num_leaves.max()) if B > 0 else 0
    dmax = int(depth.max()) if B > 0 else 0
    return TreeBuffers(
        depth=depth,
        ancestor_mask=anc.bool(),
        first_child=fc,
        next_sibling=ns,
        paths=paths[:, :L, : dmax + 1].contiguous(),
        num_leaves=num_leaves,
    )
