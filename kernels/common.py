"""Result types and small helpers shared by the torch reference and the Triton kernels.

Trees follow DESIGN.md "Trees": node 0 is the root (the last committed token), `parents[0] = -1`,
`parents[i] < i`, children are tried in increasing node index, batched trees pad to a common N and carry
`num_nodes[B]`. Nothing here imports triton.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from numbers import Integral, Real

import torch
from torch import Tensor


@dataclass(frozen=True, eq=False)
class Verdict:
    """Outcome of verifying a batch of draft trees (DESIGN.md "Verification semantics")."""

    path: Tensor
    """int64 [B, S]: node indices of the accepted path from the root (root 0 first), -1 padded."""
    accept_len: Tensor
    """int64 [B]: accepted draft tokens, bonus excluded (= number of non -1 entries in `path` minus 1)."""
    next_token: Tensor
    """int64 [B]: the bonus / correction token after the last accepted node."""
    accepted: Tensor
    """bool [B, N]: node lies on the accepted path (the root counts as accepted; padding never)."""
    node_prob_source: Tensor | Callable[[], Tensor] = field(repr=False)
    """float32 [B, N], or a thunk computing it; read it through `node_prob`."""

    @functools.cached_property
    def node_prob(self) -> Tensor:
        """float32 [B, N]: target probability of each node's token under its parent's processed
        distribution (greedy: softmax at T=1 of the raw logits); root 1.0, padding 0.0.

        The torch path computes it on first access (it needs a softmax over all of [B, N, V], which costs more
        than the whole verification on CPU); the Verdict keeps a reference to the logits until then."""
        src = self.node_prob_source
        return src() if callable(src) else src


@dataclass(frozen=True, eq=False)
class TreeBuffers:
    """Index tables of a batch of padded trees (DESIGN.md "Trees")."""

    depth: Tensor
    """int64 [B, N]: root 0; padding nodes 0."""
    ancestor_mask: Tensor
    """bool [B, N, N]: row i is True at j if j is an ancestor of i or i itself; padding rows only themselves."""
    first_child: Tensor
    """int64 [B, N]: smallest child index, -1 for leaves and padding."""
    next_sibling: Tensor
    """int64 [B, N]: next larger node index with the same parent, -1 where none."""
    paths: Tensor
    """int64 [B, L, Dmax + 1]: root-to-leaf node indices, one row per leaf in increasing leaf index, -1 padded."""
    num_leaves: Tensor
    """int64 [B]."""


# tokens per program of the Triton greedy statistics: a row of V tokens is ceil(V / GREEDY_CHUNK) programs
# (`python -m kernels.bench --greedy-settings` on an H200: 8,192 in one load on 8 warps was the fastest at N = 64,
# 18.8 µs at B = 1 against 21.0 with 4,096 in four loads on 4)
GREEDY_CHUNK = 8192


def greedy_splits(V: int) -> int:
    """Programs (chunks) per row of the Triton greedy statistics."""
    return -(-V // GREEDY_CHUNK)


class VerifyBuffers:
    """Preallocated outputs and scratch of verifying trees of one shape bucket: ``B`` rows, ``N`` nodes, ``V``
    tokens, on one device. ``kernels.verify(..., out=buffers)`` fills them and returns a Verdict whose tensors
    are these buffers (valid until the next call with the same buffers): no allocation, and no host
    synchronization, per call on CUDA — the form a graph-captured decoding step needs. ``path`` is then
    ``[B, N]``, -1 padded (not trimmed to the longest path, which would read a number back to the host).
    ``draft_probs``: room for the residual scratch of sampling with draft distributions."""

    def __init__(self, B: int, N: int, V: int, device: torch.device | str, draft_probs: bool = False) -> None:
        dev = torch.device(device)
        self.shape = (B, N, V)
        self.path = torch.full((B, N), -1, dtype=torch.int64, device=dev)
        self.device = self.path.device  # "cuda" -> "cuda:0": compared with the tensors' own devices
        self.accept_len = torch.zeros(B, dtype=torch.int64, device=dev)
        self.next_token = torch.zeros(B, dtype=torch.int64, device=dev)
        self.accepted8 = torch.zeros(B, N, dtype=torch.int8, device=dev)  # the kernel stores bytes
        self.accepted = self.accepted8.view(torch.bool)  # the same memory, read as flags
        self.node_prob = torch.zeros(B, N, dtype=torch.float32, device=dev)
        # the Triton kernels' per-row statistics (max, normaliser, threshold key, argmax)
        self.m = torch.zeros(B, N, dtype=torch.float32, device=dev)
        self.s = torch.ones(B, N, dtype=torch.float32, device=dev)
        self.thr = torch.zeros(B, N, dtype=torch.int64, device=dev)
        self.am = torch.zeros(B, N, dtype=torch.int64, device=dev)
        # greedy: each row's statistics per chunk of GREEDY_CHUNK tokens, merged by the walk
        parts = B * N * greedy_splits(V)
        self.part_m = torch.zeros(parts, dtype=torch.float32, device=dev)
        self.part_s = torch.zeros(parts, dtype=torch.float32, device=dev)
        self.part_am = torch.zeros(parts, dtype=torch.int64, device=dev)
        self.coins = torch.zeros(B, N, dtype=torch.float32, device=dev)
        self.final_coins = torch.zeros(B, dtype=torch.float32, device=dev)
        self.all_nodes = torch.full((B,), N, dtype=torch.int64, device=dev)
        self.scratch = torch.zeros(B if draft_probs else 1, 2, V, dtype=torch.float32, device=dev)

    def check(self, B: int, N: int, V: int, device: torch.device, draft_probs: bool) -> None:
        """Raise ValueError unless a call of this shape, on this device, fits these buffers."""
        if self.shape != (B, N, V) or device != self.device:
            raise ValueError(
                f"verify buffers are for (B, N, V) = {self.shape} on {self.device}, not {(B, N, V)} on {device}"
            )
        if draft_probs and self.scratch.shape[0] != B:
            raise ValueError(
                "these verify buffers have no draft_probs scratch (VerifyBuffers(..., draft_probs=True))"
            )
        if self.part_m.numel() != B * N * greedy_splits(V):  # GREEDY_CHUNK changed since they were made
            raise ValueError(
                f"these verify buffers hold greedy statistics for chunks of another size than GREEDY_CHUNK = "
                f"{GREEDY_CHUNK}: make them again"
            )

    def verdict(self) -> Verdict:
        return Verdict(self.path, self.accept_len, self.next_token, self.accepted, self.node_prob)


class TreeError(ValueError):
    """A draft tree outside the contract (DESIGN.md "Trees"): the message names the row, the node and the rule."""


# Temperatures in (0, MIN_TEMPERATURE) sample greedily, the T -> 0 limit of softmax(logits / T). Below it z = logits *
# fp32(1/T) leaves float32 (1/T itself overflows below 2**-128, and z does for |logits| >= 2**28 at 2**-100), and the
# distribution is already one-hot on the argmax in float32 for any two logits that differ by more than ~100 T
# (1e-28; fp32 logits of magnitude >= 2**-70 differ by more than that or are equal): the only difference is that
# exact ties go to the first maximum instead of a draw among them, and no coins are drawn. At and above it the
# sampling is softmax(logits * fp32(1/T)), bit for bit as before.
MIN_TEMPERATURE = 2.0**-100


def is_greedy(temperature: float) -> bool:
    """Whether ``temperature`` (checked by ``check_sampling_settings``) means greedy decoding."""
    return temperature < MIN_TEMPERATURE


def check_sampling_settings(temperature: float, top_k: int, top_p: float, top_p_zero: bool = True) -> None:
    """Raise TypeError / ValueError unless temperature is a finite real >= 0 (0 greedy), top_k an integer in
    [0, 2**31 - 1] (0: no top-k) and top_p a finite real in [0, 1] (1: no top-p; 0 keeps only the tokens tied for
    the largest logit; ``top_p_zero=False`` refuses it). ``env.engine.Sampling`` checks its settings here (top_p = 0
    refused), and temperatures in (0, ``MIN_TEMPERATURE``) besides."""
    for name, v in (("temperature", temperature), ("top_p", top_p)):
        if not isinstance(v, Real) or isinstance(v, bool):
            raise TypeError(f"{name} must be a finite number, got {v!r} ({type(v).__name__})"[:200])
        try:
            finite = math.isfinite(v)
        except OverflowError:  # an integer too large for a float
            finite = False
        if not finite:
            raise ValueError(f"{name} must be a finite number, got {v!r}"[:200])
    if not isinstance(top_k, Integral) or isinstance(top_k, bool):
        raise TypeError(f"top_k must be an integer, got {top_k!r} ({type(top_k).__name__})"[:200])
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature!r}")
    if not 0 <= top_k <= (1 << 31) - 1:  # far above any vocabulary (experiments.args.MAX_TOP_K)
        raise ValueError(f"top_k must be in [0, 2**31 - 1] (0: no top-k), got {top_k!r}"[:200])
    if not (0 <= top_p <= 1 if top_p_zero else 0 < top_p <= 1):
        span = "[0, 1]" if top_p_zero else "(0, 1]"
        raise ValueError(f"top_p must be in {span} (1: no top-p), got {top_p!r}")


_KINDS = {"integer": "integers", "floating": "real floating-point numbers", "bool": "booleans"}


def check_tensor(name: str, t: object, kind: str, optional: bool = False) -> None:
    """Raise TypeError unless ``t`` is a torch.Tensor of ``kind`` ("integer": any integer dtype but bool,
    "floating": a real floating dtype, "bool"), or None where ``optional``; ValueError for a meta tensor (it holds
    no values to compute with)."""
    if t is None and optional:
        return
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of {_KINDS[kind]}, got {type(t).__name__}")
    dt = t.dtype
    if kind == "floating":
        ok = dt.is_floating_point
    elif kind == "bool":
        ok = dt == torch.bool
    else:
        ok = not dt.is_floating_point and not dt.is_complex and dt != torch.bool
    if not ok:
        raise TypeError(f"{name} must hold {_KINDS[kind]}, got a {dt} tensor")
    if t.is_meta:
        raise ValueError(f"{name} is a meta tensor: it holds no values to compute with")


def check_uniforms(name: str, u: Tensor, valid: Tensor | None = None) -> None:
    """Raise ValueError unless every entry of ``u`` (where ``valid``, if given) lies in [0, 1): NaN, a negative
    coin or one >= 1 would accept or reject regardless of the probabilities. One small reduction (B x N)."""
    if u.numel() == 0:
        return
    x = u if valid is None else torch.where(valid, u, 0.0)
    lo, hi = torch.aminmax(x)
    if bool(lo >= 0) and bool(hi < 1):  # NaN propagates into both and fails them
        return
    at = [int(i) for i in (~((x >= 0) & (x < 1))).nonzero()[0]]
    raise ValueError(f"{name}{at} = {float(x[tuple(at)])!r} is not a uniform in [0, 1)")


def raise_bad_logits(row: Tensor, where: str, temperature: float) -> None:
    """Raise ValueError naming why the logits ``row`` [V] give no distribution: a NaN, a +inf, no finite value
    (all -inf), or, at a tiny temperature, z = logits * fp32(1/T) overflowing float32."""
    if bool(row.isnan().any()):
        why = "holds NaN"
    elif bool((row == float("inf")).any()):
        why = "holds +inf"
    elif bool((row == float("-inf")).all()):
        why = "is all -inf (no token is possible)"
    else:
        big = float(row.abs().max())
        why = (f"times 1/temperature overflows float32 (|logit| up to {big:.3g} at temperature {temperature!r}: "
               f"use temperature 0 for greedy)")  # fmt: skip
    raise ValueError(f"logits{where} {why}: logits must be finite (-inf marks an impossible token)")


def check_sampling_inputs(
    tokens: Tensor,
    logits: Tensor,
    draft_probs: Tensor | None,
    coins: Tensor | None,
    final_coins: Tensor | None,
    num_nodes: Tensor | None = None,
    values: bool = False,
) -> None:
    """Raise ``TreeError`` unless the sampling inputs given have their documented shapes (draft_probs [B, N, V],
    coins [B, N], final_coins [B]): one row's coins broadcast to every row would tie the rows' draws together
    (no longer independent samples), and the Triton kernel would read past a short buffer. TypeError unless they
    are floating-point tensors. With ``values`` (a sampling call; what lies on the CPU: reading a GPU tensor would
    synchronize the step), ValueError unless the real nodes' coins and the final coins are in [0, 1) and
    draft_probs in [0, 1] (one reduction over [B, N, V]: about 2 % of a verify with draft_probs at B=32, N=16, V=49152 fp32 on a 2-core
    AMD EPYC family 25 model 17)."""
    for name, t in (("draft_probs", draft_probs), ("coins", coins), ("final_coins", final_coins)):
        check_tensor(name, t, "floating", optional=True)
    B, N = tokens.shape
    V = logits.shape[-1]
    for name, t, want in (("draft_probs", draft_probs, (B, N, V)), ("coins", coins, (B, N)),
                          ("final_coins", final_coins, (B,))):  # fmt: skip
        if t is not None and tuple(t.shape) != want:
            raise TreeError(f"{name} {tuple(t.shape)} must be {list(want)} for B, N, V = {B}, {N}, {V}")
    if not values:
        return
    if coins is not None and coins.device.type == "cpu":  # the padding's coins are never read
        on_cpu = num_nodes is None or num_nodes.device.type == "cpu"
        check_uniforms("coins", coins, valid_mask(num_nodes, B, N, coins.device) if on_cpu else None)
    if final_coins is not None and final_coins.device.type == "cpu":
        check_uniforms("final_coins", final_coins)
    if draft_probs is not None and draft_probs.device.type == "cpu" and draft_probs.numel():
        lo, hi = torch.aminmax(draft_probs)
        if not (bool(lo >= 0) and bool(hi <= 1)):  # NaN fails both
            at = [int(i) for i in (~((draft_probs >= 0) & (draft_probs <= 1))).nonzero()[0]]
            raise ValueError(
                f"draft_probs{at} = {float(draft_probs[tuple(at)])!r} is not a probability (finite, in [0, 1])"
            )


def check_trees(
    tokens: Tensor, parents: Tensor, logits: Tensor, num_nodes: Tensor | None, values: bool = True
) -> None:
    """Raise ``TreeError`` for trees ``kernels.verify`` cannot verify: shapes always (tokens and parents [B, N],
    logits [B, N, V], num_nodes [B]); with ``values``, when the trees lie on the CPU (reading them from a GPU would
    synchronize the step), also 1 <= num_nodes <= N, the root's parent -1, every other real node's parent an
    earlier node, every real node's token within the vocabulary. TypeError unless tokens, parents and num_nodes
    are integer tensors and logits a real floating-point one."""
    check_tensor("tokens", tokens, "integer")
    check_tensor("parents", parents, "integer")
    check_tensor("logits", logits, "floating")
    check_tensor("num_nodes", num_nodes, "integer", optional=True)
    if tokens.dim() != 2 or parents.shape != tokens.shape:
        raise TreeError(
            f"tokens {tuple(tokens.shape)} and parents {tuple(parents.shape)} must both be [B, N]"
        )
    B, N = tokens.shape
    if N < 1:
        raise TreeError("trees of no nodes: every tree holds at least its root (node 0)")
    if logits.dim() != 3 or tuple(logits.shape[:2]) != (B, N) or logits.shape[2] < 1:
        raise TreeError(f"logits {tuple(logits.shape)} must be [B, N, V] with B, N = {B}, {N} and V >= 1")
    if num_nodes is not None and tuple(num_nodes.shape) != (B,):
        raise TreeError(f"num_nodes {tuple(num_nodes.shape)} must be [B] with B = {B}")
    held = (tokens, parents) + ((num_nodes,) if num_nodes is not None else ())
    if not values or any(t.device.type != "cpu" for t in held):
        return
    V = logits.shape[-1]
    valid = check_parents(parents, num_nodes)
    bad = (valid & ((tokens < 0) | (tokens >= V))).nonzero()
    if len(bad):
        b, i = (int(x) for x in bad[0])
        raise TreeError(
            f"row {b}: node {i}'s token {int(tokens[b, i])} is not within the vocabulary (0..{V - 1})"
        )


def check_parents(parents: Tensor, num_nodes: Tensor | None) -> Tensor:
    """Raise ``TreeError`` for padded trees whose links are not trees: parents not [B, N], num_nodes not [B], and,
    when they lie on the CPU, num_nodes outside 1..N, a root whose parent is not -1, a real node whose parent is not
    an earlier node. TypeError unless both are integer tensors. Returns the mask of real nodes [B, N]
    (``valid_mask``)."""
    check_tensor("parents", parents, "integer")
    check_tensor("num_nodes", num_nodes, "integer", optional=True)
    if parents.dim() != 2 or parents.shape[1] < 1:
        raise TreeError(
            f"parents {tuple(parents.shape)} must be [B, N] with N >= 1 (every tree holds its root)"
        )
    B, N = parents.shape
    if num_nodes is not None and tuple(num_nodes.shape) != (B,):
        raise TreeError(f"num_nodes {tuple(num_nodes.shape)} must be [B] with B = {B}")
    valid = valid_mask(num_nodes, B, N, parents.device)
    if parents.device.type != "cpu" or (num_nodes is not None and num_nodes.device.type != "cpu"):
        return valid  # reading them from a GPU would synchronize the step
    if num_nodes is not None:
        bad = ((num_nodes < 1) | (num_nodes > N)).nonzero()
        if len(bad):
            b = int(bad[0, 0])
            raise TreeError(
                f"row {b}: num_nodes {int(num_nodes[b])} is not within 1..{N} (the root is node 0)"
            )
    bad = (parents[:, 0] != -1).nonzero()
    if len(bad):
        b = int(bad[0, 0])
        raise TreeError(f"row {b}: the root's parent is {int(parents[b, 0])}, not -1")
    node = torch.arange(N)[None, :]
    bad = (valid & (node > 0) & ((parents < 0) | (parents >= node))).nonzero()
    if len(bad):
        b, i = (int(x) for x in bad[0])
        raise TreeError(
            f"row {b}: node {i}'s parent {int(parents[b, i])} is not an earlier node (0..{i - 1})"
        )
    return valid


def valid_mask(num_nodes: Tensor | None, B: int, N: int, device: torch.device) -> Tensor:
    """bool [B, N]: node i of sequence b is real (i < num_nodes[b])."""
    ar = torch.arange(N, device=device)
    if num_nodes is None:
        return torch.ones(B, N, dtype=torch.bool, device=device)
    return ar[None, :] < num_nodes.to(device)[:, None]


def draw_coins(
    B: int,
    N: int,
    device: torch.device,
    coins: Tensor | None,
    final_coins: Tensor | None,
    generator: torch.Generator | None,
) -> tuple[Tensor, Tensor]:
    """Uniforms for the acceptance tests ([B, N]) and the final draw ([B]); missing ones come from `generator`,
    coins first, so that every implementation sees the same numbers for the same generator state."""
    # drawn on the generator's own device, then moved: a CPU generator drives a CUDA verify, and one seed gives
    # the same coins on every device
    gen_device = generator.device if generator is not None else device
    if coins is None:
        coins = torch.rand(B, N, generator=generator, device=gen_device)
    if final_coins is None:
        final_coins = torch.rand(B, generator=generator, device=gen_device)
    return coins.to(device=device, dtype=torch.float32), final_coins.to(device=device, dtype=torch.float32)


def verdict_from_accepted(
    accepted: Tensor, next_token: Tensor, node_prob: Tensor | Callable[[], Tensor]
) -> Verdict:
    """Build a Verdict from the per-node accepted flags (a root-to-node chain; indices grow with depth)."""
    B, N = accepted.shape
    count = accepted.sum(-1)  # [B], root included
    S = int(count.max()) if B > 0 else 1
    ar = torch.arange(N, device=accepted.device)
    order = torch.where(accepted, ar, N).sort(-1).values[:, :S]  # [B, S]
    path = torch.where(order == N, -1, order)
    return Verdict(
        path=path,
        accept_len=count - 1,
        next_token=next_token.to(torch.int64),
        accepted=accepted,
        node_prob_source=node_prob,
    )
