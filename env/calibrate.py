"""Calibration of the cost model (``env.cost``): ``calibrate`` measures this machine's verify phase on a grid of
node counts, chains and trees, at two contexts (through ``env.batch.BatchEngine.step``, a batch of one), and each
drafter's ``propose`` time per arm shape, and fits a ``FittedCostModel`` (``draftgym calibrate``). The pieces the
batch calibration (``env.batch_calibrate``) shares: the fixed-structure stand-in drafter, the tree structures, the
context text and the monotone fit.
"""

from __future__ import annotations

import datetime as dt
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from drafters import DraftContext, DraftTree, TreeShape, make_drafter
from env.cost import Curve, FittedCostModel
from env.engine import Arm
from env.machine import machine_info
from env.model import LoadedModel

CHAIN_NODES = (1, 2, 3, 5, 9, 13, 17, 25)
TREE_NODES = (3, 5, 9, 17, 25, 33, 49, 65, 129)
LARGE = 40  # trees above this many nodes are rarer and slower: measured half as often
CONTEXTS = (128, 768)
DRAFT_SHAPES = tuple(TreeShape(d, k) for d in (1, 2, 4, 8, 16) for k in (1, 2, 4, 8))


class _FixedTree:
    """A stand-in drafter proposing a tree of a given structure (random tokens): times the verify phase."""

    name = "_fixed"
    exact_replay = True

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.vocab = vocab
        self.gen = torch.Generator().manual_seed(seed)
        self.parents: list[int] = [-1]

    def reset(self, ctx: DraftContext) -> None:
        pass

    def propose(self, ctx: DraftContext, shape: TreeShape) -> DraftTree:
        n = len(self.parents)
        toks = torch.randint(0, self.vocab, (n,), generator=self.gen)
        toks[0] = ctx.tokens[-1]
        return DraftTree(tokens=toks, parents=torch.tensor(self.parents, dtype=torch.long))

    def observe(self, ctx: DraftContext, feedback: Any) -> None:
        pass


def tree_parents(nodes: int, chain: bool) -> list[int]:
    """A chain of ``nodes`` nodes, or a branching tree: a binary tree filled breadth first (two children under
    the root, two under each of them, ...) until it has ``nodes`` nodes; below 3 nodes, a chain."""
    if chain or nodes < 3:
        return list(range(-1, nodes - 1))
    parents = [-1]
    frontier = [0]
    while len(parents) < nodes:
        nxt = []
        for p in frontier:
            for _ in range(2):
                if len(parents) < nodes:
                    parents.append(p)
                    nxt.append(len(parents) - 1)
        frontier = nxt
    return parents


def _context_ids(tokenizer: Any, length: int) -> list[int]:
    from env.workloads import load_workload

    text = " ".join(p.text for p in load_workload())
    ids = [int(i) for i in tokenizer(text)["input_ids"]]
    while len(ids) < length:
        ids = ids + ids
    return ids[:length]


def _time_verify(
    loaded: LoadedModel,
    fixed: _FixedTree,
    prompts: Sequence[list[int]],
    grid: Sequence[tuple[int, bool]],
    reps: int,
    seed: int = 0,
    tick: Callable[[], object] = lambda: None,
) -> list[tuple[int, bool, float, float]]:
    """Median verify seconds per (nodes, chain, context): one sequence per context, every (context, cell)
    measured once per pass in a shuffled order, so that a drift in machine load spreads over all cells instead
    of biasing some. Returns [(nodes, chain, mean context, median s)]."""
    from env.batch import BatchEngine

    arm = Arm("_fixed", TreeShape(depth=1))
    engines = [BatchEngine(loaded, max_rows=1) for _ in prompts]  # one sequence each: single-row steps
    seqs = [e.admit(p, {"_fixed": fixed})[0] for e, p in zip(engines, prompts)]
    fixed.parents = [-1, 0]
    for e in engines:  # warm-up
        for _ in range(2):
            e.step([arm])
    cells = [(i, n, c) for i in range(len(seqs)) for n, c in grid]
    samples: dict[tuple[int, int, bool], list[tuple[int, float]]] = {cell: [] for cell in cells}
    rng = random.Random(seed)
    for r in range(reps):
        rng.shuffle(cells)
        for i, n, c in cells:
            if n > LARGE and r % 2:
                continue
            fixed.parents = tree_parents(n, c)
            ctx = seqs[i].past_len
            res = engines[i].step([arm])[0]
            if (
                res.drafted + 1 != n
            ):  # the engine verifies the root alone where a tree no longer fits the context
                from env.cost import CostModelError

                raise CostModelError(
                    f"a context of {ctx} tokens leaves no room for a tree of {n} nodes in the model's "
                    f"{loaded.max_context}: calibrate at shorter contexts or with fewer repetitions"
                )
            samples[(i, n, c)].append((ctx, res.verify_s))
            tick()
    return [
        (n, c, statistics.mean(x for x, _ in v), statistics.median(s for _, s in v))
        for (i, n, c), v in sorted(samples.items())
    ]


def isotonic(values: Sequence[float]) -> list[float]:
    """Least-squares non-decreasing fit (pool adjacent violators): more nodes never cost less."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [b[0] / b[1] for b in blocks for _ in range(int(b[1]))]


def _fit_verify(rows: list[tuple[int, bool, float, float]], context_ref: int):
    """Least squares: s = base[nodes, chain] + (a + b * nodes) * (context - ref); one base per grid cell."""
    cells = sorted({(n, c) for n, c, _, _ in rows})
    index = {cell: i for i, cell in enumerate(cells)}
    x = np.zeros((len(rows), len(cells) + 2))
    y = np.zeros(len(rows))
    for r, (n, c, ctx, s) in enumerate(rows):
        x[r, index[(n, c)]] = 1.0
        x[r, -2] = ctx - context_ref
        x[r, -1] = n * (ctx - context_ref)
        y[r] = s
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    a, b = max(float(coef[-2]), 0.0), max(float(coef[-1]), 0.0)
    base = {cell: float(coef[i]) for cell, i in index.items()}

    def curve(chain: bool) -> Curve:
        pts = sorted((n, s) for (n, c), s in base.items() if c == chain)
        ns, ss = [p[0] for p in pts], isotonic([max(p[1], 1e-6) for p in pts])
        return Curve(tuple(ns), tuple(float(s) for s in ss))

    chain_curve = curve(True)
    tree_pts = dict(zip(curve(False).nodes, curve(False).seconds))
    tree_pts.setdefault(1, chain_curve.seconds[0])  # a one-node "tree" is the root alone
    tree_curve = Curve(tuple(sorted(tree_pts)), tuple(tree_pts[k] for k in sorted(tree_pts)))
    return chain_curve, tree_curve, a, b


def _time_drafters(
    loaded: LoadedModel,
    names: Sequence[str],
    options: dict[str, dict[str, Any]],
    prompts,
    shapes,
    positions: int,
    tick: Callable[[], object] = lambda: None,
) -> dict[str, dict[str, Any]]:
    from env.batch import BatchEngine

    out: dict[str, dict[str, Any]] = {}
    for name in names:
        drafter = make_drafter(name, **options.get(name, {}))
        samples: dict[str, list[float]] = {}
        for prompt in prompts:
            engine = BatchEngine(loaded, max_rows=1)
            row, _ = engine.admit(prompt, {name: drafter})
            for _ in range(positions):
                for shape in shapes:
                    arm = Arm(name, shape)
                    t0 = time.perf_counter()
                    drafter.propose(row.ctx, shape)
                    samples.setdefault(arm.name, []).append(time.perf_counter() - t0)
                engine.step([Arm(None)])
                tick()
        med = {k: statistics.median(v) for k, v in samples.items()}
        sizes = {Arm(name, s).name: s.max_nodes for s in shapes}
        xs = np.array([sizes[k] for k in med], dtype=np.float64)
        ys = np.array(list(med.values()))
        slope, icpt = np.polyfit(xs, ys, 1) if len(set(xs.tolist())) > 1 else (0.0, float(ys.mean()))
        out[name] = {
            "shapes": {k: float(v) for k, v in med.items()},
            "base_s": float(max(icpt, 0.0)),
            "per_node_s": float(max(slope, 0.0)),
            "options": options.get(name, {}),
        }
    return out


def calibrate(
    loaded: LoadedModel,
    drafter_names: Sequence[str] = ("ngram",),
    *,
    drafter_options: dict[str, dict[str, Any]] | None = None,
    extra_shapes: Sequence[TreeShape] = (),
    reps: int = 4,
    contexts: Sequence[int] = CONTEXTS,
    chain_nodes: Sequence[int] = CHAIN_NODES,
    tree_nodes: Sequence[int] = TREE_NODES,
    draft_shapes: Sequence[TreeShape] = DRAFT_SHAPES,
    draft_prompts: int = 3,
    draft_positions: int = 4,
    progress: bool = False,
) -> FittedCostModel:
    """Measure the verify phase on a grid of tree sizes at two contexts and each drafter's propose time, then fit.
    About a minute for the embedded model on a 2-core CPU. ``progress``: a bar over the measurements on stderr (on
    a terminal)."""
    import sys

    from env.cli import progress_bar
    from env.decoder import chat_prompt
    from env.workloads import load_workload

    t_start = time.perf_counter()
    vocab = int(loaded.config.vocab_size)
    fixed = _FixedTree(vocab)
    grid = [(n, True) for n in chain_nodes] + [(n, False) for n in tree_nodes]
    names = [n for n in drafter_names if n != "none"]
    prompts = [chat_prompt(loaded.tokenizer, p.text) for p in load_workload()[:draft_prompts]]
    shapes = list(dict.fromkeys([*draft_shapes, *extra_shapes]))
    # the measurement grid: every (context, cell) once per pass (large trees every other pass), then each
    # drafter's proposals at each position of each prompt
    verify = sum(len(contexts) * sum(not (n > LARGE and r % 2) for n, _ in grid) for r in range(reps))
    bar = progress_bar(verify + len(names) * len(prompts) * draft_positions, "calibrate", progress)
    if progress:  # through the bar (else broken); on stderr: `| head` kept no result
        bar.write(f"calibrate: verify phase, {len(grid)} tree sizes x contexts {list(contexts)} x {reps}",
                  file=sys.stderr)  # fmt: skip
    ids = [_context_ids(loaded.tokenizer, c) for c in contexts]
    rows = _time_verify(loaded, fixed, ids, grid, reps, tick=lambda: bar.update(1))
    context_ref = int(contexts[0])
    chain, tree, a, b = _fit_verify(rows, context_ref)
    if progress:
        bar.write(f"calibrate: drafters {', '.join(drafter_names) or '(none)'}", file=sys.stderr)
    drafters = _time_drafters(
        loaded, names, drafter_options or {}, prompts, shapes, draft_positions, tick=lambda: bar.update(1)
    )
    bar.close()
    meta = {
        "machine": machine_info(),
        "weights": getattr(loaded, "weights", "dense"),  # the target's format (env.lean): its own curve
        "forward": getattr(loaded, "forward", "hf"),
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "calibration_s": round(time.perf_counter() - t_start, 1),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "reps": reps,
        "contexts": list(contexts),
        "measurements": [[n, bool(c), round(ctx, 1), s] for n, c, ctx, s in rows],
    }
    return FittedCostModel(
        model_id=loaded.model_id,
        dtype=str(loaded.dtype).removeprefix("torch."),
        device=str(loaded.device),
        chain=chain,
        tree=tree,
        context_ref=context_ref,
        per_context=a,
        per_node_context=b,
        drafters=drafters,
        meta=meta,
    )
