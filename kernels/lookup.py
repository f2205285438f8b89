"""Prompt lookup on the device (Saxena 2023, "prompt lookup decoding"; the n-gram idea of ``drafters.ngram``): each
row's ``depth`` draft tokens are what followed the most recent earlier occurrence of its last n tokens, n from
``ngram`` down to 1 (the longest that occurs), or its last token repeated where none occurs. Tensor operations that
read nothing back to the host (a device-resident step's draft, ``env.device_loop``); the Triton twin is
``kernels.triton_lookup``."""

from __future__ import annotations

from numbers import Integral

import torch
from torch import Tensor

from kernels.common import check_tensor


def check_lookup_args(hist: Tensor, cur_len: Tensor, depth: int, ngram: int, values: bool = False) -> None:
    """Raise TypeError / ValueError unless ``prompt_lookup`` can read them: hist an integer tensor [B, L] with
    L >= 1, cur_len an integer tensor [B] on hist's device, depth an integer >= 0, ngram an integer >= 1. With
    ``values`` (cur_len on the CPU) also 1 <= cur_len <= L: ``prompt_lookup`` itself does not ask for that, as
    reading cur_len back is what a device-resident step must not do, on any device (``env.device_loop``)."""
    check_tensor("hist", hist, "integer")
    check_tensor("cur_len", cur_len, "integer")
    if hist.dim() != 2 or hist.shape[1] < 1:
        raise ValueError(f"hist {tuple(hist.shape)} must be [B, L] with L >= 1")
    B, L = hist.shape
    if tuple(cur_len.shape) != (B,):
        raise ValueError(f"cur_len {tuple(cur_len.shape)} must be [B] with B = {B}")
    if cur_len.device != hist.device:
        raise ValueError(f"cur_len is on {cur_len.device}, hist on {hist.device}: they must share a device")
    for name, v, least in (("depth", depth, 0), ("ngram", ngram, 1)):
        if not isinstance(v, Integral) or isinstance(v, bool):
            raise TypeError(f"{name} must be an integer, got {v!r} ({type(v).__name__})"[:200])
        if v < least:
            raise ValueError(f"{name} must be >= {least}, got {v}")
    if values and cur_len.device.type == "cpu" and B > 0:
        bad = ((cur_len < 1) | (cur_len > L)).nonzero()
        if len(bad):
            b = int(bad[0, 0])
            raise ValueError(
                f"row {b}: cur_len {int(cur_len[b])} is not within 1..{L} (the root is a real token)"
            )


def prompt_lookup_reference(hist: Tensor, cur_len: Tensor, depth: int, ngram: int) -> Tensor:
    """hist int64 [B, L]: each row's tokens (its first ``cur_len[b]`` are real, the last of them the root); returns
    int64 [B, depth]: the tokens after the chosen match, the root where the match's continuation runs out, the
    root repeated where nothing matches."""
    L = hist.shape[1]
    pos = torch.arange(L, device=hist.device)
    best = torch.full_like(cur_len, -1)  # end position of the chosen match
    for n in range(1, ngram + 1):  # longer n-grams override shorter ones
        ok = (pos[None, :] >= n - 1) & (pos[None, :] <= cur_len[:, None] - 2)  # [B, L]: a match ends at j
        for t in range(n):  # hist[j - t] == hist[cur - 1 - t]
            shifted = torch.nn.functional.pad(hist, (t, 0), value=-1)[:, :L]
            ok = ok & (shifted == hist.gather(1, (cur_len - 1 - t).clamp(min=0)[:, None]))
        j = torch.where(ok, pos[None, :], -1).amax(-1)
        best = torch.where(j >= 0, j, best)
    steps = torch.arange(depth, device=hist.device)
    take = (best[:, None] + 1 + steps[None, :]).clamp(max=(cur_len - 1)[:, None])
    root = hist.gather(1, (cur_len - 1)[:, None])
    return torch.where(best[:, None] >= 0, hist.gather(1, take.clamp(min=0)), root)
