"""What one step of the device loop (``env.device_loop``) costs, by chain depth and by stage:
``python -m env.bench_device_step`` times, for each ``--depths`` D (0: an AR step), the whole step and each of its
stages — draft (the prompt lookup), forward (the target over the chain, LM head included), verify, commit — of
``--rows`` rows (default 1) whose prompts are ``--context`` random tokens, all at the same span of key positions.
On CUDA every piece is captured as its own CUDA graph and replayed ``--steps`` times back to back between two CUDA events (the time the
device spends, as inside the step's graph); elsewhere each is timed eagerly. Median ms per step over ``--reps``
repetitions, the depths in turn within every repetition. ``--profile`` (CUDA) adds, per depth, the GPU kernels of
the step's graph (torch.profiler): their number and the most expensive ones, µs per step.

    python -m env.bench_device_step --model random:smollm2-135m --device cuda --depths 0,4,8,16 --profile
    python -m env.bench_device_step --device cuda --rows 16 --depths 0,2,4,8    # a busier step: 16 rows at once
    python -m env.bench_device_step --depths 0,4 --steps 8 --reps 3            # this CPU, the embedded model
    python -m env.bench_device_step --device cuda --attention-merge rows       # the attention's other merge

A program, not a test: a table, and ``--json`` (written after every repetition) with its provenance.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

PROG = "python -m env.bench_device_step"
STAGES = ("step", "draft", "forward", "verify", "commit")


def main(argv: list[str] | None = None) -> int:
    from env.cli import run_program

    return run_program(PROG, _main, argv)


def _stage_fns(loop: Any, span: int) -> dict[str, Callable[[], object]]:
    """The step and each of its stages as calls without arguments (the stages after the first read the inputs a
    step would give them, made once here)."""
    ids = loop.draft()
    logits = loop.forward(ids, span)
    verdict = loop.verify(ids, logits)
    return {
        "step": lambda: loop.step(span),
        "draft": loop.draft,
        "forward": lambda: loop.forward(ids, span),
        "verify": lambda: loop.verify(ids, logits),
        "commit": lambda: loop.commit(ids, verdict),
    }


def _time_ms(fn: Callable[[], object], steps: int, cuda: bool) -> float:
    """Mean ms per call of ``steps`` calls: back to back between two CUDA events (the device's time), or by the
    host's clock."""
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(steps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / steps
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t0) * 1e3 / steps


def _kernels(fn: Callable[[], object], steps: int, top: int) -> dict[str, Any]:
    """The GPU kernels ``steps`` calls of ``fn`` run: number per step and the ``top`` most expensive, µs per step."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    per: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per.setdefault(ev.name, []).append(ev.time_range.elapsed_us())
    rows = sorted(((sum(ts) / steps, len(ts) / steps, name) for name, ts in per.items()), reverse=True)
    return {
        "kernels_per_step": round(sum(n for _, n, _ in rows), 1),
        "gpu_us_per_step": round(sum(us for us, _, _ in rows), 1),
        "top": [dict(us=round(us, 1), count=round(n, 1), name=name[:120]) for us, n, name in rows[:top]],
    }


def _profile(doc, depths, loops, fns, prompts, new, span, steps) -> None:
    """Each depth's kernels a step, into ``doc``'s rows."""
    for d in depths:
        loops[d].prefill(prompts, new)
        k = _kernels(fns[d]["step"], steps, 12)
        k["source"] = "graph replays"
        if not k["kernels_per_step"]:  # a profiler that does not see into graphs: the same step, eager
            loops[d].prefill(prompts, new)
            k = dict(_kernels(lambda d=d: loops[d].step(span), steps, 12), source="eager steps")
        doc["rows"][depths.index(d)]["kernels"] = k


def _main(argv: list[str] | None) -> int:
    from env.cli import (
        Parser,
        ProgramError,
        check_context,
        int_at_least,
        int_list,
        output_file,
        positive_int,
        progress_bar,
        write_json,
    )
    from env.device_loop import SPAN_STEP, DeviceLoop, _round_up
    from env.lean import lean_of
    from env.machine import cpu_label
    from env.model import ModelError, load_model
    from env.serve_sim import MAX_BATCH
    from kernels.bench import cuda_graph

    ap = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model", default=None, help="the target (default: the embedded model; random:SHAPE too)"
    )
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "auto"])
    ap.add_argument("--depths", default="0,4,8,16", help="chain depths, 0 for an AR step (default 0,4,8,16)")
    ap.add_argument("--context", type=positive_int, default=1024, help="prompt tokens (default 1024)")
    ap.add_argument(
        "--rows", type=int_at_least(1, MAX_BATCH), default=1, help="rows decoded together (default 1)"
    )
    ap.add_argument("--steps", type=positive_int, default=32, help="calls per timing (default 32)")
    ap.add_argument("--reps", type=positive_int, default=5, help="repetitions (default 5)")
    ap.add_argument("--profile", action="store_true", help="CUDA: the step's kernels per depth")
    ap.add_argument(
        "--attention-merge", choices=("kv", "rows"), default=None,
        help="the split-key attention's merge of its chunks (kernels.triton_attention.MERGE; default: as it is)",
    )  # fmt: skip
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    depths = int_list(args.depths, "--depths", low=0)
    if max(depths) > 31:
        raise ProgramError(f"--depths: at most 31, got {max(depths)}")
    from env.model import model_folder

    out = output_file(args.json, folders=(model_folder(args.model),))
    merge = None  # the attention's merge in effect (None: no Triton here)
    try:
        from kernels import triton_attention
    except ImportError:
        if args.attention_merge is not None:
            raise ProgramError(
                "--attention-merge: the split-key attention needs Triton, which is not installed"
            ) from None
    else:
        if args.attention_merge is not None:
            triton_attention.MERGE = args.attention_merge
        merge = triton_attention.MERGE
    try:
        loaded = load_model(args.model, dtype=args.dtype, device=args.device)
        net = lean_of(loaded)  # a ModelError too where the lean forward would not reproduce the model
    except ModelError as err:
        raise ProgramError(str(err)) from err
    if net is None:
        raise ProgramError(f"{loaded.model_id} has no lean forward (a Llama-family target is needed)")
    cuda = loaded.device.type == "cuda"
    top_q = max(depths) + 1
    new = args.steps * top_q + 2  # a row stays live through every timed step of the deepest chain
    ctx = args.context + new + top_q
    check_context(loaded, ctx, f"--context {args.context} with --steps {args.steps}")
    span = _round_up(ctx + top_q, SPAN_STEP)  # every depth reads the same span
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 1000, (args.context,), generator=gen).tolist() for _ in range(args.rows)]
    loops, fns = {}, {}
    for d in depths:
        loop = DeviceLoop(net, args.rows, d, ctx + top_q, [], graph=False)
        loop.prefill(prompts, new)
        stage = _stage_fns(loop, span)
        loops[d] = loop
        fns[d] = {k: cuda_graph(f) if cuda else f for k, f in stage.items()}
    times: dict[int, dict[str, list[float]]] = {d: {k: [] for k in STAGES} for d in depths}
    prov = dict(command=" ".join([PROG, *(sys.argv[1:] if argv is None else argv)]), model=loaded.model_id, device=str(loaded.device),
                gpu=torch.cuda.get_device_name() if cuda else None, cpu=cpu_label(), torch=torch.__version__,
                dtype=args.dtype, context=args.context, rows=args.rows, span=span, steps=args.steps,
                attention_merge=merge)  # fmt: skip
    doc: dict[str, Any] = dict(provenance=prov, rows=[])
    bar = progress_bar(args.reps * len(depths), "device step")
    for _ in range(args.reps):
        for d in depths:
            loops[d].prefill(prompts, new)  # back at their prompts: every repetition times the same steps
            for k in STAGES:
                times[d][k].append(_time_ms(fns[d][k], args.steps, cuda))
            bar.update(1)
        doc["rows"] = [
            dict(depth=d, **{f"{k}_ms": round(statistics.median(times[d][k]), 4) for k in STAGES})
            for d in depths
        ]
        write_json(out, doc)
    bar.close()
    if args.profile and cuda:
        try:
            _profile(doc, depths, loops, fns, prompts, new, span, args.steps)
        except Exception as err:  # noqa: BLE001 - the timings above are kept; the error is reported with them
            doc["profile_error"] = f"{type(err).__name__}: {err}"
            print(f"profile failed: {doc['profile_error']}")
        write_json(out, doc)
    print(f"{loaded.model_id}, {loaded.device}, {args.dtype}, span {span}; ms a step, median of {args.reps}")
    print("| depth | step | draft | forward | verify | commit | x depth 0 |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    base = doc["rows"][0]["step_ms"] if depths[0] == 0 else None
    for r in doc["rows"]:
        ratio = f"{r['step_ms'] / base:.2f}" if base else "-"
        cells = " | ".join(f"{r[f'{k}_ms']:.3f}" for k in STAGES)
        print(f"| {r['depth']} | {cells} | {ratio} |")
    for r in doc["rows"]:
        if "kernels" in r:
            k = r["kernels"]
            print(
                f"\ndepth {r['depth']}: {k['kernels_per_step']} kernels, {k['gpu_us_per_step']} µs of them a step"
            )
            for t in k["top"]:
                print(f"  {t['us']:>8.1f} µs  x{t['count']:<5} {t['name']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
