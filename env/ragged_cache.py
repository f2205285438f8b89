"""The batch engine's KV cache: ``RaggedCache``, a ``transformers`` ``Cache`` of our own. Preallocated slots
``[rows, kv_heads, capacity, dim]`` per layer, grown in chunks; row ``r`` holds ``lens[r]`` committed tokens (every
committed token of its sequence but the last, the root of its next tree), and a forward writes row ``r``'s ``q``
nodes at positions ``lens[r] .. lens[r] + q - 1`` of that row — so rows of different lengths share one forward.
``RowKV`` is one row's entries as a ``drafters.KVView``.

The lean forward (``env.lean``) writes and reads the slots itself; the transformers forward needs a ``Cache``:
``hf_ragged_cache`` makes one of the same class with transformers' ``Cache`` mixed in (imported only then).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from env.batch import Row

CHUNK = 256  # cache growth, in positions


@dataclass(frozen=True)
class Write:
    """Where a forward's nodes go: ``slots[b, i]`` of row ``rows[b, i]``; the model reads rows ``lo .. hi - 1``,
    positions ``0 .. span - 1``; ``past``: committed positions of a single row (its mask built by the model)."""

    rows: torch.Tensor
    slots: torch.Tensor
    lo: int
    hi: int
    span: int
    past: int


class RaggedCache:
    """Per-layer K/V ``[rows, kv_heads, capacity, dim]``; ``lens[r]`` committed positions of row ``r``."""

    def __init__(self, layers: int, rows: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: Any):
        self.n_layers, self.rows, self.kv_heads, self.head_dim = layers, rows, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.capacity = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.lens = [0] * rows
        self._write: Write | None = None  # set by BatchTarget for the duration of a forward
        self.grow(CHUNK - 1)

    def grow(self, need: int) -> None:
        """Make room for ``need`` positions per row (in chunks), and one more: a forward's view of the cache never
        spans all of it, so a compiled forward's code does not change when it would (torch.compile guards on
        whether a view is contiguous). Existing entries are kept."""
        if need < self.capacity:
            return
        cap = (need // CHUNK + 1) * CHUNK
        shape = (self.rows, self.kv_heads, cap, self.head_dim)
        for i in range(self.n_layers):
            for store in (self.k, self.v):
                new = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if i < len(store):
                    new[:, :, : self.capacity] = store[i]
                    store[i] = new
                else:
                    store.append(new)
        self.capacity = cap

    # ---- what the model calls ----
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Write this forward's ``[B, H, q, D]`` states at each row's positions; return ``[B, H, S, D]`` views."""
        w = self._write
        k, v = self.k[layer_idx], self.v[layer_idx]
        k[w.rows, :, w.slots] = key_states.transpose(1, 2)
        v[w.rows, :, w.slots] = value_states.transpose(1, 2)
        return k[w.lo : w.hi, :, : w.span], v[w.lo : w.hi, :, : w.span]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._write.past if self._write is not None else max(self.lens, default=0)

    # A forward of one row whose mask the model builds itself (``BatchTarget._forward`` with ``mask=None``): the
    # sizes Hugging Face's mask functions ask for, as a DynamicCache of that row would give them.
    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._write.past + query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self._write.past

    @property
    def is_compileable(self) -> bool:
        return False

    # ---- rows ----
    def move_row(self, src: int, dst: int) -> None:
        """Row ``src``'s entries into slot ``dst`` (packing the rows after one retires)."""
        n = self.lens[src]
        for store in (self.k, self.v):
            for t in store:
                t[dst, :, :n] = t[src, :, :n]
        self.lens[dst], self.lens[src] = n, 0


@cache
def _hf_class() -> type:
    from transformers.cache_utils import Cache

    class HFRaggedCache(RaggedCache, Cache):
        """A ``RaggedCache`` the transformers forward accepts (its ``update`` and sizes are RaggedCache's)."""

        def __init__(self, *args: Any) -> None:
            Cache.__init__(self, layers=[])
            RaggedCache.__init__(self, *args)

    return HFRaggedCache


def hf_ragged_cache(
    layers: int, rows: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: Any
) -> RaggedCache:
    """A ``RaggedCache`` that is also a transformers ``Cache`` (for ``BatchTarget``'s transformers forward)."""
    return _hf_class()(layers, rows, kv_heads, head_dim, dtype, device)


class RowKV:
    """Row ``row``'s entries in the ragged cache as a ``drafters.KVView`` (``[1, kv_heads, capacity, dim]`` per
    layer); follows the row when it moves to another slot."""

    def __init__(self, cache: RaggedCache, row: Row) -> None:
        self.cache, self.row = cache, row

    def keys(self, layer: int) -> torch.Tensor:
        s = self.row.slot
        return self.cache.k[layer][s : s + 1]

    def values(self, layer: int) -> torch.Tensor:
        s = self.row.slot
        return self.cache.v[layer][s : s + 1]
