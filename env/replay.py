"""Trace replay as pure functions, shared by the single env (one episode, numpy scalars) and the vector env
(batches, numpy or torch on any device).

For greedy decoding the committed text does not depend on the drafts, so one recorded trajectory serves every
arm: an arm's tree at position g is ``prune(recorded largest tree, arm.shape)`` (``drafters.trees.prune_indices``
rules) and its accepted length is the greedy walk of that tree along the trajectory (descend into the first child
whose token is the next trajectory token, as ``kernels.verify`` does with the target's argmax). Replay is exact for
drafters whose proposal *is* that pruning (``exact`` in the trace header: the n-gram drafter) and approximate for
stateful ones.

Near the end of the context replay applies the live engine's rule (``env.batch.BatchEngine.propose``): a tree of
more nodes than the row's room (``max_context`` in the trace header minus the past length) is replaced by the root
alone, so that step accepts nothing, commits one token and is priced as a one-node chain. A trace recorded before
the header held ``max_context`` is replayed with an unlimited context.

``build_tables`` evaluates every (arm, position) once, vectorized over the whole trace, into ``ReplayTables``
(walk length, tokens, reward, episode end, history inputs); a replay step is then a handful of table lookups
(``replay_step``), and the observation comes from ``env.features.assemble`` like the live one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, NamedTuple

import numpy as np
import torch

from drafters import TreeShape
from drafters.trees import prune_indices
from env.cost import FittedCostModel
from env.engine import Arm
from env.features import (
    DRAFT_DEPTH,
    DRAFT_WIDTH,
    history_columns,
    history_inputs,
    history_update,
    menu_drafters,
)
from env.trace import Trace, TraceError


@dataclass(frozen=True)
class ReplayTables:
    """Everything a replay step reads. ``T`` positions (all prompts), ``K`` arms, ``P`` prompts."""

    # accept, drafted: 0 at a position where arm k's tree does not fit the context (live: the root alone)
    accept: Any  # int64 [K, T] greedy walk length of arm k's tree at position g (bonus excluded, uncut)
    drafted: Any  # int64 [K, T] draft nodes in that tree
    rejected: Any  # bool [K, T] that walk ends at a node with children (a draft rejected), not at a leaf
    cost: Any  # float32 [K, T] seconds of the step (cost model)
    ar_cost: Any  # float32 [T] seconds of one autoregressive token there
    # the step's outcome, evaluated once per (arm, position) for the env's max_new_tokens:
    tokens: Any  # int64 [K, T] committed tokens that count (accepted + bonus, cut at the episode's end)
    accepted: Any  # int64 [K, T] accepted drafts among them
    reward: Any  # float32 [K, T] tokens * ar_cost / cost (env.metrics.step_reward)
    ends: Any  # int8 [K, T] 0: the episode goes on, 1: terminated (end of sequence), 2: truncated
    hist_in: Any  # float32 [5, K, T] the step's env.features.history_inputs
    feat: Any  # float32 [T, 4 + P] position features
    offset: Any  # int64 [P] global index of each prompt's position 0
    length: Any  # int64 [P] positions per episode: min(trajectory length, max_new_tokens)
    eos: Any  # bool [P] the episode ends with end of sequence (else at max_new_tokens)
    arm_depth: Any  # int64 [K]
    cols: Any  # history columns shown in the observation (a slice, or int64 indices)
    startable: Any  # int64 [P'] prompts with at least one step to take
    max_new_tokens: int
    max_tokens: int  # deepest arm + 1 (normalizes ``last_tokens``)
    decay: float

    def to(self, device: str | torch.device) -> ReplayTables:
        """The tables as torch tensors on ``device`` (for the vector env on a GPU or in torch on CPU)."""
        conv = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, np.ndarray):
                conv[f.name] = torch.as_tensor(v, device=device)
        return replace(self, **conv)


# ---- per-tree reference: the definition the vectorized tables are tested against ---------------------------


def greedy_walk(tokens: Sequence[int], parents: Sequence[int], continuation: Sequence[int]) -> int:
    """Accepted length of a tree whose root is followed by ``continuation`` (the trajectory after the root)."""
    return _walk(tokens, parents, continuation)[1]


def _walk(tokens: Sequence[int], parents: Sequence[int], continuation: Sequence[int]) -> tuple[int, int]:
    """(the node the greedy walk ends at, its depth)."""
    cur, depth = 0, 0
    n = len(tokens)
    while depth < len(continuation):
        nxt = next(
            (
                c
                for c in range(cur + 1, n)
                if int(parents[c]) == cur and int(tokens[c]) == continuation[depth]
            ),
            None,
        )
        if nxt is None:
            break
        cur, depth = nxt, depth + 1
    return cur, depth


def replay_accept(
    tokens: Sequence[int], parents: Sequence[int], continuation: Sequence[int], arm: Arm
) -> tuple[int, int, bool, bool]:
    """(accepted, draft nodes, is chain, rejected) of ``arm`` on one recorded tree: prune, then walk; rejected: the
    walk ends at a node with children."""
    if arm.drafter is None or arm.shape.depth == 0:
        return 0, 0, True, False
    keep = prune_indices(list(parents), arm.shape)
    remap = {old: new for new, old in enumerate(keep)}
    toks = [int(tokens[i]) for i in keep]
    pars = [-1] + [remap[int(parents[i])] for i in keep[1:]]
    chain = pars == list(range(-1, len(keep) - 1))
    end, accepted = _walk(toks, pars, continuation)
    return accepted, len(keep) - 1, chain, end in pars


# ---- vectorized over a whole trace ---------------------------------------------------------------------------------


def tree_index(trace: Trace, name: str) -> dict[str, np.ndarray]:
    """Per node of drafter ``name``'s recorded trees: position, global parent, depth, child rank, max rank on the
    root path, and whether its token is the trajectory's token at its depth. Cached on the trace."""
    key = ("tree_index", name)
    if key in trace.cache:
        return trace.cache[key]
    t = trace.trees[name]
    m, npos = t.tokens.shape[0], t.off.shape[0] - 1
    sizes = np.diff(t.off)
    pos = np.repeat(np.arange(npos), sizes)  # [M] position of each node
    par = t.parents.astype(np.int64)
    gpar = np.where(par >= 0, t.off[pos] + par, -1)  # [M] global parent index
    depth = np.zeros(m, dtype=np.int64)
    maxrank = np.zeros(m, dtype=np.int64)
    rank = np.zeros(m, dtype=np.int64)
    nonroot = np.flatnonzero(par >= 0)
    # child rank: order among the nodes sharing a global parent (nodes are in increasing index within a tree)
    gp = gpar[nonroot]
    # siblings are not necessarily contiguous: rank by a stable sort on the parent
    order = np.argsort(gp, kind="stable")
    sp = gp[order]
    starts = (
        np.concatenate([[0], np.flatnonzero(sp[1:] != sp[:-1]) + 1]) if sp.size else np.zeros(0, np.int64)
    )
    run = np.zeros(sp.size, dtype=np.int64)
    if sp.size:
        run[starts] = 1
        grp = np.cumsum(run) - 1
        r = np.arange(sp.size) - starts[grp]
        rank[nonroot[order]] = r
    # depth and max rank along the root path, by pointer doubling (O(M log depth), whatever the trees' shapes):
    # after i rounds up[v] is the node 2^i steps above v (its root when fewer), depth[v] the steps to it, maxrank[v]
    # the largest rank from v up to it (a root's rank is 0 and its up itself: rounds change nothing there)
    up = np.where(par >= 0, gpar, np.arange(m))
    depth[nonroot] = 1
    maxrank[:] = rank
    while (up[up] != up).any():
        depth, maxrank, up = depth + depth[up], np.maximum(maxrank, maxrank[up]), up[up]
    # trajectory match: node at depth d of position g predicts traj[g + d] (same prompt only)
    prompt_of_pos = np.searchsorted(trace.traj_off, np.arange(npos), side="right") - 1
    end = trace.traj_off[prompt_of_pos + 1][pos]  # [M] end of the node's prompt trajectory
    tgt = pos + depth
    inside = tgt < end
    match = np.zeros(m, dtype=bool)
    match[inside] = t.tokens[inside] == trace.traj[tgt[inside]]
    out = {"pos": pos, "gpar": gpar, "depth": depth, "rank": rank, "maxrank": maxrank, "match": match}
    trace.cache[key] = out
    return out


def arm_columns(trace: Trace, arm: Arm) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(accepted [T], draft nodes [T], is chain [T], rejected [T]) of ``arm`` at every position of the trace,
    vectorized; rejected: the greedy walk ends at a node with children (a draft was rejected), not at a leaf."""
    npos = trace.traj.shape[0]
    if arm.drafter is None or arm.shape.depth == 0:
        z = np.zeros(npos, dtype=np.int32)
        return z, z.copy(), np.ones(npos, dtype=bool), np.zeros(npos, dtype=bool)
    if arm.drafter not in trace.trees:
        raise TraceError(
            f"arm {arm.name} needs drafter {arm.drafter!r}, which the trace did not record "
            f"(it has: {', '.join(sorted(trace.trees)) or 'none'})"
        )
    d, k, b = trace.drafters[arm.drafter]["shape"]
    rec = TreeShape(depth=int(d), topk=int(k), budget=int(b))
    s = arm.shape
    if s.depth > rec.depth or s.topk > rec.topk or (rec.budget and s.max_nodes > rec.max_nodes):
        raise TraceError(
            f"arm {arm.name} is larger than the trees the trace recorded for {arm.drafter} "
            f"(depth {rec.depth}, topk {rec.topk}); record with a larger drafter shape"
        )
    ix = tree_index(trace, arm.drafter)
    t = trace.trees[arm.drafter]
    nonroot = ix["gpar"] >= 0
    alive = nonroot & (ix["depth"] <= s.depth) & (ix["maxrank"] < s.topk)
    # budget: the first max_nodes surviving draft nodes of each tree, in node order
    csum = np.cumsum(alive)
    before = np.concatenate([[0], csum])[t.off[:-1]]  # survivors before each tree
    alive &= (csum - before[ix["pos"]]) <= s.max_nodes
    drafted = np.bincount(ix["pos"][alive], minlength=npos).astype(np.int32)
    # greedy walk, one depth level at a time: on the path = alive, matching, parent on the path (root is), and the
    # first such child of that parent
    on = np.zeros(alive.shape[0], dtype=bool)
    on[~nonroot] = True
    cand = alive & ix["match"]
    accept = np.zeros(npos, dtype=np.int32)
    end = t.off[:-1].astype(np.int64)  # the walk's last node per tree: its root until a level extends it
    for level in range(1, s.depth + 1):
        c = np.flatnonzero(cand & (ix["depth"] == level))
        if not c.size:
            break
        c = c[on[ix["gpar"][c]]]
        if not c.size:
            break
        _, first = np.unique(ix["gpar"][c], return_index=True)
        c = c[first]
        on[c] = True
        accept[ix["pos"][c]] = level
        end[ix["pos"][c]] = c
    branching = alive & (ix["rank"] > 0)
    chain = np.bincount(ix["pos"][branching], minlength=npos) == 0
    has_child = np.zeros(alive.shape[0], dtype=bool)
    has_child[ix["gpar"][alive]] = True
    return accept, drafted, chain, has_child[end]


def _position_features(trace: Trace, arms: Sequence[Arm], draft: bool) -> np.ndarray:
    """The trace's position features [T, 4 + P], then (``draft``) each menu drafter's width and depth [T, 2]."""
    feat = trace.feat.astype(np.float32)
    spec = replace(trace.spec, draft_features=draft)
    names = [a.name for a in arms]
    depths = [0 if a.drafter is None else a.shape.depth for a in arms]
    extra = []
    for name in menu_drafters(spec, names, depths):
        if name not in trace.trees:
            raise TraceError(f"draft features need drafter {name!r}'s trees, which the trace did not record")
        ix = tree_index(trace, name)
        npos = trace.trees[name].off.shape[0] - 1
        width = np.bincount(ix["pos"][ix["depth"] == 1], minlength=npos)
        depth = np.zeros(npos, dtype=np.int64)
        np.maximum.at(depth, ix["pos"], ix["depth"])
        extra.append(
            np.stack([np.minimum(width / DRAFT_WIDTH, 1.0), np.minimum(depth / DRAFT_DEPTH, 1.0)], 1)
        )
    return np.concatenate([feat, *extra], axis=1).astype(np.float32) if extra else feat


def observed_proposals(
    trace: Trace, arms: Sequence[Arm], draft_features: bool
) -> tuple[list[Arm], dict[str, TreeShape]]:
    """With draft features, the proposals each observation makes (the menu's drafters', as arms of their recorded
    largest shapes), and of those the exact drafters' largest shapes, which an arm's tree is cut from; else none."""
    spec = replace(trace.spec, draft_features=draft_features)
    names = menu_drafters(
        spec, [a.name for a in arms], [0 if a.drafter is None else a.shape.depth for a in arms]
    )
    missing = [n for n in names if n not in trace.header["drafters"]]
    if missing:
        raise TraceError(
            f"draft features need drafter {missing[0]!r}'s trees, which the trace did not record"
        )
    shapes = {n: TreeShape(*(int(x) for x in trace.header["drafters"][n]["shape"])) for n in names}
    exact = {n: s for n, s in shapes.items() if trace.header["drafters"][n].get("exact")}
    return [Arm(n, s) for n, s in shapes.items()], exact


def build_tables(
    trace: Trace,
    arms: Sequence[Arm],
    cost_model: FittedCostModel,
    max_new_tokens: int | None = None,
    decay: float | None = None,
    draft_features: bool = False,
) -> ReplayTables:
    """Evaluate every arm at every position of ``trace`` (cached on the trace per arm). ``draft_features``: append
    the menu's drafters' ``draft/<d>/width, depth`` (``env.features``) to the position features, from the
    recorded trees. Where an arm's tree does not fit the context the trace recorded (``Trace.max_context``), the
    step is the root alone, as live (``env.batch.BatchEngine.propose``)."""
    max_new = trace.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
    if not 2 <= max_new <= trace.max_new_tokens:
        raise TraceError(
            f"max_new_tokens must be in 2..{trace.max_new_tokens} (what the trace recorded), got {max_new}"
        )
    npos = trace.traj.shape[0]
    k = len(arms)
    accept = np.zeros((k, npos), dtype=np.int64)
    drafted = np.zeros((k, npos), dtype=np.int64)
    rejected = np.zeros((k, npos), dtype=bool)
    cost = np.zeros((k, npos), dtype=np.float32)
    prompt_of_pos = np.searchsorted(trace.traj_off, np.arange(npos), side="right") - 1
    context = trace.prompt_len[prompt_of_pos] + (
        np.arange(npos) - trace.traj_off[prompt_of_pos]
    )  # past length
    # live (env.batch.BatchEngine.propose): a tree of more nodes than room = max_context - past length is replaced
    # by the root alone (nothing drafted or accepted, a chain, no draft rejected); None: an unlimited context
    room = None if trace.max_context is None else trace.max_context - context
    observed, exact = observed_proposals(trace, arms, draft_features)
    observe_cost = sum(cost_model.draft_cost(a) for a in observed)
    for i, arm in enumerate(arms):
        key = ("arm", arm)
        if key not in trace.cache:
            trace.cache[key] = arm_columns(trace, arm)
        acc, dr, chain, rej = trace.cache[key]  # as recorded (uncut): the cache does not depend on the room
        if room is not None:
            cut = dr + 1 > room
            if cut.any():
                acc, dr = np.where(cut, 0, acc), np.where(cut, 0, dr)
                chain, rej = chain | cut, rej & ~cut
        accept[i], drafted[i], rejected[i] = acc, dr, rej
        # as live (env.step.StepCosts): the observation's proposals are paid whichever arm runs, and an arm cut from
        # one of them (an exact drafter's, within its largest shape) drafts nothing more
        cut = arm.drafter in exact and arm.shape.fits(exact[arm.drafter])
        step = (
            cost_model.verify_cost(dr + 1, context, chain)
            if cut
            else cost_model.step_cost(arm, dr + 1, context, chain)
        )
        cost[i] = step + observe_cost
    lengths = np.minimum(np.diff(trace.traj_off), max_new)
    eos_ids = np.asarray(trace.header["model"]["eos_ids"])
    last = trace.traj[np.maximum(trace.traj_off[:-1] + lengths - 1, 0)]
    eos = np.isin(last, eos_ids) & (lengths > 0)
    depths = np.array([0 if a.drafter is None else a.shape.depth for a in arms], dtype=np.int64)
    max_tokens = int(depths.max(initial=0)) + 1
    decay = float(trace.spec.decay if decay is None else decay)
    ar_cost = np.asarray(cost_model.ar_cost(context), dtype=np.float32)
    # outcomes: a step at position t of prompt p may commit up to rem = length - 1 - t more tokens
    t = np.arange(npos) - trace.traj_off[prompt_of_pos]
    rem = np.maximum(lengths[prompt_of_pos] - 1 - t, 0)  # [T]
    tokens = np.minimum(accept + 1, rem)  # [K, T]
    accepted = np.minimum(accept, tokens)
    reward = (tokens * ar_cost / cost).astype(np.float32)
    done = tokens >= rem
    ends = np.where(done, np.where(eos[prompt_of_pos], 1, 2), 0).astype(np.int8)
    hist_in = np.stack(
        np.broadcast_arrays(*history_inputs(accepted, drafted, tokens, depths[:, None], max_tokens, decay))
    ).astype(np.float32)
    return ReplayTables(
        accept=accept,
        drafted=drafted,
        rejected=rejected,
        cost=cost,
        ar_cost=ar_cost,
        tokens=tokens,
        accepted=accepted,
        reward=reward,
        ends=ends,
        hist_in=hist_in,
        feat=_position_features(trace, arms, draft_features),
        offset=trace.traj_off[:-1].astype(np.int64),
        length=lengths.astype(np.int64),
        eos=eos,
        arm_depth=depths,
        cols=history_columns(depths.tolist()),
        startable=np.flatnonzero(lengths >= 2).astype(np.int64),
        max_new_tokens=max_new,
        max_tokens=max_tokens,
        decay=decay,
    )


# ---- one step, for one episode (numpy scalars) or a batch (numpy / torch arrays) -----------------------------------


class StepOut(NamedTuple):  # a tuple: cheap to build once per step
    tokens: Any  # committed tokens that count (up to end of sequence / max_new_tokens)
    accepted: Any  # accepted draft tokens among them
    drafted: Any
    cost_s: Any
    ar_cost_s: Any
    reward: Any  # tokens * ar_cost_s / cost_s (env.metrics.step_reward)
    pos: Any  # the new root's position
    terminated: Any  # end of sequence committed
    truncated: Any  # max_new_tokens reached


def replay_step(tb: ReplayTables, prompt, pos, hist, rows, action) -> StepOut:
    """Apply ``action`` at ``(prompt, pos)``: table lookups, and ``hist[rows]`` updated in place."""
    g = tb.offset[prompt] + pos
    tokens = tb.tokens[action, g]
    ends = tb.ends[action, g]
    history_update(hist, rows, action, tb.hist_in[:, action, g])
    return StepOut(
        tokens=tokens,
        accepted=tb.accepted[action, g],
        drafted=tb.drafted[action, g],
        cost_s=tb.cost[action, g],
        ar_cost_s=tb.ar_cost[g],
        reward=tb.reward[action, g],
        pos=pos + tokens,
        terminated=ends == 1,
        truncated=ends == 2,
    )


def replay_observe(tb: ReplayTables, prompt, pos, hist_rows, out) -> Any:
    """The observation(s) at ``(prompt, pos)`` into ``out``."""
    from env.features import assemble

    frac = (pos + 1) / tb.max_new_tokens
    return assemble(frac, tb.feat[tb.offset[prompt] + pos], hist_rows, tb.cols, out)
