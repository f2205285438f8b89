"""The serving observation (``draftgym/SpecServe-v0``): load features, pooled and per-row request features, built
by one function (``serve_observation``) from per-row arrays — by the replay simulator (``env.serve_sim.ServeSim``)
and, through ``LiveObserver``, by the live server (``env.serving.serve(policy=...)``) — so a policy trained in
replay reads the same features live. The row block lists the active rows in slot order, as the live engine packs
them (``env.batch.BatchTarget.retire``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from env.batch_cost import step_context
from env.engine import Arm

DECAY = 0.8  # of the per-row acceptance estimate
CTX_NORM = 1024.0
LOAD_FEATURES = (
    "load/rows",
    "load/queue",
    "load/tokens_in_flight",
    "load/max_context",
    "load/rows_with_match",
)
POOLED_FEATURES = ("pool/alpha", "pool/last_accepted", "pool/match_depth", "pool/progress")
ROW_FEATURES = ("active", "context", "alpha", "last_accepted", "match_depth", "progress")
LAST_NORM, DEPTH_NORM = 8.0, 16.0


class ServeEnvError(ValueError):
    """A bad serving env argument or action; the message is meant for the user."""


def integer_actions(action: Any, k: int) -> np.ndarray:
    """``action`` as an array of arm indices, by the rule replay and the live server share: integers, or whole
    finite floats, not bools (their range is the caller's to check, before any cast: which entries count
    differs); anything else a ``ServeEnvError``."""
    try:
        a = np.asarray(action)
    except (ValueError, TypeError):  # ragged nesting
        a = np.asarray(None)
    if (
        a.dtype.kind not in "iuf"
        or a.size == 0
        or (a.dtype.kind == "f" and not (np.isfinite(a).all() and np.all(np.mod(a, 1) == 0)))
    ):
        raise ServeEnvError(
            f"actions must be integer arm indices (0..{k - 1}), got {' '.join(str(action).split())[:80]} ({a.dtype})"
        )
    return a


def feature_names(max_batch: int) -> list[str]:
    return [*LOAD_FEATURES, *POOLED_FEATURES] + [
        f"row{i}/{f}" for i in range(max_batch) for f in ROW_FEATURES
    ]


def obs_size(max_batch: int) -> int:
    return len(LOAD_FEATURES) + len(POOLED_FEATURES) + len(ROW_FEATURES) * max_batch


def obs_bounds(max_batch: int) -> tuple[np.ndarray, np.ndarray]:
    names = feature_names(max_batch)
    high = np.array(
        [4.0 if n.endswith(("queue", "context", "tokens_in_flight")) else 1.0 for n in names], np.float32
    )
    return np.zeros(len(names), np.float32), high


def alpha_estimate(s: Any, n: Any) -> Any:
    """Per-token acceptance estimate from decayed counts of accepted drafts ``s`` and trials ``n`` (an accepted
    draft token, or the first rejection of a step): the posterior mean under a uniform prior."""
    return (s + 1.0) / (n + 2.0)


def update_alpha(s: Any, n: Any, accepted: Any, drafted: Any, stopped: Any) -> tuple[Any, Any]:
    """One step's evidence into the decayed counts (rows that did not draft keep theirs): ``accepted`` successes,
    and one failure where ``stopped`` — a draft was rejected, the accepted path ending at a node with children.
    A walk that ends at a leaf ran out of draft (a chain fully accepted; in a tree, a branch shallower than the
    arm's depth fully accepted) and counts no failure."""
    drew = drafted > 0
    stopped = np.asarray(stopped, bool) & drew
    s2 = np.where(drew, DECAY * s + accepted, s)
    n2 = np.where(drew, DECAY * n + accepted + stopped, n)
    return s2, n2


def serve_observation(active, context, s, n, last_acc, match_depth, progress, queue, max_batch: int,
                      out: np.ndarray | None = None) -> np.ndarray:  # fmt: skip
    """The observation of ``E`` servers from per-row arrays ``[E, M]`` (``queue``: ``[E]`` requests arrived and
    waiting). The row block lists the active rows first, in slot order (as the live engine packs them), then
    zeros; pooled features are means over active rows."""
    a = np.asarray(active, bool)
    e, m = a.shape
    af = a.astype(np.float32)
    rows = af.sum(1)
    denom = np.maximum(rows, 1.0)
    ctx = np.asarray(context, np.float32) / CTX_NORM * af
    alpha = alpha_estimate(np.asarray(s, np.float32), np.asarray(n, np.float32)) * af
    last = np.minimum(np.asarray(last_acc, np.float32) / LAST_NORM, 1.0) * af
    depth = np.minimum(np.asarray(match_depth, np.float32) / DEPTH_NORM, 1.0) * af
    prog = np.minimum(np.asarray(progress, np.float32), 1.0) * af
    if out is None:
        out = np.empty((e, obs_size(max_batch)), np.float32)
    out[:, 0] = rows / max_batch
    out[:, 1] = np.minimum(np.asarray(queue, np.float32) / max_batch, 4.0)
    out[:, 2] = np.minimum(ctx.sum(1) / max_batch, 4.0)
    out[:, 3] = np.minimum(ctx.max(1), 4.0)
    out[:, 4] = (depth > 0).sum(1) / max_batch
    out[:, 5] = alpha.sum(1) / denom
    out[:, 6] = last.sum(1) / denom
    out[:, 7] = depth.sum(1) / denom
    out[:, 8] = prog.sum(1) / denom
    feats = (af, np.minimum(ctx, 4.0), alpha, last, depth, prog)  # each [E, m], slot order
    block = out[:, 9:].reshape(e, max_batch, len(ROW_FEATURES))
    block[:, m:] = 0.0
    if is_packed(a):  # the simulator's and the live engine's rows are
        for f, x in enumerate(feats):
            block[:, :m, f] = x
    else:  # the active rows to the front, in slot order (inactive rows are zeros: their order does not matter)
        block[np.arange(e)[:, None], packed_positions(a)] = np.stack(feats, axis=-1)
    return out


def is_packed(active: np.ndarray) -> bool:
    """Whether every server's active rows are slots 0..rows-1."""
    return bool((active[:, :-1] >= active[:, 1:]).all())


def packed_positions(active: np.ndarray) -> np.ndarray:
    """``[E, M]``: where each slot's row goes when the active rows are packed to the front in slot order."""
    on = np.cumsum(active, axis=1) - 1
    off = active.sum(1, keepdims=True) + np.cumsum(~active, axis=1) - 1
    return np.where(active, on, off)


def tree_depth(parents: Any) -> int:
    """The depth of a draft tree (0: the root alone); ``parents`` a list, an array or a tensor (read as one list:
    iterating a tensor costs a microsecond per element, and the n-gram drafter's largest trees hold hundreds)."""
    par = parents.tolist() if hasattr(parents, "tolist") else [int(p) for p in parents]
    depth = [0] * len(par)
    for i in range(1, len(par)):
        depth[i] = depth[par[i]] + 1
    return max(depth, default=0)


TABLE_DRAFTERS = ("ngram", "suffix", "recycling")  # propose from tables of the text: microseconds per row


def match_drafter(names: Sequence[str]) -> str | None:
    """The drafter whose longest proposal is the observation's match depth: the first of ``names`` (the menu's
    drafters) in ``TABLE_DRAFTERS``' order, else the first by name. A table drafter's match depth says how far the
    text repeats; a model head always proposes its full depth, and observing it costs a head pass per row."""
    names = sorted(set(names))
    return next((n for n in TABLE_DRAFTERS if n in names), names[0] if names else None)


class LiveObserver:
    """The serving observation of a live batch (``env.serving.serve`` with a policy): the same per-row arrays as
    ``ServeSim`` keeps, from the live sequences; the drafter's match depth is the depth of its largest proposal
    at the root (the proposal the step then verifies, pruned to the arm)."""

    def __init__(self, arms: Sequence[Arm], max_batch: int) -> None:
        self.arms, self.max_batch = list(arms), int(max_batch)
        self.drafters = sorted({a.drafter for a in self.arms if a.drafter is not None})
        self.match_drafter = match_drafter(self.drafters)
        self.stats: dict[int, list[float]] = {}  # id(seq) -> [s, n, last accepted]

    def observe(self, stepper: Any, queue: int) -> np.ndarray:
        m = self.max_batch
        cols = np.zeros((6, 1, m))  # context, s, n, last accepted, match depth, progress: per row slot
        active = np.zeros((1, m), bool)
        name = self.match_drafter
        for i, seq in enumerate(stepper.seqs[:m]):
            st = self.stats.setdefault(id(seq), [0.0, 0.0, 0.0])
            match = 0 if name is None else tree_depth(stepper.proposals(seq, [name])[name].parents)
            cols[:, 0, i] = (seq.context, st[0], st[1], st[2], match, len(seq.tokens) / seq.max_new_tokens)
        active[0, : min(len(stepper.seqs), m)] = True
        return serve_observation(active, *cols, np.array([queue]), m)[0]

    def choices(self, action: Any, rows: int) -> list[int]:
        """The arm index of each of the ``rows`` live rows from a policy's action: one arm for the batch or one
        per row slot (the first ``rows`` used), by the rule replay applies (``ServeSim._actions``): integers, or
        whole finite floats, not bools, in ``0..K-1``; anything else a ``ServeEnvError``."""
        k = len(self.arms)
        if (
            isinstance(action, (int, np.integer))
            and not isinstance(action, (bool, np.bool_))
            and 0 <= action < k
        ):
            return [
                int(action)
            ] * rows  # the common case, without the array checks (tens of microseconds a step)
        a = integer_actions(action, k).reshape(-1)
        if a.size != 1 and a.size not in (rows, self.max_batch):
            raise ServeEnvError(
                f"the policy chose {a.size} arms for {rows} rows; one, or one per row slot ({self.max_batch})"
            )
        picked = np.repeat(a, rows) if a.size == 1 else a[:rows]  # (range checked before any cast)
        if picked.size != rows or ((picked < 0) | (picked >= k)).any():
            raise ServeEnvError(f"the policy chose {a.tolist()} for {rows} rows; valid arms: 0..{k - 1}")
        return [int(c) for c in picked]

    def record(self, outcomes: Sequence[Any]) -> None:
        for o in outcomes:
            st = self.stats.setdefault(id(o.seq), [0.0, 0.0, 0.0])
            acc, dr = o.info["accepted"], o.info["drafted"]
            if dr > 0:  # ``update_alpha`` on one row, in Python floats (float64, as it computes them)
                st[0], st[1] = DECAY * st[0] + acc, DECAY * st[1] + acc + bool(o.result.rejected)
                st[2] = float(acc)

    def forget(self, seq: Any) -> None:
        self.stats.pop(id(seq), None)

    @staticmethod
    def reward(outcomes: Sequence[Any], wall_s: float, cost: Any) -> float:
        rows = len(outcomes)
        tokens = sum(o.info["tokens"] for o in outcomes)
        # priced at the context the step ran at (before it committed its path: counted or not), as replay prices it
        ctxs = np.array([[o.seq.context - len(o.result.committed) for o in outcomes]], np.float64)
        ctx = float(step_context(cost, ctxs, np.ones_like(ctxs, bool))[0]) if rows else 0.0
        ar = float(cost.forward_s(max(rows, 1), 1, ctx))
        return tokens * ar / (max(rows, 1) * wall_s) if wall_s > 0 else 0.0


__all__ = [
    "DEPTH_NORM",
    "LAST_NORM",
    "DECAY",
    "CTX_NORM",
    "LOAD_FEATURES",
    "POOLED_FEATURES",
    "ROW_FEATURES",
    "ServeEnvError",
    "feature_names",
    "match_drafter",
    "obs_size",
    "obs_bounds",
    "alpha_estimate",
    "update_alpha",
    "serve_observation",
    "is_packed",
    "packed_positions",
    "tree_depth",
    "LiveObserver",
]
