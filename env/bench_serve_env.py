"""Speed of the vectorized serving replay: ``python -m env.bench_serve_env`` steps ``SpecServeVectorEnv`` (numpy,
same-step autoreset, random batch actions) for each ``--envs`` count and prints request-steps per second (the
rows stepped, summed over servers) and env steps per second, median of ``--reps`` timed runs. ``--loads``: the
loads drawn per episode (default: all of ``env.serve_env.DEFAULT_LOADS``; a server at concurrency 1 steps one row).

    python -m env.bench_serve_env --envs 64,256,1024 --steps 200
"""

from __future__ import annotations

import json
import statistics
import time

import numpy as np


def bench(num_envs: int, steps: int, reps: int, cost: str | None, action: str, loads: list[str] | None = None
          ) -> dict[str, float]:  # fmt: skip
    from env.serve_env import DEFAULT_LOADS, SpecServeVectorEnv

    venv = SpecServeVectorEnv(num_envs, cost=cost, action=action, autoreset_mode="same_step", seed=0,
                              loads=loads or list(DEFAULT_LOADS))  # fmt: skip
    venv.reset(seed=0)
    rng = np.random.default_rng(0)
    acts = rng.integers(0, len(venv.arms), size=(steps, *venv.action_space.shape))
    rates, step_rates = [], []
    for _ in range(reps + 1):
        rows = 0
        t0 = time.perf_counter()
        for a in acts:
            _, _, _, _, info = venv.step(a)
            rows += int(info["rows"].sum())
        dt = time.perf_counter() - t0
        rates.append(rows / dt)
        step_rates.append(steps / dt)
    return {"envs": num_envs, "loads": ",".join(loads or []) or "default", "request_steps_s": statistics.median(rates[1:]),
            "env_steps_s": statistics.median(step_rates[1:]) * num_envs}  # fmt: skip


PROG = "python -m env.bench_serve_env"
MAX_STEPS = 1 << 20  # --steps: every step's actions are drawn up front, envs x batch each
MAX_REPS = 1000


def main(argv: list[str] | None = None) -> int:
    from env.cli import run_program

    return run_program(PROG, _main, argv)


def _main(argv: list[str] | None) -> int:
    from env.batch_cost import load_batch_cost
    from env.cli import Parser, int_at_least, int_list, output_file

    ap = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--envs", default="64,256,1024")
    ap.add_argument(
        "--steps",
        type=int_at_least(1, MAX_STEPS),
        default=200,
        help="steps timed (the actions drawn up front)",
    )
    ap.add_argument("--reps", type=int_at_least(1, MAX_REPS), default=3)
    ap.add_argument("--cost", default=None, help="batch cost model (default: the shipped one)")
    ap.add_argument("--action", default="batch", choices=["batch", "row"])
    ap.add_argument(
        "--loads", default=None, help="comma list of loads (default: env.serve_env.DEFAULT_LOADS)"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from env.machine import cpu_label, machine_info
    from env.serve_sim import MAX_SERVERS, parse_load

    envs = int_list(args.envs, "--envs")
    if max(envs) > MAX_SERVERS:
        ap.error(f"argument --envs: at most {MAX_SERVERS} servers, got {max(envs)}")
    loads = [x.strip() for x in args.loads.split(",") if x.strip()] if args.loads is not None else None
    if loads == []:
        ap.error(f"argument --loads: names no load, got {args.loads!r}")
    for x in loads or ():
        parse_load(x, 16)
    load_batch_cost(args.cost)  # a missing or bad file: one line before anything runs
    from env.batch_cost import default_batch_cost_path

    json_out = output_file(
        args.json, inputs=(args.cost or default_batch_cost_path(),)
    )  # (the cost model it reads)

    out = []
    print(f"machine: CPU {cpu_label()}")
    print(f"{'envs':>6}{'request-steps/s':>18}{'env steps/s':>14}")
    for e in envs:
        r = bench(e, args.steps, args.reps, args.cost, args.action, loads)
        out.append(r)
        print(f"{e:>6}{r['request_steps_s']:>18,.0f}{r['env_steps_s']:>14,.0f}", flush=True)
        if json_out is not None:  # as measured
            from env.files import atomic_write_text

            atomic_write_text(json_out, json.dumps({"rows": out, "machine": machine_info()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
