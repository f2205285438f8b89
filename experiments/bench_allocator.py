"""The C allocator's setting against serving speed: ``python -m experiments.bench_allocator``.

``env.machine.settle_allocator`` keeps freed memory in the process (``DRAFTGYM_MALLOC=keep``, the default) where
glibc would unmap it (``system``). A setting holds for a whole process, so each is measured in processes of its
own, the two alternating round by round (``system`` first in odd rounds, ``keep`` first in even ones) so that a
drift of the machine's speed hits both alike. Each process loads the target, serves the two-request warm-up every
live run serves (``experiments.serve_live.warm_up``), then the same held-out request stream of the bundled serving
trace ``--passes`` times in a row at ``--load`` under the static arm ``--arm``, through the path
``draftgym evaluate --serve`` takes live. Printed per setting, the median over rounds of each pass's seconds in the
target's forward and of the process's CPU seconds in the kernel (page faults among them) and its peak resident
memory.

    python -m experiments.bench_allocator --rounds 2 --passes 3 --load 16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

from experiments.errors import UserError

PROG = "python -m experiments.bench_allocator"
MODES = ("system", "keep")


def child(arm: str, load: str, passes: int, requests: int, dtype: str) -> dict[str, Any]:
    """One process's measurement under the setting its environment names."""
    import resource

    from env.batch_cost import load_batch_cost
    from env.engine import parse_arm
    from env.machine import machine_info
    from env.model import load_model
    from env.serve_sim import DEFAULT_ARMS, ServeSim, default_serve_trace
    from experiments.serve_fidelity import diagnose
    from experiments.serve_live import warm_up

    trace, cost, arms = default_serve_trace(), load_batch_cost(None), list(DEFAULT_ARMS)
    loaded = load_model(None, dtype=dtype)
    sim = ServeSim(1, trace=trace, arms=arms, cost=cost, loads=["2"])
    sim.reset()
    warm_up(loaded, sim, [parse_arm(a) for a in arms], sim.max_batch, cost)
    runs = []
    for _ in range(passes):
        live = diagnose(cost, arm, load, loaded, requests, trace=trace, arms=arms)["live"]
        runs.append({k: live[k] for k in ("forward_s", "step_s", "prefill_s", "wall_s", "steps", "tokens")})
    use = resource.getrusage(resource.RUSAGE_SELF)
    return {"allocator": machine_info()["allocator"], "passes": runs, "sys_s": use.ru_stime,
            "user_s": use.ru_utime, "max_rss_mib": use.ru_maxrss / 1024}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from env.cli import run_program
    from experiments.errors import USER_ERROR_TYPES

    return run_program(PROG, _main, argv, USER_ERROR_TYPES)


def _main(argv: list[str] | None) -> int:
    from env.cli import Parser, output_file, positive_int

    p = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=positive_int, default=2, help="processes per setting")
    p.add_argument(
        "--passes", type=positive_int, default=3, help="the stream served this many times per process"
    )
    p.add_argument("--load", default="16", help="a closed-loop concurrency (or ramp)")
    p.add_argument("--arm", default="none", help="the static arm served (of the bundled trace's menu)")
    p.add_argument("--requests", type=positive_int, default=16)
    p.add_argument("--dtype", default="bfloat16", help="the target's dtype (bfloat16 or float32)")
    p.add_argument("--json", default=None, help="write every process's measurement here")
    p.add_argument("--child", default=None, choices=MODES, help=argparse.SUPPRESS)  # one measuring process
    args = p.parse_args(argv)
    from env.engine import parse_arm
    from env.serve_sim import DEFAULT_ARMS, parse_load

    parse_load(args.load, 16)
    if args.arm not in DEFAULT_ARMS:
        raise UserError(f"--arm {args.arm!r} is not in the bundled trace's menu: {', '.join(DEFAULT_ARMS)}")
    parse_arm(args.arm)
    if args.dtype not in ("bfloat16", "float32"):
        raise UserError(f"--dtype {args.dtype!r}: valid values are bfloat16, float32")
    if args.child is not None:
        out = child(args.arm, args.load, args.passes, args.requests, args.dtype)
        print(json.dumps(out))
        return 0
    json_out = output_file(args.json, flag="--json")
    from tqdm import tqdm

    from env.machine import cpu_label

    results: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    order = [m for r in range(args.rounds) for m in (MODES if r % 2 == 0 else MODES[::-1])]
    for mode in tqdm(order, desc="allocator processes", unit="process"):
        cmd = [sys.executable, "-m", "experiments.bench_allocator", "--child", mode, "--passes", str(args.passes),
               "--load", args.load, "--arm", args.arm, "--requests", str(args.requests), "--dtype", args.dtype]  # fmt: skip
        env = {**os.environ, "DRAFTGYM_MALLOC": mode}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"a {mode} process failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        got = json.loads(done.stdout.strip().splitlines()[-1])
        if got["allocator"] != mode:  # glibc refused the setting, or this is not glibc
            raise UserError(f"the {mode} process ran with the allocator {got['allocator']!r}: not a glibc "
                            "system where mallopt takes the setting")  # fmt: skip
        results[mode].append(got)
        if json_out is not None:  # as measured: a kill keeps the processes done
            from env.files import atomic_write_text

            atomic_write_text(json_out, json.dumps({"cpu": cpu_label(), "load": args.load, "arm": args.arm,
                                                    "results": results}, indent=1) + "\n")  # fmt: skip
    print(f"{cpu_label()}; {args.dtype}; arm {args.arm} at load {args.load}, {args.requests} requests; medians over "
          f"{args.rounds} processes per setting")  # fmt: skip
    head = " ".join(f"{'pass ' + str(i + 1) + ' fwd s':>13}" for i in range(args.passes))
    print(f"{'allocator':>9} {head} {'sys s':>7} {'user s':>7} {'peak MiB':>9}")
    for mode in MODES:
        rs = results[mode]
        med = [statistics.median(r["passes"][i]["forward_s"] for r in rs) for i in range(args.passes)]
        cells = " ".join(f"{x:13.2f}" for x in med)
        print(f"{mode:>9} {cells} {statistics.median(r['sys_s'] for r in rs):7.1f} "
              f"{statistics.median(r['user_s'] for r in rs):7.1f} "
              f"{statistics.median(r['max_rss_mib'] for r in rs):9.0f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
