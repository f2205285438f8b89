"""``draftgym calibrate --batch``: the batch cost model of this machine (``env.batch_cost.FittedBatchCost``), measured
through the engine's whole step (``env.batch.BatchEngine.step``: propose, one target forward, verification, commit)
on a grid of rows x nodes per row at two contexts, the prefill over prompt lengths and each drafter's proposal per
row; fitted bilinear in (rows, nodes), linear in context, and saved with provenance."""

from __future__ import annotations

import datetime as dt
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from env.batch_cost import BatchedDraft, FittedBatchCost
from env.cost import CostModelError, Curve

ROWS = (1, 2, 4, 8, 16)
NODES = (1, 2, 3, 4, 6, 9)
CONTEXTS = (128, 512)
PREFILL_TOKENS = (16, 64, 192, 448, 1024)  # Spec-Bench's long prompts reach ~1,200 tokens
RUN_STEPS = (
    3  # consecutive steps per visit of a cell (a visit after another cell's starts with colder caches)
)


def _engines(
    loaded: Any, rows: Sequence[int], contexts: Sequence[int]
) -> tuple[dict[tuple[int, int], Any], Any]:
    """A ``BatchEngine`` per (rows, context), its rows admitted with ``context`` tokens each, and the fixed-tree
    drafter they all share (``_time_grid`` sets the chain it drafts)."""
    from env.batch import BatchEngine
    from env.calibrate import _context_ids, _FixedTree

    fixed = _FixedTree(int(loaded.config.vocab_size))
    engines = {}
    for c in contexts:
        ids = _context_ids(loaded.tokenizer, c)
        for r in rows:
            eng = BatchEngine(loaded, max_rows=r)
            for _ in range(r):
                eng.admit(ids, {"_fixed": fixed})
            engines[(r, c)] = eng
    return engines, fixed


def _time_grid(loaded: Any, rows: Sequence[int], nodes: Sequence[int], contexts: Sequence[int], reps: int,
               progress: bool, engines: tuple[dict[tuple[int, int], Any], Any] | None = None,
               done: dict[tuple[int, int, int], list[float]] | None = None, passes_done: int = 0,
               on_pass: Callable[[dict[tuple[int, int, int], list[float]], int], None] | None = None,
               ) -> dict[tuple[int, int, int], float]:  # fmt: skip
    """Median seconds of ``BatchEngine.step`` over (rows, nodes, context): every row drafts a random chain of
    ``nodes - 1`` tokens (``nodes`` 1: no draft); each visit of a cell runs ``RUN_STEPS`` steps in a row, then its
    commits are rolled back so that the context stays; cells are visited in a new random order every pass.
    ``engines``: from ``_engines`` (built here when not given). Resumable: ``done`` holds the samples of the first
    ``passes_done`` passes (their visiting orders are drawn again, so the passes after follow the same orders);
    ``on_pass(samples, passes)`` is called after each pass."""
    import torch

    from drafters import TreeShape
    from env.calibrate import tree_parents
    from env.engine import NO_DRAFT, Arm

    engines, fixed = engines if engines is not None else _engines(loaded, rows, contexts)
    cells = [(r, n, c) for r in rows for n in nodes for c in contexts]
    samples: dict[tuple[int, int, int], list[float]] = {
        cell: list((done or {}).get(cell, [])) for cell in cells
    }
    rng = random.Random(0)
    for _ in range(passes_done):
        rng.shuffle(cells)

    def run(r: int, n: int, c: int, steps: int = RUN_STEPS) -> list[float]:
        """``steps`` consecutive steps of one cell, as decoding runs them (the context grows by what they
        commit), then rolled back to the cell's context."""
        eng = engines[(r, c)]
        arm = NO_DRAFT if n == 1 else Arm("_fixed", TreeShape(depth=n - 1))
        fixed.parents = tree_parents(n, True)
        start = [(len(row.tokens), eng.target.cache.lens[row.slot]) for row in eng.target.rows]
        walls = []
        for _ in range(steps):
            t0 = time.perf_counter()
            eng.step([arm] * r)
            walls.append(time.perf_counter() - t0)
        for row, (k, n_kv) in zip(eng.target.rows, start):  # back to the same context
            del row.tokens[k:]
            eng.target.cache.lens[row.slot] = n_kv
        return walls

    with torch.inference_mode():
        for cell in cells if passes_done < reps else []:  # warm-up (none when a resume finds every pass done)
            run(*cell, steps=1)
        it = range(passes_done, reps)
        if progress:
            from tqdm import tqdm

            it = tqdm(it, desc="calibrate --batch", unit="pass", initial=passes_done, total=reps)
        for k in it:
            rng.shuffle(cells)
            for cell in cells:
                samples[cell].extend(run(*cell))
            if on_pass is not None:
                on_pass(samples, k + 1)
    return {cell: statistics.median(v) for cell, v in samples.items()}


def monotone_fit(grid: np.ndarray, sweeps: int = 4) -> np.ndarray:
    """A fit of ``grid`` [rows, nodes] that never decreases along either axis: least-squares isotonic regression
    along rows and along nodes in turn (pool adjacent violators, ``env.calibrate.isotonic``), then a running maximum
    for what the sweeps leave. A running maximum alone lifts every later cell to one noisy high measurement; the
    pooled fit averages it with its neighbours."""
    from env.calibrate import isotonic

    out = np.array(grid, dtype=float)
    for _ in range(sweeps):
        for j in range(out.shape[1]):
            out[:, j] = isotonic(out[:, j])
        for i in range(out.shape[0]):
            out[i, :] = isotonic(out[i, :])
    np.maximum.accumulate(out, axis=0, out=out)
    np.maximum.accumulate(out, axis=1, out=out)
    return out


def _time_prefill(loaded: Any, lengths: Sequence[int], reps: int) -> list[float]:
    import torch

    from env.batch import BatchEngine
    from env.calibrate import _context_ids

    eng = BatchEngine(loaded, max_rows=1)
    out = []
    with torch.inference_mode():
        for n in lengths:
            ids = _context_ids(loaded.tokenizer, n)
            ts = []
            for _ in range(reps + 1):
                t0 = time.perf_counter()
                row, _ = eng.admit(ids, {})
                ts.append(time.perf_counter() - t0)
                eng.retire(row)
            out.append(statistics.median(ts[1:]))
    return out


def calibrate_batch(
    loaded: Any,
    drafter_names: Sequence[str] = ("ngram",),
    *,
    rows: Sequence[int] = ROWS,
    nodes: Sequence[int] = NODES,
    contexts: Sequence[int] = CONTEXTS,
    reps: int = 5,
    prefill_tokens: Sequence[int] = PREFILL_TOKENS,
    progress: bool = False,
    drafter_options: dict[str, dict[str, Any]] | None = None,
    work: str | Path | None = None,
) -> FittedBatchCost:
    """Measure the batch step on the (rows, nodes, context) grid, the prefill, each drafter's propose time per
    row, or per batch over rows x depths for a drafter that drafts a batch's rows together, and a serving policy's
    bookkeeping a step per row count (``_time_policy_book``); fit. About two
    minutes for the embedded model on a 2-core CPU (fp32 without native bf16: about three).

    ``work``: a JSON file the measurements so far are written to, atomically, after every pass over the grid and
    every later phase; a rerun with the same settings on the same CPU resumes from it (a kill loses at most one
    pass), one with other settings refuses it (``env.batch_calibrate_state``). The caller removes it once the cost
    model is saved.

    ``prefill_tokens``: the prompt lengths the prefill is timed at (those below the model's context); the cost
    model's prefill curve goes on in a straight line past the longest."""
    from env.calibrate import _time_drafters
    from env.decoder import chat_prompt
    from env.machine import machine_info
    from env.workloads import load_workload

    if len(contexts) != 2:
        raise ValueError("calibrate_batch measures at exactly two contexts")
    if not prefill_tokens or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in prefill_tokens
    ):
        raise ValueError(f"prefill_tokens must be prompt lengths >= 1, got {prefill_tokens!r}")
    from env.batch_calibrate_state import CalibrationState

    t_start = time.perf_counter()
    names = [n for n in drafter_names if n != "none"]
    options = drafter_options or {}
    lengths = sorted({int(n) for n in prefill_tokens if n < loaded.max_context}) or [
        min(16, loaded.max_context - 1)
    ]
    state = CalibrationState.open(work, loaded, names, options, rows, nodes, contexts, reps,
                                  batching=[n for n in names if _batches(n)], prefill_lengths=lengths,
                                  run_steps=RUN_STEPS, batched_timing=BATCHED_TIMING)  # fmt: skip
    engines = _engines(loaded, rows, contexts)
    med = _time_grid(loaded, rows, nodes, contexts, reps, progress, engines, done=state.samples,
                     passes_done=state.passes, on_pass=state.save_pass)  # fmt: skip
    if state.probe is None:
        state.save_phase(
            "probe", _probe_cells(loaded, rows, contexts, engines)
        )  # what speed_probe times later
    reference = state.probe
    c0, c1 = int(contexts[0]), int(contexts[1])
    base = np.array([[med[(r, n, c0)] for n in nodes] for r in rows])
    slope = np.array(
        [[max((med[(r, n, c1)] - med[(r, n, c0)]) / (c1 - c0), 0.0) for n in nodes] for r in rows]
    )
    base, slope = monotone_fit(base), monotone_fit(slope)  # more rows or more nodes never cost less
    if state.prefill is None:
        state.save_phase("prefill", _time_prefill(loaded, lengths, max(reps // 2, 2)))
    pf = state.prefill
    from env.calibrate import isotonic

    prefill = Curve(tuple(lengths), tuple(isotonic(pf)))
    prompts = [chat_prompt(loaded.tokenizer, p.text) for p in load_workload()[:3]]
    from drafters import TreeShape

    shapes = [TreeShape(d) for d in (1, 2, 3, 5, 8)]
    if state.drafters is None:
        timed = _time_drafters(loaded, names, options, prompts, shapes, positions=4)
        state.save_phase(
            "drafters", {n: float(statistics.median(v["shapes"].values())) for n, v in timed.items()}
        )
    drafters = state.drafters
    batched = dict(state.batched)
    for n in names:
        if _batches(n) and n not in batched:
            batched[n] = _time_batched(loaded, n, rows, prompts, reps, options.get(n, {}))
            state.save_batched(n, batched[n])
    if state.policy_book is None:
        state.save_phase("policy_book", _time_policy_book(loaded, names, rows, prompts[0], reps, options))
    meta = {
        "machine": machine_info(),
        "forward": getattr(loaded, "forward", "hf"),
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "calibration_s": round(time.perf_counter() - t_start, 1),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "reps": reps,
        # measurements of an earlier, killed run were kept (then created, calibration_s and load_average are this
        # run's, the last)
        "resumed": state.resumed,
        "contexts": [c0, c1],
        "measurements": [[r, n, c, s] for (r, n, c), s in sorted(med.items())],
        "probe": [[r, c, s] for (r, c), s in sorted(reference.items())],
        "prefill_measured": pf,
        # what the policy's bookkeeping was timed with: the menu's drafters (the first table drafter's proposals
        # made untimed, as the observation's), the observation's row slots
        "policy_book_menu": {"drafters": ["none", *names], "obs_max_batch": int(max(rows))},
        # how the batched drafters' proposals were timed (files before it: after an autoregressive step, one prompt)
        **({"batched_timing": BATCHED_TIMING} if batched else {}),
    }
    return FittedBatchCost(
        model_id=loaded.model_id,
        dtype=str(loaded.dtype).removeprefix("torch."),
        weights=str(getattr(loaded, "weights", "dense")),
        rows=tuple(int(r) for r in rows),
        nodes=tuple(int(n) for n in nodes),
        context_ref=c0,
        base=base,
        slope=slope,
        prefill=prefill,
        drafters=drafters,
        meta=meta,
        batched=batched,
        policy_book=Curve(tuple(int(r) for r in rows), tuple(state.policy_book)),
    )


DEPTHS = (1, 2, 3, 5)  # chain depths a batched drafter is timed at
CATCH_STEPS = 12  # plain steps before a batched drafter's proposal timed for its catch-up price


def _batches(name: str) -> bool:
    """Whether drafter ``name`` drafts a batch's rows together (``drafters.BatchProposer``)."""
    from drafters import BatchProposer, make_drafter

    return isinstance(make_drafter(name), BatchProposer)


# how a batched drafter's proposal is timed (kept in a calibration's settings and its cost model's meta): each
# sample after a speculative step of that drafter and depth, the rows' prompts rotated through the built-in ones
BATCHED_TIMING = "after-spec-step/rotated-prompts/catch-up"


def _time_batched(loaded: Any, name: str, rows: Sequence[int], prompts: Sequence[list[int]], reps: int,
                  options: dict[str, Any]) -> BatchedDraft:  # fmt: skip
    """A batched drafter's proposal over ``rows`` rows, every row drafting a chain of each of ``DEPTHS``. Each
    sample follows a speculative step of the batch with that drafter at that depth, so it includes the head's
    catch-up on the tokens that step committed, as a stream of such steps pays it (``BATCHED_TIMING``; a head
    catches up on every token since its row's last proposal, so one right after plain steps costs more than priced
    here). Each row count is timed once per prompt of ``prompts``, the rows' prompts rotated through them, and the
    samples pooled: a drafter whose cost depends on the text (a hybrid skips its model part where its suffix match
    is strong) is not priced on one prompt's text alone. A batch is admitted again before its rows could outgrow
    the model's context. Per row count, seconds fitted linear in depth: fixed + depth x level; both then made
    non-decreasing in rows. The catch-up price: a depth-1 proposal after a speculative step and ``CATCH_STEPS``
    plain steps, less the one right after a speculative step, per token of the batch's plain steps."""
    import torch

    from drafters import Forkable, TreeShape, make_drafter
    from env.batch import BatchEngine
    from env.engine import NO_DRAFT, Arm

    fixed, level, catch = [], [], []
    rng = random.Random(1)
    # a speculative step commits at most depth + 1 tokens a row; a proposal commits none
    room = loaded.max_context - max(len(p) for p in prompts) - 2 * (max(DEPTHS) + 1)
    with torch.inference_mode():
        for r in rows:
            samples: dict[int, list[float]] = {d: [] for d in DEPTHS}
            behind: list[float] = []  # a depth-1 proposal after CATCH_STEPS plain steps
            first = make_drafter(name, **options)
            # (admitted once: it loads the head the rows' forks share)
            BatchEngine(loaded, max_rows=1).admit(prompts[0], {name: first})

            def batch(k: int, r: int = r, first: Any = first) -> Any:
                eng = BatchEngine(loaded, max_rows=r)
                for i in range(r):
                    d = first.fork() if isinstance(first, Forkable) else make_drafter(name, **options)
                    eng.admit(prompts[(k + i) % len(prompts)], {name: d})
                return eng

            for k in range(len(prompts)):
                eng, used = batch(k), 0
                for _ in range(max(reps, 2)):
                    order = list(DEPTHS)
                    rng.shuffle(order)
                    for depth in order:
                        if used + depth + 1 > room:  # (a small model's context, many --reps)
                            eng, used = batch(k), 0
                        arms = [Arm(name, TreeShape(depth))] * r
                        eng.step(arms)  # a speculative step: the timed proposal catches up on what it commits
                        used += depth + 1
                        t0 = time.perf_counter()
                        eng.propose(arms)
                        samples[depth].append(time.perf_counter() - t0)
                    if used + 2 + CATCH_STEPS > room:
                        eng, used = batch(k), 0
                    arms = [Arm(name, TreeShape(1))] * r
                    eng.step(arms)
                    for _ in range(CATCH_STEPS):
                        eng.step([NO_DRAFT] * r)
                    used += 2 + CATCH_STEPS
                    t0 = time.perf_counter()
                    eng.propose(arms)
                    behind.append(time.perf_counter() - t0)
            xs = np.array(DEPTHS, np.float64)
            ys = np.array([statistics.median(samples[d]) for d in DEPTHS])
            slope, icpt = np.polyfit(xs, ys, 1)
            level.append(max(float(slope), 0.0))
            fixed.append(max(float(icpt), 0.0))
            extra = statistics.median(behind) - statistics.median(samples[1])
            catch.append(min(max(extra, 0.0) / (r * CATCH_STEPS), 1.0))
    return BatchedDraft(
        tuple(int(r) for r in rows),
        tuple(np.maximum.accumulate(fixed).tolist()),
        tuple(np.maximum.accumulate(level).tolist()),
        tuple(catch),
    )


def _time_policy_book(loaded: Any, names: Sequence[str], rows: Sequence[int], prompt: list[int], reps: int,
                      options: dict[str, Any]) -> list[float]:  # fmt: skip
    """Seconds a serving policy's bookkeeping adds to a live step, per row count of ``rows``: what
    ``env.serving.serve`` times around the policy's act (``LiveObserver``: the observation, the action read, the
    record), with a menu of no draft and each drafter of ``names`` at depth 1, the policy's act left out (replay
    times each policy's own: ``policies.act_cost``) and so are the match drafter's proposals (made untimed
    before: a row that drafts with it verifies that same proposal, so replay prices it as that drafter's own).
    Medians over ``max(reps, 2) * RUN_STEPS`` steps of one batch, made non-decreasing in rows."""
    import torch

    from drafters import Forkable, TreeShape, make_drafter
    from env.batch import BatchEngine
    from env.engine import NO_DRAFT, Arm
    from env.serve_obs import LiveObserver
    from env.step import Stepper

    menu = [NO_DRAFT, *(Arm(n, TreeShape(1)) for n in names)]
    observer = LiveObserver(menu, max(rows))
    match = observer.match_drafter
    out = []
    with torch.inference_mode():
        for r in rows:
            stepper = Stepper(BatchEngine(loaded, max_rows=r), menu)
            first = None
            for _ in range(r):  # each row the match drafter of its own, as serve gives each request
                if match is None:
                    drafters = {}
                elif first is None:
                    drafters = {match: (first := make_drafter(match, **options.get(match, {})))}
                else:
                    fork = isinstance(first, Forkable)
                    drafters = {
                        match: first.fork() if fork else make_drafter(match, **options.get(match, {}))
                    }
                stepper.start(prompt, 1 << 12, drafters)
            samples: list[float] = []
            for i in range(max(reps, 2) * RUN_STEPS + 1):  # the first step untimed (a warm-up)
                if any(s.done for s in stepper.seqs):
                    break
                for s in stepper.seqs if match is not None else ():
                    stepper.proposals(s, [match])
                t0 = time.perf_counter()
                observer.observe(stepper, 0)
                choices = observer.choices(0, len(stepper.seqs))
                t1 = time.perf_counter()
                outcomes = stepper.step(choices)
                t2 = time.perf_counter()
                observer.record(outcomes)
                if i:
                    samples.append(t1 - t0 + time.perf_counter() - t2)
            if not samples:  # every row ended before a step was timed: not a time of nothing
                raise CostModelError(f"the serving policy's bookkeeping could not be timed at {r} rows: the "
                                     "calibration prompt's answer ended at once")  # fmt: skip
            out.append(float(statistics.median(samples)))
    return np.maximum.accumulate(out).tolist()


PROBE_REPS = 3


def _probe_cells(loaded: Any, rows: Sequence[int], contexts: Sequence[int],
                 engines: tuple[dict[tuple[int, int], Any], Any] | None = None,
                 ) -> dict[tuple[int, int], float]:  # fmt: skip
    """The speed probe's timing: for each row count alone, its one-node cells at ``contexts`` (``_time_grid``
    over that row count only). Timed the same way at calibration (``meta["probe"]``) and by ``speed_probe``: a
    cell visited among the whole grid's runs with colder caches than one visited among its own, so the probe is
    compared with its own reference, not with the grid."""
    out: dict[tuple[int, int], float] = {}
    for r in rows:
        sub = None if engines is None else ({(r, c): engines[0][(r, c)] for c in contexts}, engines[1])
        got = _time_grid(loaded, [r], [1], contexts, PROBE_REPS, False, sub)
        out.update({(r, c): s for (_r, _n, c), s in got.items()})
    return out


def probe_reference(cost: Any) -> dict[tuple[int, int], float]:
    """The speed probe's cells timed at calibration (``meta["probe"]``: [rows, context, seconds]), by (rows,
    context); entries that are not three positive finite numbers are skipped (a file's meta is provenance, not
    validated when the file loads). Empty for a roofline model or a calibration made before the probe existed."""
    out: dict[tuple[int, int], float] = {}
    meta = getattr(cost, "meta", None)
    items = meta.get("probe") if isinstance(meta, dict) else None
    for m in items if isinstance(items, list) else []:
        if not (isinstance(m, list) and len(m) == 3):
            continue
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in m):
            continue
        r, c, s = m
        if min(r, c) >= 1 and np.isfinite(s) and s > 0 and float(r).is_integer() and float(c).is_integer():
            out[(int(r), int(c))] = float(s)
    return out


def probe_rows(cost: Any, load: str) -> list[int]:
    """The row counts a speed probe for ``load`` times: the largest probed at calibration not above a numeric
    load's concurrency; the smallest and largest for a mixed or bursty load. Empty when the cost model has no
    probe reference."""
    have = sorted({r for (r, _c) in probe_reference(cost)})
    if not have:
        return []
    if load.isdigit():
        return [max([r for r in have if r <= int(load)] or have[:1])]
    return sorted({have[0], have[-1]})


def speed_probe(loaded: Any, cost: Any, rows: Sequence[int]) -> dict[str, Any] | None:
    """The machine's speed now against the moment ``cost`` was calibrated: the probe's cells (``rows`` x one
    node at the calibrated contexts, ``_probe_cells``) timed again, each against the same timing made at
    calibration. ``factor`` is the geometric mean of now / then: 1.2 means steps take 20% longer now, so replay
    priced by ``cost`` overstates goodput by about that much. ``None`` when the cost model holds no probe
    reference (a roofline model, a calibration from before the probe)."""
    then = probe_reference(cost)
    cells = [(r, c) for (r, c) in sorted(then) if r in rows]
    if not cells or getattr(loaded, "max_context", 1 << 30) <= max(c for _, c in cells) + 8:
        return None
    now = _probe_cells(loaded, sorted({r for r, _ in cells}), sorted({c for _, c in cells}))
    ratios = [now[cell] / then[cell] for cell in cells]
    return {
        "cells": [[r, c, now[(r, c)], then[(r, c)]] for r, c in cells],
        "factor": float(np.exp(np.mean(np.log(ratios)))),
    }


__all__ = ["CONTEXTS", "NODES", "PREFILL_TOKENS", "PROBE_REPS", "ROWS", "RUN_STEPS", "calibrate_batch",
           "monotone_fit", "probe_reference", "probe_rows", "speed_probe"]  # fmt: skip
