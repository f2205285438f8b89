"""Triton KV-cache compaction after tree verification: move the accepted path's entries to the front of the
tree region, in place (SpecInfer, arXiv 2305.09781, Sec. 4.2; EAGLE, arXiv 2401.15077, KV update after tree
verification). Same results as `kernels.reference_tree.compact_kv_reference`.

One program per (batch, head, D-block) walks the path in order: it writes row start + k after reading row
start + path[k] >= start + k, and later reads only rows further on, so the in-place copy is race free as long
as `path` is increasing. Rows already in place (path[k] == k) are skipped by the store mask.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _compact_kernel(
    kv_ptr, path_ptr, S, H, D, start, stride_b, stride_h, stride_l, stride_d,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    b = pid // H
    h = pid % H
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = offs < D
    base = kv_ptr + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h + offs.to(tl.int64) * stride_d
    for k in range(0, S):
        src = tl.load(path_ptr + k)
        move = dmask & (offs * 0 + src != k)
        row = tl.load(base + (start + src) * stride_l, mask=move)
        tl.store(base + (start + k) * stride_l, row, mask=move)


def compact_kv_triton(kv: Tensor, start: int, path: Tensor) -> int:
    """Triton twin of `kernels.reference_tree.compact_kv_reference` (path must be increasing)."""
    S = path.numel()
    if S == 0:
        return start
    B, H, _, D = kv.shape
    path = path.to(device=kv.device, dtype=torch.int64).contiguous()
    if path.device.type == "cpu" and torch.equal(path, torch.arange(S)):
        return start + S
    bits = kv.view(_BITS[kv.element_size()])  # a bit copy: any dtype, and no bf16 needed in the interpreter
    block_d = min(128, triton.next_power_of_2(D))
    grid = (B * H, triton.cdiv(D, block_d))
    _compact_kernel[grid](bits, path, S, H, D, start, *bits.stride(), BLOCK_D=block_d)
    return start + S
