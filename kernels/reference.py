"""Torch reference for tree verification: the oracle for the Triton kernels and the CPU path.

Lossless multi-draft rejection sampling over a token tree:
  SpecInfer (Miao et al. 2023, arXiv 2305.09781), Sec. 4 "multi-step speculative sampling";
  EAGLE (Li et al. 2024, arXiv 2401.15077), tree verification with draft distributions.
Semantics are fixed by DESIGN.md "Verification semantics"; symbols: p = target distribution (processed),
q = draft distribution, x = a child's token, r = current residual.

Logit processing follows Hugging Face's warper order: temperature (as z = logits * fp32(1/T), which the Triton
kernel reproduces bit for bit), top-k, top-p on the top-k-renormalised softmax, softmax. Ties: top-k keeps every
token equal to the k-th largest scaled logit; top-p keeps token t iff the probability mass of tokens with a strictly
larger scaled logit is < top_p (tied tokens are kept or dropped together; HF keeps an arbitrary subset).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.common import (
    Verdict,
    VerifyBuffers,
    check_sampling_settings,
    check_tensor,
    draw_coins,
    is_greedy,
    raise_bad_logits,
    valid_mask,
    verdict_from_accepted,
)

_ARGMAX_CHUNK = 1024
_SMALL_WALK = 2048  # B * N up to which the greedy walk runs in plain Python on CPU


def process_logits(logits: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Processed target distribution: softmax(top_p(top_k(logits / T))) in fp32, over the last dim.

    logits: [..., V] (any float dtype); returns float32 [..., V]. temperature 0 (or below
    ``kernels.common.MIN_TEMPERATURE``) means greedy: the one-hot of the (first) argmax. Also the sampler for plain
    autoregressive steps. Settings out of range raise TypeError / ValueError (``check_sampling_settings``); on the
    CPU a row with a NaN, a +inf, no finite logit, or logits * fp32(1/T) overflowing float32 raises ValueError
    (found from the result: such a row's softmax is NaN throughout, so one element per row tells; on a GPU the
    check would read a flag back, and is not made).
    """
    check_sampling_settings(temperature, top_k, top_p)
    check_tensor("logits", logits, "floating")
    if logits.dim() == 0 or logits.shape[-1] < 1:
        raise ValueError(f"logits {tuple(logits.shape)} must be [..., V] with V >= 1")
    cpu = logits.device.type == "cpu"
    if is_greedy(temperature):
        am = argmax_lastdim(logits)  # a NaN anywhere in a row is its argmax (as torch.argmax)
        if cpu:
            _check_rows(logits, ~torch.isfinite(logits.gather(-1, am[..., None])[..., 0]), temperature)
        return torch.nn.functional.one_hot(am, logits.shape[-1]).to(torch.float32)
    p = sampling_distribution(logits, temperature, top_k, top_p)
    if cpu:
        _check_rows(logits, p[..., 0].isnan(), temperature)
    return p


def _check_rows(logits: Tensor, bad: Tensor, temperature: float, suffix: str = "") -> None:
    """Raise ValueError for the first row of ``logits`` [..., V] flagged in ``bad`` [...] (``raise_bad_logits``;
    ``suffix``: more index of the row, after the flag's)."""
    if bool(bad.any()):
        at = tuple(int(i) for i in bad.nonzero()[0])
        where = f"[{', '.join(map(str, at))}{suffix}]" if at or suffix else ""  # a single row: no index
        raise_bad_logits(logits[at], where, temperature)


def sampling_distribution(logits: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """``process_logits`` at a sampling temperature (>= ``MIN_TEMPERATURE``), unchecked: the walk's inner step.
    A row with a NaN, a +inf, no finite logit, or an overflowing logits * fp32(1/T) comes out NaN throughout."""
    V = logits.shape[-1]
    z = logits.float() * (1.0 / temperature)  # z: [..., V]; times fp32(1/T), exactly as the Triton kernel
    if 0 < top_k < V:
        kth = torch.topk(z, top_k, dim=-1).values[..., -1:]  # [..., 1]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        zs, order = z.sort(dim=-1, descending=True)  # zs: [..., V]
        ps = torch.softmax(z, dim=-1).gather(-1, order)
        # before: mass strictly before each sorted position
        before = torch.cat([torch.zeros_like(ps[..., :1]), torch.cumsum(ps, dim=-1)[..., :-1]], dim=-1)
        pos = torch.arange(V, device=z.device).expand_as(zs)
        is_start = torch.ones_like(zs, dtype=torch.bool)
        is_start[..., 1:] = zs[..., 1:] != zs[..., :-1]
        start = torch.where(is_start, pos, 0).cummax(dim=-1).values  # first position of each tie group
        keep_sorted = (before.gather(-1, start) < top_p) | (start == 0)
        keep = torch.empty_like(keep_sorted).scatter_(-1, order, keep_sorted)
        z = z.masked_fill(~keep, float("-inf"))
    return torch.softmax(z, dim=-1)


def argmax_lastdim(x: Tensor) -> Tensor:
    """torch.argmax(x, -1) (first index of the maximum), faster on CPU for long rows: torch's argmax is not
    vectorized there, amax is, so take block maxima and search only the first block holding the row maximum."""
    V = x.shape[-1]
    if x.device.type != "cpu" or V < 4 * _ARGMAX_CHUNK or x.numel() == 0:
        return x.argmax(-1)
    lead = x.shape[:-1]
    rows = x.reshape(-1, V).contiguous()  # rows: [R, V]
    R = rows.shape[0]
    nb = V // _ARGMAX_CHUNK
    blocks = rows.as_strided((R, nb, _ARGMAX_CHUNK), (V, _ARGMAX_CHUNK, 1))  # [R, nb, C]
    bmax = blocks.amax(-1)  # [R, nb]
    tail = rows[:, nb * _ARGMAX_CHUNK :]  # [R, V % C]
    rmax = bmax.amax(-1)
    if tail.shape[-1] > 0:
        rmax = torch.maximum(rmax, tail.amax(-1))
    # [R, nb]; a NaN block maximum counts as a hit: NaN is the row maximum then (amax and torch.argmax propagate it)
    hit = (bmax == rmax[:, None]) | bmax.isnan()
    in_blocks = hit.any(-1)
    b = hit.to(torch.uint8).argmax(-1)  # first block holding the maximum
    r = torch.arange(R, device=x.device)
    idx = blocks[r, b].argmax(-1) + b * _ARGMAX_CHUNK
    if tail.shape[-1] > 0:  # (no test of in_blocks.all() first: that would read a flag back to the host)
        idx = torch.where(in_blocks, idx, tail.argmax(-1) + nb * _ARGMAX_CHUNK)
    return idx.reshape(lead)


def verify_reference(
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
    """Verify a batch of padded draft trees (DESIGN.md "Verification semantics").

    tokens, parents: int64 [B, N]; logits: [B, N, V] (row i predicts the token after node i);
    draft_probs: [B, N, V] or None (deterministic drafts); coins: [B, N], final_coins: [B] uniforms in [0, 1),
    drawn from `generator` (coins first) when not given; greedy draws none. ``out``: `kernels.VerifyBuffers` to
    write the results into (path [B, N], -1 padded); greedy then runs as tensor operations that read nothing back
    to the host (the form a captured step needs; on the CPU the list walk of small batches is faster).
    """
    B, N = tokens.shape
    device = logits.device
    if out is not None:
        out.check(B, N, logits.shape[-1], device, draft_probs is not None)
        if num_nodes is None:
            num_nodes = out.all_nodes
    valid = valid_mask(num_nodes, B, N, device)  # [B, N]
    par = torch.where(valid, parents, 0).clamp(min=0)  # [B, N]; root and padding point at the root
    if is_greedy(temperature):
        v = _verify_greedy(tokens, par, logits, valid, lists=out is None)
    else:
        coins, final_coins = draw_coins(B, N, device, coins, final_coins, generator)
        v = _verify_sampling(
            tokens, par, logits, valid, temperature, top_k, top_p, draft_probs, coins, final_coins
        )
    return v if out is None else _into(v, out)


def _into(v: Verdict, out: VerifyBuffers) -> Verdict:
    """Copy a Verdict into preallocated buffers (its path padded to N with -1); node probabilities stay computed
    on first access, as without buffers (on the CPU they cost more than the verification)."""
    S = v.path.shape[1]
    out.path[:, :S].copy_(v.path)
    out.path[:, S:] = -1
    out.accept_len.copy_(v.accept_len)
    out.next_token.copy_(v.next_token)
    out.accepted.copy_(v.accepted)
    return Verdict(out.path, out.accept_len, out.next_token, out.accepted, v.node_prob_source)


def _verify_greedy(tokens: Tensor, par: Tensor, logits: Tensor, valid: Tensor, lists: bool = True) -> Verdict:
    B, N, V = logits.shape
    am = argmax_lastdim(logits)  # am: [B, N], argmax of each row (a NaN where the row holds one)
    if (
        lists and logits.device.type == "cpu"
    ):  # each real row's maximum finite (not into buffers: a read back)
        _check_rows(logits, valid & ~torch.isfinite(logits.gather(-1, am[..., None])[..., 0]), 0.0)
    small = lists and logits.device.type == "cpu" and B * N <= _SMALL_WALK
    if small:
        path, accept_len, next_token, accepted = greedy_walk_lists(tokens, par, am, valid)
    else:
        ok = (tokens == am.gather(1, par)) & valid  # node's token is its parent's argmax
        accepted = first_ok_chain(ok, par)
        last = torch.where(accepted, torch.arange(N, device=logits.device), 0).amax(-1)  # [B]
        next_token = am.gather(1, last[:, None])[:, 0]

    def node_prob() -> Tensor:
        x = logits.float()  # x: [B, N, V]
        m = x.amax(-1)  # [B, N]
        s = torch.exp(x - m[..., None]).sum(-1)
        flat = (torch.arange(B, device=x.device)[:, None] * N + par) * V + tokens.clamp(0, V - 1)
        lx = x.reshape(-1)[flat]  # [B, N]: logit of each node's token under its parent row
        p = torch.exp(lx - m.gather(1, par)) / s.gather(1, par)
        p[:, 0] = 1.0
        return torch.where(valid, p, 0.0)

    if small:
        return Verdict(path, accept_len, next_token, accepted, node_prob)
    if not lists:  # the full-width path: no maximum read back
        order = torch.where(accepted, torch.arange(N, device=logits.device), N).sort(-1).values
        path = torch.where(order == N, -1, order)
        return Verdict(path, accepted.sum(-1) - 1, next_token, accepted, node_prob)
    return verdict_from_accepted(accepted, next_token, node_prob)


def greedy_walk_lists(tokens: Tensor, par: Tensor, am: Tensor, valid: Tensor) -> tuple[Tensor, ...]:
    """Greedy tree walk in plain Python for small CPU batches (a few torch ops cost more than the walk).
    Scans nodes in index order: node i is tried iff its parent is the current node. Returns (path [B, S],
    accept_len [B], next_token [B], accepted [B, N]); same result as `first_ok_chain`."""
    B, N = tokens.shape
    if B == 0:  # no sequences: empty results of the usual shapes (a path of the root's width)
        return (torch.full((0, 1), -1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                torch.zeros(0, dtype=torch.int64), torch.zeros(0, N, dtype=torch.bool))  # fmt: skip
    tok_l, par_l, am_l, n_l = tokens.tolist(), par.tolist(), am.tolist(), valid.sum(-1).tolist()
    paths: list[list[int]] = []
    nxt: list[int] = []
    for b in range(B):
        tok_b, par_b, am_b = tok_l[b], par_l[b], am_l[b]
        cur, path = 0, [0]
        for i in range(1, n_l[b]):
            if par_b[i] == cur and tok_b[i] == am_b[cur]:
                cur = i
                path.append(i)
        paths.append(path)
        nxt.append(am_b[cur])
    S = max(len(p) for p in paths)
    path_t = torch.tensor([p + [-1] * (S - len(p)) for p in paths], dtype=torch.int64)
    accepted = torch.zeros(B, N, dtype=torch.bool)
    accepted[[b for b, p in enumerate(paths) for _ in p], [i for p in paths for i in p]] = True
    accept_len = torch.tensor([len(p) - 1 for p in paths], dtype=torch.int64)
    return path_t, accept_len, torch.tensor(nxt, dtype=torch.int64), accepted


def first_ok_chain(ok: Tensor, par: Tensor) -> Tensor:
    """bool [B, N]: nodes on the accepted path when node i would be accepted on its own iff ok[i] (greedy:
    token == argmax of the parent row). A node is accepted iff its parent is, it is ok, and no earlier sibling
    is ok (siblings are tried in increasing index and the first ok one wins). Vectorized over B."""
    B, N = ok.shape
    ar = torch.arange(N, device=ok.device)
    # earlier_ok[b, i]: some j < i with the same parent is ok. same: [B, N, N] over (i, j)
    same = (par[:, :, None] == par[:, None, :]) & ((ar[None, :] < ar[:, None]) & (ar[None, :] > 0))[None]
    earlier_ok = (same & ok[:, None, :]).any(-1)
    good = ok & ~earlier_ok
    good[:, 0] = True
    # pointer jumping: accepted[i] = AND of good over i and its ancestors
    acc, ptr = good, par
    for _ in range(max(1, (N - 1).bit_length())):
        acc = acc & acc.gather(1, ptr)
        ptr = ptr.gather(1, ptr)
    return acc


def _verify_sampling(
    tokens: Tensor,
    par: Tensor,
    logits: Tensor,
    valid: Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    draft_probs: Tensor | None,
    coins: Tensor,
    final_coins: Tensor,
) -> Verdict:
    B, N, V = logits.shape
    device = logits.device
    rows = torch.arange(B, device=device)

    def node_prob() -> Tensor:  # computed on first access: it needs every row processed
        probs = sampling_distribution(logits, temperature, top_k, top_p)  # p: [B, N, V]
        p = probs[rows[:, None], par, tokens.clamp(0, V - 1)]  # [B, N]
        p[:, 0] = 1.0
        return torch.where(valid, p, 0.0)

    # Scan nodes in index order: node i is tried iff its parent is the current node (children of the current
    # node come in increasing index, and every child of an accepted node has a larger index than it). Rows are
    # processed only when the walk descends into them.
    def processed(i: int, used: Tensor) -> Tensor:  # p of rows i [B, V]; the rows ``used`` must be defined
        p = sampling_distribution(logits[:, i], temperature, top_k, top_p)
        if cpu:  # (on a GPU a read back: not made, as process_logits makes none)
            _check_rows(logits[:, i], used & p[:, 0].isnan(), temperature, suffix=f", {i}")
        return p

    cpu = device.type == "cpu"

    cur = torch.zeros(B, dtype=torch.int64, device=device)
    r = processed(0, valid[:, 0])  # residual at the current node: [B, V]
    accepted = torch.zeros(B, N, dtype=torch.bool, device=device)
    accepted[:, 0] = True
    for i in range(1, N):
        tried = (par[:, i] == cur) & valid[:, i]  # [B]
        if not bool(tried.any()):
            continue
        x = tokens[:, i].clamp(0, V - 1)[:, None]  # [B, 1]
        rx = r.gather(1, x)[:, 0]
        if draft_probs is None:  # q = onehot(x): accept iff coin <= p[x]
            acc = tried & (coins[:, i] <= rx) & (rx > 0)
            nr = r.scatter(1, x, 0.0)  # p[x] = 0
        else:  # accept iff coin <= p[x] / q[x]; residual max(p - q, 0)
            q = draft_probs[:, i].float()  # q: [B, V]
            qx = q.gather(1, x)[:, 0]
            if cpu and bool((tried & ~(qx > 0)).any()):  # p / 0 would accept always (checked on the CPU)
                b = int((tried & ~(qx > 0)).nonzero()[0, 0])
                raise ValueError(
                    f"draft_probs[{b}, {i}, {int(x[b, 0])}] = {float(qx[b])!r}: node {i} was drawn from it, so its "
                    "token's probability must be > 0"
                )
            acc = tried & (coins[:, i] <= rx / qx) & (rx > 0)
            nr = (r - q).clamp(min=0.0)
        rej = tried & ~acc
        if bool(rej.any()):
            s = nr.sum(-1, keepdim=True)  # [B, 1]
            upd = rej[:, None] & (s > 0)  # an all-zero residual (rounding) keeps the old one
            r = torch.where(upd, nr / s, r)
        if bool(acc.any()):
            cur = torch.where(acc, i, cur)
            r = torch.where(acc[:, None], processed(i, acc), r)
            accepted[:, i] = acc
    next_token = inverse_cdf(r, final_coins)
    return verdict_from_accepted(accepted, next_token, node_prob)


def inverse_cdf(r: Tensor, u: Tensor) -> Tensor:
    """min{t : sum_{j<=t} r_j > u * sum(r)} per row (token-id order); if rounding leaves no such t, the last
    token with r_t > 0. r: [B, V] non-negative, u: [B] in [0, 1). Returns int64 [B]."""
    V = r.shape[-1]
    cs = torch.cumsum(r, dim=-1)  # [B, V]
    thr = u * cs[:, -1]
    idx = (cs <= thr[:, None]).sum(-1)
    over = idx >= V
    if bool(over.any()):
        last_pos = V - 1 - (r > 0).flip(-1).to(torch.uint8).argmax(-1)
        idx = torch.where(over, last_pos, idx)
    return idx
