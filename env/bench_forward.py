"""What one target forward costs, per forward path and weight format: ``python -m env.bench_forward`` times, for
each node count q, the Hugging Face forward of ``--rows`` rows x q tokens over a ``DynamicCache`` of ``--context``
tokens (its own causal mask), and the engine's forward (``env.batch.BatchTarget``) of the same over the ragged cache
in each ``--weights`` format of the lean forward (``env.lean``); LM head included (logits of all q nodes), median
ms, all timed in turn within every repetition; a row per node count, printed (and written to ``--json``) as it is
measured. ``--compiled`` adds each format through ``torch.compile`` (``--forward compiled``; compiled before
timing); ``--prefill N`` adds the prefill of one N-token prompt per path.

    python -m env.bench_forward --q 1,4,8,16,32 --context 300 --dtype bf16 --weights dense,int8,int4
    python -m env.bench_forward --q 1,4,8 --weights dense,int4 --compiled --prefill 250
    python -m env.bench_forward --q 1,16 --rows 8 --weights dense,int4 --prefill 700 --wide-native

``--wide-native`` adds each format with wide products (128 rows or more) in the activation dtype, as if
``DRAFTGYM_WIDE_MATMUL=native`` (``kernels.quant.wide_in_fp32``), timed in turn with the probed setting.
``--fp32-plain`` adds each format with fp32 products through ``F.linear`` (MKL), as if
``DRAFTGYM_FP32_MATMUL=plain``, timed in turn with oneDNN's reordered weights (``kernels.packed.packed_fp32``).

    python -m env.bench_forward --dtype fp32 --weights dense --q 1,2,4,8,16 --rows 1 --fp32-plain
"""

from __future__ import annotations

import sys

import torch

from env.bench_batch import _interleaved_ms


def hf_forward(loaded, rows: int, context: int, q: int):
    from transformers import DynamicCache

    model = loaded.model
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 1000, (rows, context), generator=gen)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids.to(loaded.device), cache=cache, use_cache=True)
    nxt = torch.randint(100, 1000, (rows, q), generator=gen).to(loaded.device)
    pos = (context + torch.arange(q))[None].expand(rows, q).to(loaded.device)

    @torch.no_grad()
    def step():
        model(input_ids=nxt, position_ids=pos, cache=cache, use_cache=True)
        cache.crop(-q)

    return step


def engine_forward(loaded, rows: int, context: int, q: int):
    from env.batch import BatchEngine

    eng = BatchEngine(loaded, rows)
    gen = torch.Generator().manual_seed(0)
    for _ in range(rows):
        eng.admit(torch.randint(100, 1000, (context,), generator=gen).tolist(), {})
    t = eng.target
    nxt = torch.randint(100, 1000, (rows, q), generator=gen)
    lens = [t.cache.lens[r] for r in range(rows)]
    pos = torch.tensor(lens)[:, None] + torch.arange(q)[None]

    @torch.no_grad()
    def step():
        t.head(t._forward(nxt, pos, None, lens))  # nothing committed: the next call writes the same slots

    return step


def engine_prefill(loaded, n: int):
    from env.batch import BatchEngine

    eng = BatchEngine(loaded, 1)
    ids = torch.randint(100, 1000, (n,), generator=torch.Generator().manual_seed(1)).tolist()

    @torch.no_grad()
    def step():  # the prompt's forward and the LM head at its last position (what admitting a row runs)
        pf = eng.begin_prefill(ids)
        eng.prefill_chunk(pf)
        eng.target.head(pf.hidden[-1][-1])

    return step


def hf_prefill(loaded, n: int):
    ids = torch.randint(100, 1000, (1, n), generator=torch.Generator().manual_seed(1)).to(loaded.device)

    @torch.no_grad()
    def step():  # the LM head at the last position only, as ``generate``'s prefill runs it
        loaded.model(input_ids=ids, use_cache=True, logits_to_keep=1)

    return step


def _natively(step, dtype: torch.dtype):
    """``step`` with wide products in the activation dtype (the probe's decision put back after each call)."""
    from kernels import quant

    def run():
        saved = quant.wide_in_fp32(dtype)  # the probed or kept setting, decided before it is overridden
        quant.decide_wide(dtype, False)
        try:
            step()
        finally:
            quant.decide_wide(dtype, saved)

    return run


def _plainly(step):
    """``step`` with fp32 products through ``F.linear`` (the reordering decision put back after each call)."""
    from kernels import packed

    def run():
        saved = packed.packed_fp32()
        packed.decide_packed(False)
        try:
            step()
        finally:
            packed.decide_packed(saved)

    return run


PROG = "python -m env.bench_forward"


def main(argv: list[str] | None = None) -> int:
    from env.cli import run_program

    return run_program(PROG, _main, argv)


def _main(argv: list[str] | None) -> int:
    from env.cli import Parser, check_context, int_list, output_file, positive_int, progress_bar, write_json
    from env.machine import cpu_label
    from env.model import WEIGHTS, ModelError, load_model, model_folder, resolve_weights

    ap = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--q", default="1,4,8,16,32", help="node counts per row (default 1,4,8,16,32)")
    ap.add_argument("--rows", type=positive_int, default=1)
    ap.add_argument("--context", type=positive_int, default=300)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "auto"])
    ap.add_argument(
        "--weights", default="dense,int8,int4", help="lean weight formats (default dense,int8,int4)"
    )
    ap.add_argument("--compiled", action="store_true", help="also each format through torch.compile")
    ap.add_argument(
        "--prefill", type=int, default=0, help="also time the prefill of a prompt of this many tokens"
    )
    ap.add_argument(
        "--wide-native",
        action="store_true",
        help="also each format with wide products in the activation dtype",
    )
    ap.add_argument(
        "--fp32-plain",
        action="store_true",
        help="also each format with fp32 products through F.linear instead of oneDNN's reordered weights",
    )
    ap.add_argument("--reps", type=positive_int, default=20)
    ap.add_argument("--model", default=None)
    ap.add_argument("--json", default=None, help="write the table as JSON to this file (after each row)")
    args = ap.parse_args(argv)
    if args.prefill < 0:
        ap.error(f"argument --prefill: must be >= 0, got {args.prefill}")
    qs = int_list(args.q, "--q")
    formats = [w.strip() for w in args.weights.split(",") if w.strip()]
    bad = [w for w in formats if w not in WEIGHTS]
    if bad or not formats:
        raise ModelError(f"--weights: unknown weight format {bad[0] if bad else args.weights!r}; valid: "
                         + ", ".join(WEIGHTS))  # fmt: skip
    out_path = output_file(args.json, folders=(model_folder(args.model),))
    base = load_model(args.model, dtype=args.dtype, device="cpu")
    check_context(
        base, max(args.context + max(qs), args.prefill + 1), f"--context {args.context}, --q, --prefill"
    )
    fmt = {w: resolve_weights(w, base.device, base.dtype) for w in formats}
    variants = {f"lean-{w}": base.replace(weights=fmt[w]) for w in formats}
    if args.compiled:
        variants.update({f"compiled-{w}": base.replace(weights=fmt[w], forward="compiled") for w in formats})
    torch.manual_seed(0)
    names = ["hf", *variants, *(f"{n}-native" for n in variants if args.wide_native)]
    names += [f"{n}-plain" for n in variants if args.fp32_plain]

    def engines(make, *shape):
        fns = [make(v, *shape) for v in variants.values()]
        fns += [_natively(make(v, *shape), base.dtype) for v in variants.values()] if args.wide_native else []
        return fns + ([_plainly(make(v, *shape)) for v in variants.values()] if args.fp32_plain else [])

    machine = f"{cpu_label()}, {torch.get_num_threads()} threads"
    print(f"# median ms per forward (LM head included), rows={args.rows}, context={args.context}, "
          f"dtype={args.dtype}; {machine}")  # fmt: skip
    print("| nodes | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names), flush=True)
    table: list[dict] = []
    doc = {"machine": machine, "rows": args.rows, "context": args.context, "dtype": args.dtype, "table": table,
           "complete": False}  # fmt: skip
    cells = [*qs, *([f"prefill {args.prefill}"] if args.prefill else [])]
    bar = progress_bar(len(cells), "bench_forward")
    try:
        for q in cells:
            bar.set_postfix_str(f"q={q}")
            if isinstance(q, int):
                fns = [
                    hf_forward(base, args.rows, args.context, q),
                    *engines(engine_forward, args.rows, args.context, q),
                ]
                ms = _interleaved_ms(fns, args.reps)
            else:
                fns = [hf_prefill(base, args.prefill), *engines(engine_prefill, args.prefill)]
                ms = _interleaved_ms(fns, max(3, args.reps // 4))
            row = {"q": q, **dict(zip(names, ms))}
            table.append(row)
            doc["complete"] = len(table) == len(cells)
            write_json(out_path, doc)
            label = f"q={q}" if isinstance(q, int) else q
            bar.write(f"| {label} | " + " | ".join(f"{row[n]:.1f}" for n in names) + " |", file=sys.stdout)
            sys.stdout.flush()
            bar.update(1)
    finally:
        bar.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
