"""Throughput of replay: ``python -m env.bench_env [--batch 4096 16384] [--seconds 3] [--json FILE]``.

Steps random arms through the single replay env (unwrapped, and through ``gymnasium.make``'s wrappers) and the
vectorized replay env (numpy; torch on CPU; torch on CUDA when there is a GPU), on the shipped trace, and prints a
table of env-steps per second. A benchmark, not a test: numbers depend on the machine and its load (printed).
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np


def _rate(step, reset, seconds: float, per_call: int) -> float:
    reset()
    for _ in range(50):  # warm-up
        step()
    n, t0 = 0, time.perf_counter()
    while True:
        for _ in range(20):
            step()
        n += 20
        dt = time.perf_counter() - t0
        if dt >= seconds:
            return n * per_call / dt


def bench_single(seconds: float, wrapped: bool) -> float:
    import gymnasium as gym

    import env as env_pkg

    e = gym.make(env_pkg.ENV_ID)
    target = e if wrapped else e.unwrapped
    k = e.action_space.n
    actions = np.random.default_rng(0).integers(k, size=4096).tolist()
    state = {"i": 0}

    def step():
        i = state["i"] = (state["i"] + 1) % 4096
        _, _, term, trunc, _ = target.step(actions[i])
        if term or trunc:
            target.reset()

    return _rate(step, lambda: target.reset(seed=0), seconds, 1)


def bench_vector(seconds: float, batch: int, device: str | None) -> float:
    import torch

    from env.vector_env import SpecDecodeVectorEnv

    v = SpecDecodeVectorEnv(batch, device=device)
    k = len(v.arms)
    rng = np.random.default_rng(0)
    acts = [rng.integers(k, size=batch) for _ in range(16)]
    if device is not None:
        acts = [torch.as_tensor(a, device=device) for a in acts]
    state = {"i": 0}

    def step():
        state["i"] = (state["i"] + 1) % 16
        v.step(acts[state["i"]])

    def sync_step():
        step()
        if device is not None and torch.device(device).type == "cuda":
            torch.cuda.synchronize()

    return _rate(sync_step, lambda: v.reset(seed=0), seconds, batch)


def cpu_reference() -> float:
    """Seconds for 5M Python integer additions: how much of a core this process gets (about 0.3 s unloaded)."""
    t0 = time.perf_counter()
    total = 0
    for i in range(5_000_000):
        total += i
    return time.perf_counter() - t0


PROG = "python -m env.bench_env"


def main(argv: list[str] | None = None) -> int:
    from env.cli import run_program

    return run_program(PROG, _main, argv)


def _seconds(text: str) -> float:
    from env.cli import ProgramError

    try:
        value = float(text)
    except ValueError:
        raise ProgramError(f"--seconds {text!r} is not a number") from None
    if not 0 < value <= 3600:
        raise ProgramError(f"--seconds must be in (0, 3600], got {text}")
    return value


def _main(argv: list[str] | None) -> int:
    import torch

    from env.cli import Parser, output_file, positive_int, write_json

    p = Parser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=positive_int, nargs="+", default=[4096, 16384])
    p.add_argument("--seconds", type=_seconds, default=3.0, help="measuring time per row")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    json_out = output_file(args.json)
    from env.machine import cpu_label, machine_info

    doc: dict[str, Any] = {"rows": [], "machine": machine_info(), "complete": False}
    gpu = f", GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    print(f"machine: CPU {cpu_label()}{gpu}")
    rows: list[dict[str, Any]] = doc["rows"]

    def add(env: str, batch: int, steps_per_s: float) -> None:  # printed and written as measured
        rows.append({"env": env, "batch": batch, "steps_per_s": steps_per_s})
        print(f"{env:34} {batch:>7} {steps_per_s:>14,.0f}", flush=True)
        write_json(json_out, doc)

    print(f"{'env':34} {'batch':>7} {'env-steps/s':>14}")
    add("single replay (unwrapped)", 1, bench_single(args.seconds, False))
    add("single replay (gymnasium.make)", 1, bench_single(args.seconds, True))
    devices: list[str | None] = [None, "cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for dev in devices:
        for b in args.batch:
            add("vector replay, numpy" if dev is None else f"vector replay, torch {dev}", b,
                bench_vector(args.seconds, b, dev))  # fmt: skip
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    ref = cpu_reference()
    threads = torch.get_num_threads()
    print(f"load: {os.cpu_count()} CPUs, torch threads {threads}, load average {load[0]:.1f}")
    print(f"cpu reference: 5M Python additions in {ref:.2f} s (about 0.3 s on an unloaded core)")
    doc.update(load_average=list(load), cpu_reference_s=ref, complete=True)
    write_json(json_out, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
