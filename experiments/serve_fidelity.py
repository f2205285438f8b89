"""Where replayed and live serving time part: ``python -m experiments.serve_fidelity``.

For each load, one held-out request stream of the bundled serving trace (the split ``draftgym serve-train``
makes: 4 prompts per category) is replayed under a batch cost model and served live on the batch engine with a
static arm, through the same policy path ``draftgym evaluate --serve`` takes. Printed per load: the replay's
modelled prefill seconds, steps and step seconds, and the live ``ServeLog``'s (prefill on admission, batch steps
including the observation and the policy, the rest of the serving loop), so a gap between replay and live shows
which part of the cost model misses it.

    draftgym calibrate --batch --dtype bf16 --out runs/batch_cost.json   # the target served live: bf16, dense
    python -m experiments.serve_fidelity --batch-cost runs/batch_cost.json --arm none --loads 1,4,16
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from experiments.errors import UserError


def diagnose(
    cost: Any, arm: str, load: str, loaded: Any, requests: int = 16, seed: int = 0
) -> dict[str, Any]:
    """One held-out stream at ``load`` under the static ``arm``: the replay's modelled parts and the live ones."""
    import torch

    from env.engine import parse_arm
    from env.serve_sim import DEFAULT_ARMS, ServeSim, default_serve_trace
    from env.serving import ServeLog
    from experiments.serve_policies import _Static, serve_stream
    from policies.split import trace_split

    trace = default_serve_trace()
    arms = list(DEFAULT_ARMS)
    k = arms.index(arm)
    test = list(trace_split(trace, 4, seed).test)
    sim = ServeSim(
        1, trace=trace, arms=arms, cost=cost, loads=[load], requests=requests, prompt_ids=test, seed=seed
    )
    sim.reset()
    prompts = sim.req_prompt[0, : int(sim.n_req[0])]
    replay = {"prefill_s": float(np.sum(cost.prefill_s(sim.prompt_len[prompts]))), "steps": 0, "step_s": 0.0}
    while not sim.done().all():
        _, o = sim.step(np.array([k]))
        replay["steps"] += 1
        replay["step_s"] += float(o["cost"][0])
    replay.update(wall_s=float(sim.clock[0]), tokens=int(sim.tokens_total[0]))
    # the same stream served live (the episode's request arrays stay as drawn)
    log = ServeLog()
    with torch.inference_mode():
        served, wall = serve_stream(loaded, sim, _Static(k, arm), [parse_arm(a) for a in arms], sim.max_batch,
                                    trace.max_new_tokens, cost, log=log)  # fmt: skip
    live = {"prefill_s": log.prefill_s, "steps": log.steps, "step_s": log.step_s, "wall_s": wall,
            "tokens": sum(len(s.token_ids) for s in served), "other_s": wall - log.prefill_s - log.step_s}  # fmt: skip
    return {"load": load, "arm": arm, "requests": len(prompts), "replay": replay, "live": live}


def check_live_cost(cost: Any, model_id: str, dtype: str, weights: str) -> None:
    """``UserError`` unless ``cost`` was measured for the target served live (``model_id``, ``dtype``, ``weights``):
    under a simulated (roofline) model, or one calibrated for another model, dtype or weight format, the replay
    prices other forwards than the live ones, and the gap printed would measure that, not what the cost model misses."""
    make = f"make one with: draftgym calibrate --batch --dtype bf16 --weights {weights} --out FILE"
    if cost.simulated:
        raise UserError(f"--batch-cost {cost.label} prices another machine than the live side, which serves "
                        f"{model_id} ({dtype}/{weights}) here: {make}")  # fmt: skip
    built = (cost.model_id, cost.dtype, cost.weights)
    if built != (model_id, dtype, weights):
        raise UserError(f"--batch-cost was calibrated for {built[0]} ({built[1]}/{built[2]}), the live side serves "
                        f"{model_id} ({dtype}/{weights}): {make}")  # fmt: skip


PROG = "python -m experiments.serve_fidelity"


def main(argv: list[str] | None = None) -> int:
    from env.cli import run_program
    from experiments.errors import USER_ERROR_TYPES

    return run_program(PROG, _main, argv, USER_ERROR_TYPES)


def _main(argv: list[str] | None) -> int:
    from env.cli import Parser, output_file, positive_int

    p = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-cost", default=None, help="batch cost model JSON (default: the shipped one)")
    p.add_argument(
        "--arm", default="none", help="the static arm served (one of the serving env's default menu)"
    )
    p.add_argument("--loads", default="1,4,16", help="comma list of closed-loop concurrencies (or ramp)")
    p.add_argument("--requests", type=positive_int, default=16)
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    from env.batch_cost import default_batch_cost_path, load_batch_cost
    from env.serve_sim import DEFAULT_ARMS, parse_load

    if args.arm not in DEFAULT_ARMS:
        raise UserError(f"unknown arm {args.arm!r}; valid: {', '.join(DEFAULT_ARMS)}")
    loads = [x.strip() for x in args.loads.split(",") if x.strip()]
    if not loads:
        raise UserError("--loads names no load")
    for x in loads:
        parse_load(x, 16)
    cost = load_batch_cost(args.batch_cost)
    from env.model import DEFAULT_MODEL, load_model

    check_live_cost(cost, DEFAULT_MODEL, "bfloat16", "dense")  # the target loaded below
    json_out = output_file(args.json, flag="--json", inputs=(args.batch_cost or default_batch_cost_path(),))
    loaded = load_model(None, dtype="bfloat16", weights="dense")
    rows = []
    print(f"replay / live seconds, arm {args.arm}; cost model: {cost.label}")
    print(f"{'load':>5} {'prefill':>15} {'steps':>11} {'step s':>15} {'total':>15} {'live other':>10}")
    for load in loads:
        r = diagnose(cost, args.arm, load, loaded, args.requests)
        rows.append(r)
        a, b = r["replay"], r["live"]
        print(f"{load:>5} {a['prefill_s']:6.2f} / {b['prefill_s']:6.2f} {a['steps']:>5}/{b['steps']:<5} "
              f"{a['step_s']:6.2f} / {b['step_s']:6.2f} {a['wall_s']:6.2f} / {b['wall_s']:6.2f} {b['other_s']:10.2f}",
              flush=True)  # fmt: skip
        if json_out is not None:  # as measured: a kill keeps the loads done
            from env.files import atomic_write_text

            atomic_write_text(json_out, json.dumps({"rows": rows, "cost": cost.label}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
