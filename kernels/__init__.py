"""Pure tensor functions for speculative decoding: tree buffers, tree verification, KV-cache compaction, prompt
lookup on the device, attention of a step's few nodes over a KV cache.

Each function has a torch reference (`kernels.reference`, `kernels.reference_tree`, `kernels.lookup`) and a fused
Triton kernel (`kernels.triton_verify` with `kernels.triton_stats`, `kernels.triton_tree`, `kernels.triton_kv`,
`kernels.triton_lookup`, `kernels.triton_attention`). The dispatchers below pick Triton when the tensors are on
CUDA, or when TRITON_INTERPRET=1 is set (CPU interpreter, for tests), and triton is installed; the torch reference otherwise.
Both give the same results: integers equal, floats within 1e-6 (the accept/reject decisions can differ only when a
coin lands within float rounding of its threshold; attention in bf16 agrees within bf16 rounding). Triton is
imported lazily, on the first dispatched call, never at import time.
"""

from __future__ import annotations

import importlib.util
import os

import torch
from torch import Tensor

from kernels.common import (
    TreeBuffers,
    TreeError,
    Verdict,
    VerifyBuffers,
    check_parents,
    check_sampling_inputs,
    check_sampling_settings,
    check_trees,
    draw_coins,
    is_greedy,
)
from kernels.lookup import check_lookup_args, prompt_lookup_reference
from kernels.reference import argmax_lastdim, inverse_cdf, process_logits, verify_reference
from kernels.reference_tree import (
    check_compact_args,
    check_mask,
    compact_kv_reference,
    tree_attention_reference,
    tree_buffers_reference,
)

__all__ = [
    "TreeBuffers",
    "TreeError",
    "Verdict",
    "VerifyBuffers",
    "argmax_lastdim",
    "check_parents",
    "check_trees",
    "compact_kv_",
    "compact_kv_reference",
    "draw_coins",
    "inverse_cdf",
    "process_logits",
    "prompt_lookup",
    "prompt_lookup_reference",
    "tree_buffers",
    "tree_buffers_reference",
    "tree_attention",
    "tree_attention_reference",
    "triton_enabled",
    "verify",
    "verify_reference",
]


def triton_enabled(t: Tensor) -> bool:
    """Whether the dispatchers route a call on tensor `t` to Triton."""
    on = t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    return on and importlib.util.find_spec("triton") is not None


def verify(
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
    """Verify a batch of padded draft trees against the target logits (DESIGN.md "Verification semantics").

    tokens, parents: int64 [B, N]; logits: [B, N, V] fp32 or bf16 (row i = target logits after node i);
    num_nodes: int64 [B] (padding nodes are never accepted); temperature: finite, >= 0, 0 (and anything below
    ``kernels.common.MIN_TEMPERATURE`` = 2**-100, where logits / T leaves float32) is greedy; top_k >= 0 (0: off),
    top_p in [0, 1] (1: off); draft_probs: [B, N, V] or None for deterministic drafts; coins: [B, N] and
    final_coins: [B] uniforms in [0, 1), drawn from `generator` (coins first) when not given. Returns a Verdict
    (path, accept_len, next_token, accepted, node_prob). ``out``: a `VerifyBuffers` of this (B, N, V) and device,
    written in place and returned as the Verdict's tensors (path [B, N], -1 padded): no allocation and no host
    synchronization per call on CUDA.
    Trees outside the contract raise ``TreeError`` (``check_trees``: shapes always; the values of trees on the
    CPU when ``out`` is None — a call into buffers is a device-resident step's, which reads nothing back).
    Wrong types and dtypes raise TypeError, settings out of range ValueError. Values, on the CPU only: sampling
    coins outside [0, 1) and draft_probs outside [0, 1] raise ValueError when ``out`` is None; logits rows the
    verification reads (greedy: every real node's; sampling: the rows the walk processes) must have a finite
    maximum and no NaN (-inf marks an impossible token), else ValueError — folded into the work (the greedy row
    maximum, the processed distribution), not a pass of its own; greedy into ``out`` reads nothing back, so checks
    no logits. The Triton path (GPU) checks no values.
    """
    check_trees(tokens, parents, logits, num_nodes, values=out is None)
    check_sampling_settings(temperature, top_k, top_p)
    sampling = not is_greedy(temperature)
    check_sampling_inputs(
        tokens, logits, draft_probs, coins, final_coins, num_nodes, values=sampling and out is None
    )
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if out is not None and not isinstance(out, VerifyBuffers):
        raise TypeError(f"out must be kernels.VerifyBuffers or None, got {type(out).__name__}")
    kwargs = dict(
        num_nodes=num_nodes,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        draft_probs=draft_probs,
        coins=coins,
        final_coins=final_coins,
        generator=generator,
        out=out,
    )
    if triton_enabled(logits):
        from kernels.triton_verify import verify_triton

        return verify_triton(tokens, parents, logits, **kwargs)
    return verify_reference(tokens, parents, logits, **kwargs)


def tree_buffers(parents: Tensor, num_nodes: Tensor | None = None) -> TreeBuffers:
    """Index tables of padded trees: depth, ancestor mask, first child, next sibling, root-to-leaf paths.
    parents: int64 [B, N]; num_nodes: int64 [B] or None. ``TreeError`` for links that are not trees
    (``kernels.common.check_parents``; their values checked where they lie on the CPU)."""
    check_parents(parents, num_nodes)
    if triton_enabled(parents):
        from kernels.triton_tree import tree_buffers_triton

        return tree_buffers_triton(parents, num_nodes)
    return tree_buffers_reference(parents, num_nodes)


def prompt_lookup(hist: Tensor, cur_len: Tensor, depth: int, ngram: int) -> Tensor:
    """[B, depth] prompt-lookup drafts of each row (``kernels.lookup``): hist int64 [B, L], cur_len int64 [B] (the
    row's real tokens, the last the root). One Triton program per row where Triton runs (ngram up to 4), the torch
    reference otherwise; neither reads back to the host. TypeError / ValueError for arguments outside that
    (``kernels.lookup.check_lookup_args``: types, shapes, depth >= 0, ngram >= 1; not cur_len's values, which
    would be a read back — ``check_lookup_args(..., values=True)`` checks them for a caller that may read)."""
    check_lookup_args(hist, cur_len, depth, ngram)
    if triton_enabled(hist) and 1 <= ngram <= 4:
        from kernels.triton_lookup import prompt_lookup_triton

        return prompt_lookup_triton(hist, cur_len, depth, ngram)
    return prompt_lookup_reference(hist, cur_len, depth, ngram)


def tree_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Attention of a few nodes per row over a KV cache under a mask (a decoding or verify step): q [B, H, Q, D],
    k and v [B, Hkv, S, D] (a view of the cache: any strides), mask bool [B, 1, Q, S]; returns [B, Q, H, D]. The
    split-key Triton kernel where it takes the shapes (``kernels.triton_attention.supported``: the ones verified on a
    GPU), SDPA otherwise; in bf16 the two agree within bf16 rounding, not within 1e-6. TypeError for a mask that
    is not boolean."""
    check_mask(mask)
    if triton_enabled(q):
        from kernels.triton_attention import supported, tree_attention_triton

        if supported(q, k, v, mask):
            return tree_attention_triton(q, k, v, mask, scale)
    return tree_attention_reference(q, k, v, mask, scale)


def compact_kv_(kv: Tensor, start: int, path: Tensor, *, check: bool = True) -> int:
    """In place: kv[:, :, start + k] = kv[:, :, start + path[k]] for k < S; returns start + S.
    kv: [B, H, L, D]; path: int64 [S], strictly increasing node indices relative to `start`, start + path[-1] < L.
    TypeError / ValueError otherwise (``kernels.reference_tree.check_compact_args``: the path's values where it
    lies on the CPU, only its shape on a GPU). ``check=False``: the caller checked these arguments already (one
    path moved in every layer's K and V of one shape: checked for the first: the check cost about as much as the copy on a 2-core AMD EPYC family 25 model 17)."""
    if check:
        check_compact_args(kv, start, path)
    if triton_enabled(kv):
        from kernels.triton_kv import compact_kv_triton

        return compact_kv_triton(kv, start, path)
    return compact_kv_reference(kv, start, path)
