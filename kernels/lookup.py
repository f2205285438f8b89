"""Prompt lookup on the device (Saxena 2023, "prompt lookup decoding"; the n-gram idea of ``drafters.ngram``): each
row's ``depth`` draft tokens are what followed the most recent earlier occurrence of its last n tokens, n from
``ngram`` down to 1 (the longest that occurs), or its last token repeated where none occurs. Tensor operations that
read nothing back to the host (a device-resident step's draft, ``env.device_loop``); the Triton twin is
``kernels.triton_lookup``."""

from __future__ import annotations

import torch
from torch import Tensor


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
