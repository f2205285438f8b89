"""The batch engine's own overhead: ``python -m env.bench_batch`` times, for each batch size B, the bare Hugging Face
forward of B rows x 1 token on a ``DynamicCache`` of ``--context`` tokens per row (``c(B, q=1)``, what the model
itself costs), and one autoregressive step of ``env.batch.BatchEngine`` over B rows of the same context (the ragged
cache, masks, verification, commit); prints the medians and the engine's share of the raw bound.

    python -m env.bench_batch --rows 1,4,8,16 --context 300 --dtype bf16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _median_ms(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def raw_forward_ms(loaded, rows: int, context: int, reps: int) -> float:
    from transformers import DynamicCache

    model = loaded.model
    ids = torch.randint(100, 1000, (rows, context), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids.to(loaded.device), cache=cache, use_cache=True)
        nxt = torch.randint(100, 1000, (rows, 1)).to(loaded.device)
        pos = torch.full((rows, 1), context, device=loaded.device)

        def step():
            model(input_ids=nxt, position_ids=pos, cache=cache, use_cache=True)
            cache.crop(-1)

        return _median_ms(step, reps)


def engine_step_ms(loaded, rows: int, context: int, reps: int) -> float:
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

    return _median_ms(step, reps)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m env.bench_batch", description=__doc__.split("\n\n")[0],
                                 allow_abbrev=False)  # fmt: skip
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    ap.add_argument("--json", default=None, help="write the rows to this file")
    args = ap.parse_args()
    from env.cost import machine_info
    from env.model import load_model

    loaded = load_model(dtype=args.dtype, device="cpu")
    out = []
    print(f"{'rows':>5}{'raw ms':>9}{'engine ms':>11}{'engine / raw':>14}")
    for b in [int(x) for x in args.rows.split(",")]:
        raw = raw_forward_ms(loaded, b, args.context, args.reps)
        eng = engine_step_ms(loaded, b, args.context, args.reps)
        out.append({"rows": b, "context": args.context, "raw_ms": raw, "engine_ms": eng, "share": raw / eng})
        print(f"{b:>5}{raw:>9.1f}{eng:>11.1f}{raw / eng:>14.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": out, "dtype": str(loaded.dtype), "machine": machine_info()}, fh, indent=2)


if __name__ == "__main__":
    main()
