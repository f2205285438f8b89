"""The split-key Triton attention (kernels.triton_attention) against SDPA (kernels.tree_attention_reference) on
the shapes a decoding or verify step gives it: grouped-query heads, 1 to 32 nodes, keys that are a strided view of
a larger cache, spans that are not a multiple of the key chunk, long spans (chunks of several key blocks), rows whose later
chunks are all masked, chain and
tree masks. On CUDA in fp32 and bf16; on a CPU `test_under_interpreter` reruns this file with TRITON_INTERPRET=1
(fp32: the interpreter has no bf16)."""

import pytest
import torch
from kernel_cases import CUDA, DEVICE, needs_triton, rerun_here, rerun_under_interpreter

from kernels import tree_attention, tree_attention_reference, triton_attention, triton_enabled
from kernels.triton_attention import MERGES, supported

# (rows, query heads, KV heads, nodes, span, head size, tree)
CASES = [  # bf16 on CUDA takes the first five (see kernels.triton_attention.supported)
    (1, 9, 3, 1, 256, 64, False),  # a decoding step of the embedded model's shape
    (1, 9, 3, 5, 700, 64, False),  # a chain of 4 drafts; the span not a multiple of the chunk
    (3, 9, 3, 17, 513, 64, True),  # three rows, a tree of 17 nodes
    (2, 9, 3, 5, 2500, 64, False),  # a long span: chunks of two key blocks, 20 of them; most of them unseen
    (1, 9, 3, 3, 50, 64, False),  # a span shorter than a key block: one chunk, nothing to merge
    (2, 8, 2, 32, 300, 32, True),  # 4 query heads per KV head x 32 nodes: the largest tile
    (2, 4, 4, 3, 1100, 16, False),  # no grouping; most chunks of the first row all masked
]


def make_case(seed: int, B: int, H: int, Hkv: int, Q: int, S: int, D: int, tree: bool, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seed)
    L = S + 37  # the cache is longer than the span read: keys and values are strided views, as in a step
    cache_k = torch.randn(B, Hkv, L, D, generator=gen)
    cache_v = torch.randn(B, Hkv, L, D, generator=gen)
    q = torch.randn(B, Q, H, D, generator=gen).transpose(1, 2) * 2  # [B, H, Q, D], not contiguous
    lens = torch.randint(1, S - Q + 1, (B,), generator=gen)
    lens[0] = min(int(lens[0]), 40)  # a short row: its later chunks see nothing
    parents = torch.arange(Q) - 1
    if tree:
        parents = torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, Q)])
    anc = torch.eye(Q, dtype=torch.bool)  # anc[i, j]: j is i or an ancestor of i
    for i in range(1, Q):
        anc[i] |= anc[int(parents[i])]
    key = torch.arange(S)
    rel = key[None, :] - lens[:, None]  # [B, S]: node index of a key position in this step
    inside = (rel >= 0) & (rel < Q)
    seen = anc[:, rel.clamp(0, Q - 1)].permute(1, 0, 2)  # [B, Q, S]
    mask = (rel[:, None, :] < 0) | (inside[:, None, :] & seen)
    to = dict(device=DEVICE, dtype=dtype)
    return (q.to(**to), cache_k.to(**to)[:, :, :S], cache_v.to(**to)[:, :, :S], mask[:, None].to(DEVICE))


@needs_triton
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] if CUDA else [torch.float32])
@pytest.mark.parametrize("merge", MERGES)
def test_triton_attention_matches_sdpa(case, dtype, merge, monkeypatch) -> None:
    monkeypatch.setattr(triton_attention, "MERGE", merge)  # either merge of the chunks
    q, k, v, mask = make_case(0, *case, dtype)
    scale = case[5] ** -0.5
    assert triton_enabled(q)
    if dtype != torch.float32 and not supported(q, k, v, mask):
        pytest.skip("bf16 at this shape attends through SDPA (kernels.triton_attention.HALF_HEAD_SIZES)")
    assert supported(q, k, v, mask)  # the dispatcher runs the kernel, not SDPA
    got = tree_attention(q, k, v, mask, scale)
    want = tree_attention_reference(q.float(), k.float(), v.float(), mask, scale)
    assert got.shape == want.shape and got.dtype == dtype
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@needs_triton
def test_a_broadcast_mask_or_unverified_shape_goes_to_sdpa() -> None:
    """A mask that SDPA would broadcast ([1, 1, Q, S] for two rows), or a head size not verified on a GPU, is not
    the kernel's: the dispatcher gives SDPA's result."""
    q, k, v, mask = make_case(2, 2, 4, 2, 3, 300, 32, False, torch.float32)
    one = mask[:1]
    assert not supported(q, k, v, one)
    torch.testing.assert_close(tree_attention(q, k, v, one, 0.2), tree_attention_reference(q, k, v, one, 0.2))
    q, k, v, mask = make_case(3, 1, 4, 2, 3, 300, 128, False, torch.float32)
    assert not supported(q, k, v, mask)
    torch.testing.assert_close(
        tree_attention(q, k, v, mask, 0.1), tree_attention_reference(q, k, v, mask, 0.1)
    )


@rerun_here
def test_under_interpreter() -> None:
    out = rerun_under_interpreter(__file__)
    assert f"\n{len(CASES) * len(MERGES) + 1} passed" in out, out[-2000:]
