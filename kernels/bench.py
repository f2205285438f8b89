"""Benchmark of tree verification: median microseconds per `verify` call, Triton vs the torch reference.

    python -m kernels.bench [--json FILE] [--dtype float32|bfloat16] [--quick] [--threads N] [--walk-warps 4,8]
                             [--greedy-settings CHUNK:BLOCK:WARPS:WALK,...]

Shapes: B in {1, 8, 64}, N in {8, 32, 64}, V = 49152 (SmolLM2's vocabulary); modes greedy, sampling with
deterministic drafts, sampling with draft_probs (T = 1). On CPU only the reference runs (Triton needs CUDA), as it
is and writing preallocated buffers (``+buf``); on CUDA also Triton, as it is, with buffers, and with buffers
captured in a CUDA graph (``+graph``), timed with CUDA events after synchronisation (so a call's time includes
the host's launch of it), and that graph timed as ``triton.testing.do_bench`` times kernels (``+graph+pipe``: calls
enqueued back to back, each between CUDA events after an L2 flush: the device's time, as inside a captured step).
Trees are random chain-biased trees whose tokens are the parent row's argmax 70% of the time, so paths are
realistic. Fewer repetitions for the big shapes keep the CPU run
to a couple of minutes. A program, not a test: it prints a table and writes JSON with its provenance, after every
row (``complete``: false until the last one; a kill keeps the rows measured).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kernels.common import VerifyBuffers
from kernels.reference import verify_reference
from kernels.timing import holds_other_than_json

MODES = ("greedy", "sampling", "draft_probs")


def make_inputs(B: int, N: int, V: int, dtype: torch.dtype, device: str, stochastic: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    parents = torch.full((B, N), -1, dtype=torch.int64)
    for i in range(1, N):
        jump = torch.rand(B, generator=gen) < 0.3
        parents[:, i] = torch.where(jump, torch.randint(0, i, (B,), generator=gen), i - 1)
    logits = torch.randn(B, N, V, generator=gen, dtype=torch.float32) * 3  # logits: [B, N, V]
    am = logits.argmax(-1).gather(1, parents.clamp(min=0))  # parent row's top token per node
    tokens = torch.where(
        torch.rand(B, N, generator=gen) < 0.7, am, torch.randint(0, V, (B, N), generator=gen)
    )
    q = torch.softmax(logits, -1).to(dtype) if stochastic else None  # q: [B, N, V], a stand-in
    return (
        tokens.to(device),
        parents.to(device),
        logits.to(device, dtype),
        None if q is None else q.to(device),
    )


def time_call(
    fn: Callable[[], object], device: str, budget_s: float, max_reps: int, warmup: bool = True
) -> tuple[float, int]:
    """Median microseconds of fn over up to max_reps calls (at least 1) within about budget_s, after a warmup."""
    if warmup:
        fn()
    times: list[float] = []
    spent = 0.0
    while len(times) < max_reps and (spent < budget_s or not times):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            dt = start.elapsed_time(end) * 1e3
        else:
            t0 = time.perf_counter()
            fn()
            dt = (time.perf_counter() - t0) * 1e6
        times.append(dt)
        spent += dt / 1e6
    return statistics.median(times), len(times)


def time_pipelined(fn: Callable[[], object], reps: int) -> tuple[float, int]:
    """Median microseconds of ``fn`` on the device, as ``triton.testing.do_bench`` times a kernel: calls enqueued back
    to back (no synchronisation between them, so the host's launch latency hides behind the device's work), each
    between two CUDA events, and each after a 256 MB write that flushes the L2 cache (the logits come from memory,
    not from the previous call's cache lines)."""
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    fn()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)
    ]
    torch.cuda.synchronize()
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in events), reps


def cuda_graph(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` (which allocates nothing: it writes preallocated buffers) captured as a CUDA graph; returns its
    replay. Warmed up on a side stream first (Triton compiles there)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def run(dtype: torch.dtype, quick: bool, on_row: Callable[[list[dict]], object] | None = None) -> list[dict]:
    """Every (mode, B, N, implementation) timed; ``on_row(rows)`` after each row (the rows so far)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # +buf: preallocated outputs (kernels.VerifyBuffers: no allocation, no read-back); +graph: that call captured
    # in a CUDA graph and replayed (one launch of the whole verification)
    impls: dict[str, Callable] = {"torch": verify_reference, "torch+buf": verify_reference}
    if device == "cuda":
        from kernels.triton_verify import verify_triton

        impls = {"triton": verify_triton, "triton+buf": verify_triton, "triton+graph": verify_triton,
                 "triton+graph+pipe": verify_triton, "torch": verify_reference}  # fmt: skip
    V = 49152
    rows = []
    for B in (1, 8) if quick else (1, 8, 64):
        for N in (8, 32, 64):
            big = B * N >= 512
            for mode in MODES:
                tokens, parents, logits, q = make_inputs(B, N, V, dtype, device, mode == "draft_probs")
                T = 0.0 if mode == "greedy" else 1.0
                gen = torch.Generator(device=device).manual_seed(0)
                coins = torch.rand(B, N, generator=gen, device=device)
                final = torch.rand(B, generator=gen, device=device)
                for name, impl in impls.items():
                    out = None
                    if "+" in name:
                        out = VerifyBuffers(B, N, V, device, draft_probs=q is not None)
                    fn = functools.partial(
                        impl,
                        tokens,
                        parents,
                        logits,
                        temperature=T,
                        draft_probs=q,
                        coins=coins,
                        final_coins=final,
                        out=out,
                    )
                    if "+graph" in name:
                        fn = cuda_graph(fn)
                    # CPU, big shapes: no warmup (nothing to compile or cache; each call takes seconds)
                    warm = device == "cuda" or not big
                    if name.endswith("+pipe"):
                        us, reps = time_pipelined(fn, 10 if big else 100)
                    else:
                        us, reps = time_call(fn, device, 0.3 if big else 0.5, 3 if big else 50, warmup=warm)
                    rows.append(dict(mode=mode, B=B, N=N, V=V, impl=name, median_us=round(us, 1), reps=reps))
                    if on_row is not None:
                        on_row(rows)
                    print(
                        f"{mode:>12} B={B:<3} N={N:<3} {name:>6}: {us:>12.1f} us  ({reps} reps)", flush=True
                    )
                del tokens, parents, logits, q, fn
    return rows


def greedy_settings(dtype: torch.dtype, settings: list[tuple[int, int, int, int]],
                    on_row: Callable[[list[dict]], object] | None = None) -> list[dict]:  # fmt: skip
    """Greedy verify at B = 1 (N in {8, 32, 64}) and B = 8 (N = 64), captured in a CUDA graph, for each setting
    (chunk, block, warps, walk warps): tokens per program of the statistics (``kernels.common.GREEDY_CHUNK``), per
    load (``kernels.triton_verify.GREEDY_BLOCK``), that program's warps (``GREEDY_WARPS``) and the parallel walk's
    (``WALK_WARPS``); timed both ways (``+graph``, ``+graph+pipe``) and the statistics' launch alone in a graph
    (``stats+graph``: the rest of ``+graph`` is the walk and the gap between the two launches). ``on_row(rows)``
    after each row."""
    from kernels import common, triton_stats, triton_verify

    V, rows = 49152, []
    names = ("GREEDY_BLOCK", "GREEDY_WARPS", "WALK_WARPS")
    saved = common.GREEDY_CHUNK, *(getattr(triton_verify, n) for n in names)
    try:
        for B, N in ((1, 8), (1, 32), (1, 64), (8, 64)):
            tokens, parents, logits, _ = make_inputs(B, N, V, dtype, "cuda", False)
            nodes = torch.full((B,), N, dtype=torch.int64, device="cuda")
            for chunk, block, warps, walk in settings:
                common.GREEDY_CHUNK = chunk
                triton_verify.GREEDY_BLOCK, triton_verify.GREEDY_WARPS, triton_verify.WALK_WARPS = (
                    block,
                    warps,
                    walk,
                )
                out = VerifyBuffers(B, N, V, "cuda")
                fn = cuda_graph(
                    functools.partial(triton_verify.verify_triton, tokens, parents, logits, out=out)
                )
                stats = cuda_graph(
                    functools.partial(
                        triton_stats.greedy_stats_kernel[(B * N, common.greedy_splits(V))],
                        logits, nodes, out.part_m, out.part_s, out.part_am, N, V, common.greedy_splits(V),
                        CHUNK=chunk, BLOCK_V=min(block, chunk), num_warps=warps,
                    )
                )  # fmt: skip
                tag = f"c{chunk}/b{block}/w{warps}/walk{walk}"
                for name, (us, reps) in (
                    (f"triton+graph {tag}", time_call(fn, "cuda", 0.5, 50)),
                    (f"triton+graph+pipe {tag}", time_pipelined(fn, 100)),
                    (f"stats+graph {tag}", time_call(stats, "cuda", 0.5, 50)),
                ):
                    rows.append(
                        dict(mode="greedy", B=B, N=N, V=V, impl=name, median_us=round(us, 1), reps=reps)
                    )
                    if on_row is not None:
                        on_row(rows)
                    print(f"      greedy B={B:<3} N={N:<3} {name}: {us:>8.1f} us", flush=True)
    finally:
        common.GREEDY_CHUNK = saved[0]
        for n, v in zip(names, saved[1:]):
            setattr(triton_verify, n, v)
    return rows


def table(rows: list[dict]) -> str:
    impls = sorted({r["impl"] for r in rows}, reverse=True)
    head = "| mode | B | N | V | " + " | ".join(f"{i} µs" for i in impls) + " |"
    lines = [head, "|" + "---|" * (4 + len(impls))]
    keys = sorted(
        {(r["mode"], r["B"], r["N"], r["V"]) for r in rows}, key=lambda k: (MODES.index(k[0]), k[1], k[2])
    )
    for k in keys:
        cells = [next((f"{r['median_us']:.1f}" for r in rows if (r["mode"], r["B"], r["N"], r["V"]) == k
                       and r["impl"] == i), "-") for i in impls]  # fmt: skip
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    """No abbreviated options; an error is one line and exit code 2 (as the upper layers' programs, whose entry
    ``env.cli`` this layer may not import)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {' '.join(message.split())}\n")
        sys.exit(2)


MAX_THREADS = 4096  # far above any machine's cores; torch crashes on a count it cannot start


def _threads(text: str) -> int:
    if not text.isascii() or not text.isdigit() or not 1 <= int(text) <= MAX_THREADS:
        raise argparse.ArgumentTypeError(f"must be an integer in [1, {MAX_THREADS}], got {text!r}")
    return int(text)


def _warps(text: str) -> list[int]:
    items = text.split(",")
    if not all(x.isascii() and x.isdigit() and int(x) in (1, 2, 4, 8, 16, 32) for x in items):
        raise argparse.ArgumentTypeError(f"must be a comma list of 1, 2, 4, 8, 16 or 32, got {text!r}")
    return [int(x) for x in items]


def _settings(text: str) -> list[tuple[int, int, int, int]]:
    out = []
    for item in text.split(","):
        parts = item.split(":")
        ok = len(parts) == 4 and all(p.isascii() and p.isdigit() for p in parts)
        if ok:
            chunk, block, warps, walk = (int(p) for p in parts)
            pow2 = lambda x: x > 0 and x & (x - 1) == 0  # noqa: E731
            ok = (
                pow2(chunk)
                and pow2(block)
                and 64 <= block <= chunk <= 65536
                and warps in (1, 2, 4, 8, 16, 32)
            )
            ok = ok and walk in (1, 2, 4, 8, 16, 32)
        if not ok:
            raise argparse.ArgumentTypeError(
                f"must be a comma list of CHUNK:BLOCK:WARPS:WALK_WARPS (powers of two, 64 <= BLOCK <= CHUNK <= "
                f"65536; warps 1-32), got {item!r}"
            )
        out.append((chunk, block, warps, walk))
    return out


def _json_problem(path: str) -> str | None:
    """Why ``--json path`` cannot take the results (None: it can), found before the benchmark runs."""
    out = Path(path)
    if out.is_dir() or path.endswith(("/", os.sep)):
        return f"--json {path} is a directory, not a file"
    if (
        out.exists() and not out.is_file()
    ):  # the results, renamed into place, would replace a FIFO or a device
        return f"--json {path} is not a regular file (a device, FIFO or socket); not overwritten"
    if not out.parent.is_dir() and out.parent.exists():
        return f"--json {path}: {out.parent} is a file, not a folder"
    if holds_other_than_json(out):  # a misplaced flag naming a workload, a trace, a model file
        return f"--json {path} exists and is not a JSON file; not overwritten"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return f"--json {path}: cannot make {out.parent} ({err.strerror})"
    probe = out.parent / f".{out.name}.{os.getpid()}.probe"
    try:  # a folder we cannot write in fails now, not after the benchmark
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        return f"--json {path}: cannot write in {out.parent} ({err.strerror})"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = _Parser(prog="python -m kernels.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="FILE", help="write rows and provenance as JSON")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="logits dtype")
    ap.add_argument("--quick", action="store_true", help="skip B = 64")
    ap.add_argument("--threads", type=_threads, help="torch CPU threads (default: torch's choice)")
    ap.add_argument(
        "--walk-warps", type=_warps, metavar="LIST",
        help="CUDA: only greedy verify, the parallel walk on each of these numbers of warps (e.g. 2,4,8,16)",
    )  # fmt: skip
    ap.add_argument(
        "--greedy-settings", type=_settings, metavar="LIST",
        help="CUDA: only greedy verify, for each CHUNK:BLOCK:WARPS:WALK_WARPS (e.g. 4096:1024:4:8,4096:4096:8:8): "
        "tokens per program and per load of the statistics, that program's warps, the walk's warps",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.json is not None:  # checked before the benchmark runs, not after it
        try:  # (a name too long for the file system fails every look at it)
            why = _json_problem(args.json)
        except OSError as err:
            why = f"--json {args.json}: {err.strerror or err}"
        if why:
            ap.error(why)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.walk_warps is not None and args.greedy_settings is not None:
        ap.error("--walk-warps and --greedy-settings: give one (a setting names its walk's warps too)")
    prov = dict(
        command=" ".join(["python -m kernels.bench", *(argv if argv is not None else sys.argv[1:])]),
        torch=torch.__version__,
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        threads=torch.get_num_threads(),
        dtype=args.dtype,
    )
    try:
        import triton

        prov["triton"] = triton.__version__
    except ImportError:
        prov["triton"] = None
    failed: list[str] = []

    def save(rows: list[dict], complete: bool = False) -> None:
        """The rows so far, after every row: written whole, then renamed (a kill keeps the rows measured)."""
        if not args.json or failed:
            return
        tmp = f"{args.json}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(dict(provenance=prov, complete=complete, rows=rows), f, indent=1)
            os.replace(tmp, args.json)
        except OSError as err:  # the table is the result; say why the file is not there, once, at the end
            failed.append(str(err.strerror or err))

    if args.walk_warps is not None or args.greedy_settings is not None:
        if not torch.cuda.is_available():
            ap.error("--walk-warps and --greedy-settings need CUDA (the Triton kernels)")
        from kernels import common, triton_verify

        here = (common.GREEDY_CHUNK, triton_verify.GREEDY_BLOCK, triton_verify.GREEDY_WARPS)
        settings = args.greedy_settings or [(*here, w) for w in args.walk_warps]
        rows = greedy_settings(getattr(torch, args.dtype), settings, on_row=save)
    else:
        rows = run(getattr(torch, args.dtype), args.quick, on_row=save)
    print()
    print(table(rows))
    save(rows, complete=True)
    if failed:
        print(f"kernels.bench: error: --json {args.json}: {failed[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
