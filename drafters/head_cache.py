"""The runtime caches of the model heads (``drafters.eagle``, ``drafters.early_exit``): a head's own key/value
store over a sequence's committed pairs, and the temporary slots a draft tree's nodes take in it during one
proposal."""

from __future__ import annotations

import torch

from drafters.trees import GrowingTree


class KVBuffer:
    """A growable [1, Hkv, cap, D] key/value store: ``n`` committed slots, then temporary tree slots."""

    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.k = torch.zeros(1, kv_heads, 256, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.n = 0

    def write(self, at: int, k: torch.Tensor, v: torch.Tensor) -> None:
        end = at + k.shape[2]
        if end > self.k.shape[2]:
            grow = max(end, 2 * self.k.shape[2]) - self.k.shape[2]
            self.k = torch.cat([self.k, self.k.new_zeros(*self.k.shape[:2], grow, self.k.shape[3])], dim=2)
            self.v = torch.cat([self.v, self.v.new_zeros(*self.v.shape[:2], grow, self.v.shape[3])], dim=2)
        self.k[:, :, at:end] = k
        self.v[:, :, at:end] = v


class TreeSlots:
    """Temporary cache slots of tree nodes during one proposal, and which of them each node may see."""

    def __init__(self, committed: int) -> None:
        self.committed = committed
        self.slot: dict[int, int] = {}  # tree node -> cache slot
        self.seen: dict[int, list[int]] = {0: []}  # node -> the slots of its drafted ancestors and its own

    def place(self, nodes: list[int], start: int, g: GrowingTree) -> None:
        """Give ``nodes`` (one frontier, their parents already placed) the slots ``start``, ``start + 1``, ..."""
        for i, u in enumerate(nodes):
            self.slot[u] = start + i
            self.seen[u] = self.seen[g.parents[u]] + [start + i]

    def mask(self, nodes: list[int], g: GrowingTree, device: torch.device) -> torch.Tensor:
        """[1, 1, F, committed + slots] bool: each node sees every committed slot, its drafted ancestors, itself."""
        total = self.committed + len(self.slot)
        m = torch.zeros(len(nodes), total, dtype=torch.bool, device=device)
        m[:, : self.committed] = True
        for r, u in enumerate(nodes):
            m[r, self.seen[u]] = True
        return m[None, None]


__all__ = ["KVBuffer", "TreeSlots"]
