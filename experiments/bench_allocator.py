"""The C allocator's setting against serving speed: ``python -m experiments.bench_allocator``.

``env.allocator.settle_allocator`` keeps freed memory in the process (``DRAFTGYM_MALLOC=keep``, the default) where
glibc would unmap it (``system``). A setting holds for a whole process, so each is measured in processes of its
own, the two alternating round by round (``system`` first in odd rounds, ``keep`` first in even ones) so that a
drift of the machine's speed hits both alike, after an untimed process that writes the caches every later one
reads. The environment's own allocator variables (``env.allocator.ALLOCATOR_VARS``) are left out of them. Each
process loads the target, serves the two-request warm-up every live run serves (``experiments.serve_live.warm_up``: every arm of ``--menu`` in turn), then the same held-out request
stream of the serving trace ``--passes`` times in a row at ``--load`` under the static arm ``--arm``, through the path
``draftgym evaluate --serve`` takes live, in the dtype the cost model was measured in (``--batch-cost``; its
replay is not used here). Printed for every process in the order run, and per setting the median over its
processes: each pass's seconds in the target's forward, and the process's CPU seconds in the kernel (page faults
among them) and in user code and its peak resident memory, over the passes.

    python -m experiments.bench_allocator --rounds 2 --passes 3 --load 16
    # a menu with model heads: a trace that recorded them, a cost model that prices them
    python -m experiments.bench_allocator --trace serve_trace_h0.npz --batch-cost bc_k.json \
        --menu none,eagle3-d1,hybrid-d1 --load 16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from experiments.errors import UserError

PROG = "python -m experiments.bench_allocator"
MODES = ("system", "keep")  # env.allocator.SETTINGS, glibc's own first in odd rounds


def _peak_reset() -> bool:
    """Reset this process's peak resident memory (Linux: ``/proc/self/clear_refs``), so that the peak read after
    the passes is theirs, not the model's loading."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _peak_mib() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def child(args: argparse.Namespace, inputs: tuple[Any, ...]) -> dict[str, Any]:
    """One process's measurement under the setting its environment names: the passes' forward seconds, and the
    process's kernel and user CPU seconds and peak resident memory over the passes alone. ``inputs``: what
    ``experiments.serve_fidelity.live_inputs`` gave."""
    import resource

    from env.allocator import allocator_state
    from experiments.serve_fidelity import diagnose, load_and_warm

    trace, options, cost, menu, dtype = inputs
    loaded = load_and_warm(trace, cost, menu, options, dtype)
    reset = _peak_reset()
    before = resource.getrusage(resource.RUSAGE_SELF)
    runs = []
    for _ in range(args.passes):
        got = diagnose(cost, args.arm, args.load, loaded, args.requests, trace=trace, arms=menu,
                       drafter_options=options)  # fmt: skip
        runs.append(
            {k: got["live"][k] for k in ("forward_s", "step_s", "prefill_s", "wall_s", "steps", "tokens")}
        )
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {**allocator_state(), "passes": runs, "sys_s": after.ru_stime - before.ru_stime,
            "user_s": after.ru_utime - before.ru_utime, "peak_mib": _peak_mib() if reset else None}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from env.cli import run_program
    from experiments.errors import USER_ERROR_TYPES

    return run_program(PROG, _main, argv, USER_ERROR_TYPES)


def _main(argv: list[str] | None) -> int:
    from env.cli import Parser, output_file, positive_int
    from env.serve_sim import DEFAULT_ARMS

    p = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=positive_int, default=2, help="processes per setting")
    p.add_argument(
        "--passes", type=positive_int, default=3, help="the stream served this many times per process"
    )
    p.add_argument("--load", default="16", help="a closed-loop concurrency (or ramp)")
    p.add_argument("--arm", default="none", help="the static arm served (one of --menu)")
    p.add_argument("--trace", default=None, help="serving trace (.npz; default: the bundled one)")
    p.add_argument(
        "--batch-cost", default=None, help="batch cost model JSON for the replay (default: the shipped one)"
    )
    p.add_argument("--menu", default=",".join(DEFAULT_ARMS),
                   help="comma list of the arms the warm-up serves, as a live run's menu (default: the serving env's)")  # fmt: skip
    p.add_argument("--requests", type=positive_int, default=16)
    p.add_argument("--json", default=None, help="write every process's measurement here")
    p.add_argument("--child", default=None, choices=MODES, help=argparse.SUPPRESS)  # one measuring process
    args = p.parse_args(argv)
    from env.serve_sim import parse_load
    from experiments.serve_fidelity import live_inputs

    parse_load(args.load, 16)
    # checked here, before any process starts: the trace, the cost model (the target is served in its dtype) and
    # the menu
    inputs = live_inputs(args.trace, args.batch_cost, args.menu, "--menu", [args.load])
    menu, dtype = inputs[3], inputs[4]
    if args.arm not in menu:
        raise UserError(f"--arm {args.arm!r} is not in the menu: {', '.join(menu)}")
    if args.child is not None:
        out = child(args, inputs)
        print(json.dumps(out))
        return 0
    from env.batch_cost import default_batch_cost_path
    from env.model import model_folder

    json_out = output_file(args.json, flag="--json", inputs=(args.batch_cost or default_batch_cost_path(), args.trace),
                           folders=(model_folder(None),))  # fmt: skip
    from env.allocator import ALLOCATOR_VARS, glibc_mallopt
    from env.lean import attention_mode
    from kernels import packed, quant

    if glibc_mallopt() is None:
        raise UserError("this process has no glibc mallopt (another C library, or LD_PRELOAD names another "
                        "allocator): there is no setting to compare")  # fmt: skip
    try:  # a setting every child would refuse: refused here, once
        quant.wide_mode(), packed.packed_mode(), attention_mode()
    except (quant.QuantError, ValueError) as err:
        raise UserError(str(err)) from err
    from tqdm import tqdm

    from env.machine import machine_info

    results: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    order = [m for r in range(args.rounds) for m in (MODES if r % 2 == 0 else MODES[::-1])]
    # the environment's own allocator variables would set what the two settings compare: left out of the children
    base = {k: v for k, v in os.environ.items() if k not in ALLOCATOR_VARS}
    about = {"machine": machine_info(), "load": args.load, "arm": args.arm, "menu": menu, "trace": args.trace,
             "batch_cost": args.batch_cost, "requests": args.requests, "passes": args.passes, "dtype": dtype,
             "order": order}  # fmt: skip
    # an untimed process first: the first process after an install writes the caches (the lean model's, the
    # machine's decisions) that every later one reads
    for i, mode in enumerate(tqdm(["keep", *order], desc="allocator processes", unit="process")):
        passes = 1 if i == 0 else args.passes
        cmd = [sys.executable, "-m", "experiments.bench_allocator", "--child", mode, "--passes", str(passes),
               "--load", args.load, "--arm", args.arm, "--requests", str(args.requests), "--menu", ",".join(menu)]  # fmt: skip
        cmd += [
            x
            for flag, v in (("--trace", args.trace), ("--batch-cost", args.batch_cost))
            if v
            for x in (flag, v)
        ]
        done = subprocess.run(cmd, env={**base, "DRAFTGYM_MALLOC": mode}, capture_output=True, text=True,
                              check=False)  # fmt: skip
        lines = done.stdout.strip().splitlines()
        if done.returncode != 0 or not lines:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise UserError(f"a {mode} process failed (exit code {done.returncode}): {last}")
        try:
            got = json.loads(lines[-1])
            ran = got["allocator"]
        except (ValueError, KeyError, TypeError):
            raise UserError(f"a {mode} process ended without its measurement: {lines[-1][:200]!r}") from None
        if ran != mode:  # glibc did not take the whole setting
            raise UserError(f"the {mode} process ran with the allocator {ran!r}: this glibc did not take the "
                            "setting")  # fmt: skip
        if i == 0:  # the priming process: not counted
            continue
        results[mode].append(got)
        if json_out is not None:  # as measured: a kill keeps the processes done
            from env.files import atomic_write_text

            atomic_write_text(json_out, json.dumps({**about, "results": results}, indent=1) + "\n")
    print(f"{about['machine']['cpu_label']}; {dtype}; arm {args.arm} at load {args.load}, {args.requests} requests; "
          "each process in the order run, then the medians over the processes of each setting; CPU seconds and "
          "peak memory over the passes")  # fmt: skip
    cols = " ".join(f"{'pass ' + str(i + 1) + ' fwd s':>13}" for i in range(args.passes))
    print(f"{'allocator':>9} {'round':>5} {cols} {'sys s':>7} {'user s':>7} {'peak MiB':>9}")
    seen = dict.fromkeys(MODES, 0)
    for mode in order:  # every process: a drift of the machine shows as a round apart from the other
        r = results[mode][seen[mode]]
        seen[mode] += 1
        cells = " ".join(f"{x['forward_s']:13.2f}" for x in r["passes"])
        print(f"{mode:>9} {seen[mode]:>5} {cells} {r['sys_s']:7.1f} {r['user_s']:7.1f} {peak([r])}")
    for mode in MODES:
        rs = results[mode]
        med = [statistics.median(r["passes"][i]["forward_s"] for r in rs) for i in range(args.passes)]
        cells = " ".join(f"{x:13.2f}" for x in med)
        print(f"{mode:>9} {'med':>5} {cells} {statistics.median(r['sys_s'] for r in rs):7.1f} "
              f"{statistics.median(r['user_s'] for r in rs):7.1f} {peak(rs)}")  # fmt: skip
    return 0


def peak(rs: list[dict[str, Any]]) -> str:
    got = [r["peak_mib"] for r in rs if r.get("peak_mib") is not None]
    return f"{statistics.median(got):9.0f}" if got else f"{'-':>9}"


if __name__ == "__main__":
    raise SystemExit(main())
