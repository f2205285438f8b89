"""The batch engine's own overhead: ``python -m env.bench_batch`` times, for each batch size B, the bare Hugging Face
forward of B rows x 1 token on a ``DynamicCache`` of ``--context`` tokens per row (``c(B, q=1)``, what the model
itself costs), and one autoregressive step of ``env.batch.BatchEngine`` over B rows of the same context (the ragged
cache, masks, verification, commit); prints the medians and the engine's share of the raw bound.

With ``--serve N``, also AR served end to end at each concurrency C = B (closed loop, ``N * C`` requests whose
prompts average ``--context`` minus half the answer, so that rows average ``--context`` tokens while they
decode): goodput over the whole run (prefills and the final drain included) and over the decode steps alone,
against the raw bound ``C / c(B=C, q=1)``.

    python -m env.bench_batch --rows 1,4,8,16 --context 300 --dtype bf16 --serve 4

With ``--draft ARM[,ARM]`` (trained-head arms, e.g. ``eagle-d3-k2-b6``), also the proposal time of B rows that chose
that arm, drafted together (``propose_batch``) against row by row, next to one AR step (each row's catch-up on
its last committed token is done before the timing).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch


def _interleaved_ms(fns, reps: int) -> list[float]:
    """Median ms of each function, timed in turn within every repetition (``kernels.timing.interleaved_ms``)."""
    from kernels.timing import interleaved_ms

    return interleaved_ms(fns, reps)


def raw_forward(loaded, rows: int, context: int):
    """One bare Hugging Face forward of ``rows`` x 1 token over a ``DynamicCache`` of ``context`` tokens."""
    from transformers import DynamicCache

    model = loaded.model
    ids = torch.randint(100, 1000, (rows, context), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids.to(loaded.device), cache=cache, use_cache=True)
    nxt = torch.randint(100, 1000, (rows, 1)).to(loaded.device)
    pos = torch.full((rows, 1), context, device=loaded.device)

    @torch.no_grad()
    def step():
        model(input_ids=nxt, position_ids=pos, cache=cache, use_cache=True)
        cache.crop(-1)

    return step


def engine_step(loaded, rows: int, context: int):
    """One AR step of the engine over ``rows`` rows of ``context`` tokens (put back after each call)."""
    from env.batch import BatchEngine
    from env.engine import NO_DRAFT

    eng = BatchEngine(loaded, max_rows=rows)
    g = torch.Generator().manual_seed(0)
    for _ in range(rows):
        eng.admit(torch.randint(100, 1000, (context - 1,), generator=g).tolist(), {})
    arms = [NO_DRAFT] * rows

    def step():
        eng.step(arms)
        for r in eng.target.rows:  # back to the same context: the cost at one length
            r.tokens.pop()
            eng.target.cache.lens[r.slot] -= 1

    return step


MAX_SERVE = 1 << 16  # --serve: requests per row, each decoded for real


def serve_ar(loaded, rows: int, context: int, per_row: int, max_new_tokens: int, seed: int = 0) -> dict:
    """AR served closed-loop at concurrency ``rows`` over ``per_row * rows`` requests (see the module docstring)."""
    from env.batch import BatchEngine
    from env.engine import NO_DRAFT
    from env.serving import Request, ServeLog, serve

    g = torch.Generator().manual_seed(seed)
    mean_prompt = max(context - max_new_tokens // 2, 8)
    lo, hi = max(mean_prompt - 64, 4), mean_prompt + 64
    reqs = []
    for i in range(per_row * rows):
        n = int(torch.randint(lo, hi + 1, (1,), generator=g))
        ids = torch.randint(100, 20000, (n,), generator=g).tolist()
        reqs.append(Request(str(i), ids, NO_DRAFT, max_new_tokens))
    log = ServeLog()
    t0 = time.perf_counter()
    out = serve(BatchEngine(loaded, max_rows=rows), reqs, concurrency=rows, log=log)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in out)
    return {"requests": len(reqs), "tokens": tokens, "wall_s": wall, "goodput": tokens / wall,
            "decode_goodput": log.step_tokens / log.step_s, **log.as_dict()}  # fmt: skip


def draft_ms(loaded, arm_name: str, rows: int, context: int, reps: int) -> tuple[float, float, float]:
    """Median ms: ``rows`` rows' proposals for ``arm_name`` drafted together, row by row, and one AR step."""
    from drafters import DrafterError, Forkable, make_drafter
    from env.batch import BatchEngine
    from env.engine import NO_DRAFT, parse_arm

    arm = parse_arm(arm_name)
    eng = BatchEngine(loaded, max_rows=rows)
    g = torch.Generator().manual_seed(0)
    first = make_drafter(arm.drafter)
    if not isinstance(first, Forkable):
        raise DrafterError(f"--draft: {arm.drafter} does not draft rows together")
    ds = []
    for i in range(rows):
        d = first if i == 0 else first.fork()
        eng.admit(torch.randint(100, 20000, (context,), generator=g).tolist(), {arm.drafter: d})
        ds.append(d)
    items = [(d, r.ctx, arm.shape) for d, r in zip(ds, eng.target.rows)]
    together, alone, step = [], [], []
    for _ in range(reps + 1):
        first.propose_batch(items)  # the catch-up on the last committed token, untimed
        t0 = time.perf_counter()
        first.propose_batch(items)
        t1 = time.perf_counter()
        for d, ctx, shape in items:
            d.propose(ctx, shape)
        t2 = time.perf_counter()
        eng.step([NO_DRAFT] * rows)  # the rows move on by one token
        together.append(t1 - t0), alone.append(t2 - t1), step.append(time.perf_counter() - t2)
    return tuple(1e3 * statistics.median(x[1:]) for x in (together, alone, step))  # type: ignore[return-value]


PROG = "python -m env.bench_batch"


def check_draft_arms(names: list[str]) -> list[str]:
    """``--draft`` arms: each a trained-head arm whose drafter drafts rows together (``propose_batch`` over shared
    weights, ``fork``); a ``DrafterError`` naming the first that is not, before the model loads."""
    from drafters import DRAFTERS, DrafterError
    from env.engine import parse_arm

    for name in names:
        arm = parse_arm(name)
        cls = DRAFTERS.get(arm.drafter or "")
        if cls is None or not (hasattr(cls, "propose_batch") and hasattr(cls, "fork")):
            able = sorted(
                n for n, c in DRAFTERS.items() if hasattr(c, "propose_batch") and hasattr(c, "fork")
            )
            raise DrafterError(
                f"--draft {name}: {arm.drafter or 'none'} does not draft rows together; those that do: "
                + ", ".join(able)
            )
    return names


def main(argv: list[str] | None = None) -> int:
    from env.cli import run_program

    return run_program(PROG, _main, argv)


def _main(argv: list[str] | None) -> int:
    from env.cli import (
        Parser,
        check_context,
        int_at_least,
        int_list,
        output_file,
        positive_int,
        progress_bar,
        write_json,
    )
    from env.serve_sim import MAX_BATCH

    ap = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--context", type=positive_int, default=300)
    ap.add_argument("--reps", type=positive_int, default=15)
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    ap.add_argument("--serve", type=int_at_least(0, MAX_SERVE), default=0,
                    help="also serve AR end to end: N requests per row")  # fmt: skip
    ap.add_argument("--max-new-tokens", type=positive_int, default=128)
    ap.add_argument("--draft", default="", help="also time drafting these arms' rows together vs row by row")
    ap.add_argument("--json", default=None, help="write the rows to this file (after each row)")
    args = ap.parse_args(argv)
    batches = int_list(args.rows, "--rows")
    if max(batches) > MAX_BATCH:
        ap.error(f"argument --rows: at most {MAX_BATCH} rows, got {max(batches)}")
    arms = check_draft_arms([a.strip() for a in args.draft.split(",") if a.strip()])
    from env.model import model_folder

    out_path = output_file(args.json, folders=(model_folder(None),))
    from env.machine import cpu_label, machine_info
    from env.model import load_model

    loaded = load_model(dtype=args.dtype, device="cpu")
    need = {f"--context {args.context}": args.context + 1}  # each mode's most positions a row holds
    if args.serve:  # serve_ar's longest prompt, then its answer
        longest = max(args.context - args.max_new_tokens // 2, 8) + 64 + args.max_new_tokens
        need[f"--serve with --context {args.context} and --max-new-tokens {args.max_new_tokens}"] = longest
    if arms:  # draft_ms: the context, then a token a repetition
        need[f"--draft with --context {args.context} and --reps {args.reps}"] = args.context + args.reps + 2
    for what, positions in need.items():
        check_context(loaded, positions, what)
    out: list[dict] = []
    drafts: list[dict] = []
    cells = len(batches) * (1 + bool(args.serve) + len(arms))
    doc = {"rows": out, "drafts": drafts, "dtype": str(loaded.dtype), "machine": machine_info(), "cells": cells,
           "complete": False}  # fmt: skip
    bar = progress_bar(cells, "bench_batch")

    measured = []

    def done(line: str) -> None:  # a row measured: printed, and the JSON written with it
        measured.append(line)
        doc["complete"] = len(measured) == cells
        write_json(out_path, doc, indent=2)
        bar.write(line, file=sys.stdout)
        sys.stdout.flush()
        bar.update(1)

    try:
        print(
            f"machine: CPU {cpu_label()}; {str(loaded.dtype).removeprefix('torch.')}, context {args.context}"
        )
        print(f"{'rows':>5}{'raw ms':>9}{'engine ms':>11}{'raw / engine':>14}", flush=True)
        for b in batches:
            raw, eng = _interleaved_ms([raw_forward(loaded, b, args.context), engine_step(loaded, b, args.context)],
                                       args.reps)  # fmt: skip
            out.append(
                {"rows": b, "context": args.context, "raw_ms": raw, "engine_ms": eng, "share": raw / eng}
            )
            done(f"{b:>5}{raw:>9.1f}{eng:>11.1f}{raw / eng:>14.2f}")
        if args.serve:
            bar.write(f"\nAR served, closed loop, {args.serve} requests per row, {args.max_new_tokens} new tokens",
                      file=sys.stdout)  # fmt: skip
            bar.write(f"{'C':>4}{'bound tok/s':>13}{'goodput':>9}{'/ bound':>9}{'decode':>8}{'/ bound':>9}"
                      f"{'mean B':>8}{'prefill %':>11}", file=sys.stdout)  # fmt: skip
            for r in out:
                b = r["rows"]
                sv = serve_ar(loaded, b, args.context, args.serve, args.max_new_tokens)
                bound = 1e3 * b / r["raw_ms"]
                r["serve"] = {**sv, "bound_tok_s": bound}
                done(f"{b:>4}{bound:>13.1f}{sv['goodput']:>9.1f}{sv['goodput'] / bound:>9.2f}"
                     f"{sv['decode_goodput']:>8.1f}{sv['decode_goodput'] / bound:>9.2f}{sv['mean_batch']:>8.1f}"
                     f"{100 * sv['prefill_s'] / sv['wall_s']:>11.0f}")  # fmt: skip
        for name in arms:
            bar.write(f"\n{name}: proposal ms for B rows of {args.context} tokens", file=sys.stdout)
            bar.write(f"{'rows':>5}{'together':>10}{'row by row':>12}{'AR step':>9}", file=sys.stdout)
            for b in batches:
                t, a, st = draft_ms(loaded, name, b, args.context, args.reps)
                drafts.append(
                    {"arm": name, "rows": b, "together_ms": t, "row_by_row_ms": a, "ar_step_ms": st}
                )
                done(f"{b:>5}{t:>10.1f}{a:>12.1f}{st:>9.1f}")
    finally:
        bar.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
