"""What one expansion step of a model drafter costs against a target forward at the same batch size:
``python -m env.bench_draft`` admits ``--rows`` rows of ``--context`` tokens, then times, interleaved within every
repetition, the target's forward of one token per row (LM head included) and the drafter's batched proposal
(``propose_batch`` over all rows) at depths 2 .. ``--max-depth`` with ``--topk`` children per node. The cost of one
expansion step (one head pass over every row's frontier, the projection to the draft vocabulary and the top-k) is
the least-squares slope of proposal time over depth; a proposal at the same root is idempotent, so it repeats.

    python -m env.bench_draft --drafters eagle3,eagle --rows 1,4,16 --topk 1,4 --dtype bf16 [--vocab 0,4096] [--separate]
"""

from __future__ import annotations

import sys

import torch

from env.bench_batch import _interleaved_ms


def _slope(xs: list[int], ys: list[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def measure(
    loaded,
    drafter: str,
    rows: int,
    context: int,
    topk: int,
    max_depth: int,
    reps: int,
    vocab: int | None = None,
    separate: bool = False,
) -> dict:
    from drafters import DraftTree, TreeShape, make_drafter
    from env.batch import BatchEngine
    from kernels.packed import stacking

    eng = BatchEngine(loaded, rows)
    gen = torch.Generator().manual_seed(0)
    first = make_drafter(drafter) if vocab is None else make_drafter(drafter, vocab=vocab)
    ds = []
    for i in range(rows):
        d = first if i == 0 else first.fork()
        eng.admit(torch.randint(100, 1000, (context,), generator=gen).tolist(), {drafter: d})
        ds.append(d)
    t = eng.target
    ctxs = [r.ctx for r in t.rows]
    depths = list(range(2, max_depth + 1))

    def forward():
        with torch.no_grad():
            t.forward_trees([DraftTree.root_only(r.tokens[-1]) for r in t.rows])  # nothing committed

    def proposal(depth: int):
        shape = TreeShape(depth=depth, topk=topk, budget=depth * topk)
        return lambda: first.propose_batch([(d, c, shape) for d, c in zip(ds, ctxs)])

    def unstacked(depth: int):  # the head's q/k/v and gate/up as separate products (kernels.packed.stacking)
        run = proposal(depth)

        def f():
            with stacking(False):
                run()

        return f

    fns = [forward] + [proposal(dp) for dp in depths] + ([unstacked(dp) for dp in depths] if separate else [])
    ms = _interleaved_ms(fns, reps)
    n = len(depths)
    step = _slope(depths, ms[1 : 1 + n])
    extra = {"expansion_separate_ms": round(_slope(depths, ms[1 + n :]), 3)} if separate else {}
    ms = ms[: 1 + n]
    return {
        "drafter": drafter,
        "rows": rows,
        "topk": topk,
        "vocab": vocab,
        "context": context,
        "forward_ms": round(ms[0], 3),
        "proposal_ms": {dp: round(m, 3) for dp, m in zip(depths, ms[1:])},
        "expansion_ms": round(step, 3),
        "expansion_vs_forward": round(step / ms[0], 4),
        **extra,
    }


PROG = "python -m env.bench_draft"


def check_drafters(names: list[str], vocabs: list[int | None]) -> None:
    """Each drafter registered, drafting rows together (``propose_batch``) over shared weights (``fork``), and
    built with each ``--vocab``: a ``DrafterError`` naming the first that is not, before the model loads."""
    from drafters import DRAFTERS, DrafterError, keyword_options, make_drafter

    for name in names:
        if name not in DRAFTERS:
            raise DrafterError(
                f"--drafters: unknown drafter {name!r}; known drafters: {', '.join(sorted(DRAFTERS))}"
            )
        cls = DRAFTERS[name]
        if not (hasattr(cls, "propose_batch") and hasattr(cls, "fork")):
            able = sorted(
                n for n, c in DRAFTERS.items() if hasattr(c, "propose_batch") and hasattr(c, "fork")
            )
            raise DrafterError(
                f"--drafters: {name} does not draft rows together (no propose_batch); those that do: "
                + ", ".join(able)
            )
        for vocab in vocabs:
            if vocab is not None and "vocab" not in keyword_options(cls):
                raise DrafterError(f"--vocab: {name} takes no vocab option (eagle and eagle3 do)")
            make_drafter(name) if vocab is None else make_drafter(name, vocab=vocab)


def main(argv: list[str] | None = None) -> int:
    from env.cli import run_program

    return run_program(PROG, _main, argv)


def _main(argv: list[str] | None) -> int:
    from drafters.base import MAX_DEPTH, MAX_TOPK, TreeShape
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

    p = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--drafters", default="eagle3,eagle")
    p.add_argument("--rows", default="1,4,16")
    p.add_argument("--topk", default="1,4")
    p.add_argument("--context", type=positive_int, default=300)
    p.add_argument("--max-depth", type=int_at_least(3, MAX_DEPTH), default=6,
                   help="at least 3 (the slope takes two depths)")  # fmt: skip
    p.add_argument("--reps", type=positive_int, default=15)
    p.add_argument("--dtype", default="bf16", choices=["auto", "bf16", "fp32"])
    p.add_argument("--weights", default="dense")
    p.add_argument("--vocab", default=None, help="comma list of the option vocab of eagle/eagle3 (0: all)")
    p.add_argument("--separate", action="store_true",
                   help="also time each expansion with the head's q/k/v and gate/up as separate products, interleaved")  # fmt: skip
    p.add_argument("--json", default=None, help="also write the rows to this file (after each row)")
    args = p.parse_args(argv)
    names = [x.strip() for x in args.drafters.split(",") if x.strip()]
    if not names:
        p.error("argument --drafters: names no drafter")
    vocabs: list[int | None] = [None] if args.vocab is None else list(int_list(args.vocab, "--vocab", low=0))
    rows_list, topks = int_list(args.rows, "--rows"), int_list(args.topk, "--topk")
    if max(topks) > MAX_TOPK:
        p.error(f"argument --topk: at most {MAX_TOPK} branches a node, got {max(topks)}")
    if max(rows_list) > MAX_BATCH:
        p.error(f"argument --rows: at most {MAX_BATCH} rows, got {max(rows_list)}")
    TreeShape(args.max_depth, max(topks)).arm_shape("--max-depth and --topk")  # the largest tree drafted
    check_drafters(names, vocabs)
    from drafters.heads import DATA_DIR, cache_heads_dir
    from env.model import model_folder

    # the heads come from the user's trained ones or the shipped ones
    out_path = output_file(args.json, folders=(model_folder(None), cache_heads_dir(), DATA_DIR))

    from env.machine import cpu_label
    from env.model import load_model

    loaded = load_model(None, dtype=args.dtype, device="auto", weights=args.weights)
    check_context(loaded, args.context + args.max_depth + 1, f"--context {args.context} with --max-depth")
    print(f"# {loaded.model_id} {args.dtype}/{args.weights} on {loaded.device}; CPU {cpu_label()}")
    sep = " separate products ms |" if args.separate else ""
    print(
        f"| drafter | vocab | rows | top-k | target forward ms | one expansion ms | expansion / forward |{sep}"
    )
    print("|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if args.separate else ""), flush=True)
    cells = [(n, v, r, k) for n in names for v in vocabs for r in rows_list for k in topks]
    doc: dict = {"rows": [], "cpu": cpu_label(), "model": loaded.model_id, "dtype": args.dtype,
                 "weights": args.weights, "cells": len(cells), "complete": False}  # fmt: skip
    bar = progress_bar(len(cells), "bench_draft")
    try:
        for name, vocab, rows, k in cells:
            bar.set_postfix_str(f"{name} rows={rows} k={k}")
            r = measure(loaded, name, rows, args.context, k, args.max_depth, args.reps, vocab, args.separate)
            doc["rows"].append(r)
            doc["complete"] = len(doc["rows"]) == len(cells)
            write_json(out_path, doc, indent=2)
            shown = "default" if vocab is None else vocab or "all"
            bar.write(f"| {name} | {shown} | {rows} | {k} | {r['forward_ms']:.2f} | {r['expansion_ms']:.2f} | "
                      f"{100 * r['expansion_vs_forward']:.1f}% |"
                      + (f" {r['expansion_separate_ms']:.2f} |" if args.separate else ""), file=sys.stdout)  # fmt: skip
            sys.stdout.flush()
            bar.update(1)
    finally:
        bar.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
