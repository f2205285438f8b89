"""Torch reference for tree index tables (tree attention masks, depths, child/sibling links, leaf paths) and
for KV-cache compaction after verification.

Tree attention as in SpecInfer (Miao et al. 2023, arXiv 2305.09781, Sec. 4.2 "tree-based parallel decoding"):
node i attends to the committed prefix and to its ancestors including itself, at position past + depth(i).
"""

from __future__ import annotations

from numbers import Integral

import torch
from torch import Tensor

from kernels.common import TreeBuffers, check_tensor, valid_mask


def tree_buffers_reference(parents: Tensor, num_nodes: Tensor | None = None) -> TreeBuffers:
    """Index tables of padded trees. parents: int64 [B, N] (parents[:, 0] = -1, parents[i] < i);
    num_nodes: int64 [B] or None. Vectorized over B with O(log N) pointer-jumping rounds."""
    B, N = parents.shape
    device = parents.device
    ar = torch.arange(N, device=device)
    valid = valid_mask(num_nodes, B, N, device)  # [B, N]
    real = valid & (parents >= 0) & (ar[None, :] > 0)  # nodes with a parent
    par = torch.where(real, parents, ar[None, :])  # root and padding point at themselves

    # Pointer jumping: after k rounds ptr is the 2^k-th ancestor (or the root), depth the distance walked,
    # and anc holds every ancestor within distance 2^k.
    depth = real.to(torch.int64)
    anc = torch.eye(N, dtype=torch.bool, device=device).expand(B, N, N).clone()  # anc: [B, N, N]
    anc.scatter_(2, par[:, :, None], True)
    ptr = par
    for _ in range(max(1, (N - 1).bit_length())):
        depth = depth + depth.gather(1, ptr)
        anc = anc | anc.gather(1, ptr[:, :, None].expand(B, N, N))
        ptr = ptr.gather(1, ptr)

    # child[b, i, j]: j is a child of i
    child = (par[:, None, :] == ar[None, :, None]) & real[:, None, :]
    first_child = _min_index(child, N)
    # sib[b, i, j]: j > i shares i's parent
    sib = (par[:, :, None] == par[:, None, :]) & real[:, :, None] & real[:, None, :]
    sib = sib & (ar[None, :] > ar[:, None])[None]
    next_sibling = _min_index(sib, N)

    is_leaf = valid & (first_child < 0)  # [B, N]
    num_leaves = is_leaf.sum(-1)
    L = int(num_leaves.max()) if B > 0 else 0
    dmax = int(torch.where(valid, depth, 0).max()) if B > 0 else 0
    leaves = torch.where(is_leaf, ar[None, :], N).sort(-1).values[:, :L]  # [B, L], N = none
    rows = anc.gather(1, leaves.clamp(max=N - 1)[:, :, None].expand(B, L, N)) & (leaves < N)[:, :, None]
    col = torch.where(rows, depth[:, None, :], dmax + 1)  # [B, L, N]: column of node j in leaf l's path
    paths = torch.full((B, L, dmax + 2), -1, dtype=torch.int64, device=device)
    paths.scatter_(2, col, ar.expand(B, L, N).contiguous())
    # the dump column dmax + 1 received non-ancestors; drop it
    return TreeBuffers(
        depth=torch.where(valid, depth, 0),
        ancestor_mask=anc,
        first_child=first_child,
        next_sibling=next_sibling,
        paths=paths[:, :, : dmax + 1].contiguous(),
        num_leaves=num_leaves,
    )


def _min_index(mask: Tensor, N: int) -> Tensor:
    """Smallest j with mask[b, i, j], -1 if none. mask: [B, N, N] -> int64 [B, N]."""
    ar = torch.arange(N, device=mask.device)
    m = torch.where(mask, ar, N).amin(-1)
    return torch.where(m == N, -1, m)


def compact_kv_reference(kv: Tensor, start: int, path: Tensor) -> int:
    """Move the accepted nodes' cache entries to the front of the tree region, in place.

    kv: [B, H, L, D] (one layer's keys or values); the tree occupies positions start, start + 1, ...;
    path: int64 [S], node indices relative to `start`, increasing (path[0] == 0 usually).
    kv[:, :, start + k] = kv[:, :, start + path[k]] for every k; returns start + S (the caller crops there).
    """
    S = path.numel()
    if S == 0:
        return start
    path = path.to(device=kv.device, dtype=torch.int64)
    if path.device.type == "cpu" and torch.equal(path, torch.arange(S)):
        return start + S
    kv[:, :, start : start + S] = kv.index_select(2, path + start)  # index_select copies before writing
    return start + S


def check_compact_args(kv: Tensor, start: int, path: Tensor) -> None:
    """Raise TypeError / ValueError unless ``compact_kv_`` can move ``path`` in ``kv``: kv [B, H, L, D]; start an
    integer in [0, L]; path a 1-D integer tensor of S <= L - start node indices relative to ``start``. Where path
    lies on the CPU also its values: non-negative, strictly increasing (what makes the in-place copy race free),
    start + path[-1] < L. On a GPU only its shape (reading the values back would synchronize the step)."""
    if not isinstance(kv, Tensor):  # any dtype: the move is a bit copy
        raise TypeError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
    if kv.dim() != 4:
        raise ValueError(f"kv {tuple(kv.shape)} must be [B, H, L, D]")
    L = kv.shape[2]
    if not isinstance(start, Integral) or isinstance(start, bool):
        raise TypeError(f"start must be an integer, got {start!r} ({type(start).__name__})"[:200])
    if not 0 <= start <= L:
        raise ValueError(f"start {start} is not a position of the cache (0..{L})")
    check_tensor("path", path, "integer")
    if path.dim() != 1 or path.numel() > L - start:
        raise ValueError(f"path {tuple(path.shape)} must be [S] with S <= L - start = {L - start}")
    if path.device.type != "cpu" or path.numel() == 0:
        return
    steps = path[1:] - path[:-1]
    if int(path[0]) < 0 or bool((steps <= 0).any()):
        raise ValueError(f"path {path.tolist()[:32]} must be non-negative and strictly increasing")
    if start + int(path[-1]) >= L:
        raise ValueError(
            f"path's last node {int(path[-1])} lies past the cache: start {start} + it >= L = {L}"
        )


def check_mask(mask: Tensor) -> None:
    """TypeError unless the attention mask is boolean: SDPA reads a float mask as an additive bias (0 and 1 would
    mask nothing)."""
    check_tensor("mask", mask, "bool")


def tree_attention_reference(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Attention of Q nodes per row over S keys under a mask: q [B, H, Q, D], k and v [B, Hkv, S, D] (query head h
    reads KV head h // (H / Hkv), as transformers' grouped-query attention), mask bool [B, 1, Q, S] (True: the node
    sees the key); returns [B, Q, H, D] (the layout the output projection reads)."""
    import torch.nn.functional as F

    check_mask(mask)

    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )  # fmt: skip
    return out.transpose(1, 2)
