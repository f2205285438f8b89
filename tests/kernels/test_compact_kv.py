"""KV-cache compaction after verification."""

import pytest
import torch

from kernels import compact_kv_, compact_kv_reference


@pytest.mark.parametrize("fn", [compact_kv_reference, compact_kv_])
@pytest.mark.parametrize("path", [[0, 2, 3, 7], [0, 1, 2], [0], [0, 5], [0, 1, 4, 5, 6]])
def test_moves_path_rows_to_front(fn, path: list[int]) -> None:
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 3, 20, 5, generator=gen).bfloat16()
    before = kv.clone()
    start = 6
    end = fn(kv, start, torch.tensor(path))
    assert end == start + len(path)
    assert torch.equal(kv[:, :, start:end], before[:, :, [start + p for p in path]])
    assert torch.equal(kv[:, :, :start], before[:, :, :start])  # the prefix is untouched
    tail = [i for i in range(end, 20) if i >= start + path[-1] + 1]
    assert torch.equal(kv[:, :, tail], before[:, :, tail])  # rows past the tree region are untouched


def test_non_contiguous_view_and_empty_path() -> None:
    base = torch.randn(2, 20, 3, 4)
    kv = base.transpose(1, 2)  # [B, H, L, D] view with non-standard strides
    want = kv.clone()
    want[:, :, 2:4] = want[:, :, [2, 5]]
    assert compact_kv_(kv, 2, torch.tensor([0, 3])) == 4 and torch.equal(kv, want)
    assert compact_kv_(kv, 7, torch.tensor([], dtype=torch.int64)) == 7
