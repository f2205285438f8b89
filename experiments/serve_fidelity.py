"""Where replayed and live serving time part: ``python -m experiments.serve_fidelity``.

For each load and each static arm, one held-out request stream of a serving trace (the split ``draftgym
serve-train`` makes: 4 prompts per category) is replayed under a batch cost model and served live on the batch
engine, through the same path ``draftgym evaluate --serve`` takes. Printed per (load, arm), replay / live:
prefill seconds, batch steps, the steps' forward seconds (forward, verification, commit) and drafting seconds,
the total (first arrival to last finish, as ``evaluate --serve``'s goodput counts it), and what the live loop spent
besides: within the steps, neither forward nor drafting ("live book": the step's bookkeeping — a static arm is
served as an engine configured with it, with no serving policy, so no observation or act), and outside them the
rest of the serving loop (retiring, packing: "live other"); every arm has served a few tokens untimed first. Steps that differ
mean the trace's acceptance is not what the live drafter reaches (a model head's replay is approximate); forward or drafting
seconds that differ mean the cost model prices that part off. The target is served in the dtype and weight format
the cost model was measured for.

    draftgym calibrate --batch --dtype bf16 --out runs/batch_cost.json
    python -m experiments.serve_fidelity --batch-cost runs/batch_cost.json --arms none,ngram-d3 --loads 1,4,16
    # a menu with a model head: a trace that recorded it, a cost model that prices it
    python -m experiments.serve_fidelity --trace serve_trace_e3.npz --batch-cost bc_e3.json \
        --arms ngram-d3,eagle3-d1 --loads 1,4,16
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from experiments.errors import UserError


def diagnose(
    cost: Any,
    arm: str,
    load: str,
    loaded: Any,
    requests: int = 16,
    seed: int = 0,
    trace: Any = None,
    arms: list[str] | None = None,
    drafter_options: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One held-out stream at ``load`` under the static ``arm`` (of the menu ``arms``; default: the serving env's
    default menu) from ``trace`` (default: the bundled serving trace): the replay's modelled parts and the live ones,
    served with ``drafter_options`` (the trace's: ``env.trace_record.recorded_drafter_options``)."""
    import torch

    from env.engine import parse_arm
    from env.serve_sim import DEFAULT_ARMS, ServeSim, default_serve_trace
    from env.serving import ServeLog
    from experiments.serve_live import repeated_prompts, serve_stream
    from experiments.serve_policies import _Static
    from policies.split import trace_split

    trace = default_serve_trace() if trace is None else trace
    arms = list(DEFAULT_ARMS) if arms is None else list(arms)
    k = arms.index(arm)
    test = list(trace_split(trace, 4, seed).test)
    sim = ServeSim(
        1, trace=trace, arms=arms, cost=cost, loads=[load], requests=requests, prompt_ids=test, seed=seed
    )
    sim.reset()
    prompts = sim.req_prompt[0, : int(sim.n_req[0])]
    replay = {"prefill_s": float(np.sum(cost.prefill_s(sim.prompt_len[prompts]))), "steps": 0, "step_s": 0.0,
              "forward_s": 0.0, "draft_s": 0.0}  # fmt: skip
    while not sim.done().all():
        _, o = sim.step(np.array([k]))
        replay["steps"] += 1
        replay["step_s"] += float(o["cost"][0])
        replay["forward_s"] += float(o["forward"][0])
    replay["draft_s"] = replay["step_s"] - replay["forward_s"]
    replay.update(wall_s=float(sim.clock[0]), tokens=int(sim.tokens_total[0]))
    # the same stream served live (the episode's request arrays stay as drawn)
    repeated_prompts(
        sim, [parse_arm(arm)], drafter_options
    )  # a note where a repeat may meet a cross-request cache
    log = ServeLog()
    with torch.inference_mode():
        served, wall = serve_stream(loaded, sim, _Static(k, arm), [parse_arm(a) for a in arms], sim.max_batch,
                                    trace.max_new_tokens, cost, log=log, drafter_options=drafter_options)  # fmt: skip
    # the span evaluate --serve's goodput divides by: first arrival to last finish (the server's setup before its
    # clock starts, growing the KV cache to the largest reservation, is not a request's time; reported apart)
    span = max(s.finish_s for s in served) - min(s.arrival_s for s in served)
    live = {"prefill_s": log.prefill_s, "steps": log.steps, "step_s": log.step_s, "forward_s": log.forward_s,
            "draft_s": log.draft_s, "wall_s": span, "tokens": sum(len(s.token_ids) for s in served),
            "other_s": span - log.prefill_s - log.step_s, "setup_s": wall - span,
            # of the steps, neither forward nor drafting: the step's own bookkeeping (a static arm is served
            # with no serving policy, so no observation or act: ``serve_stream``), which replay does not price
            "bookkeeping_s": log.step_s - log.forward_s - log.draft_s}  # fmt: skip
    return {"load": load, "arm": arm, "requests": len(prompts), "replay": replay, "live": live}


def check_live_cost(cost: Any, model_id: str, dtype: str, weights: str) -> None:
    """``UserError`` unless ``cost`` was measured for the target served live (``model_id``, ``dtype``, ``weights``):
    under a simulated (roofline) model, or one calibrated for another model, dtype or weight format, the replay
    prices other forwards than the live ones, and the gap printed would measure that, not what the cost model misses."""
    short = {"bfloat16": "bf16", "float32": "fp32"}.get(dtype, dtype)
    make = f"make one with: draftgym calibrate --batch --dtype {short} --weights {weights} --out FILE"
    if cost.simulated:
        raise UserError(f"--batch-cost {cost.label} prices another machine than the live side, which serves "
                        f"{model_id} ({dtype}/{weights}) here: {make}")  # fmt: skip
    built = (cost.model_id, cost.dtype, cost.weights)
    if built != (model_id, dtype, weights):
        raise UserError(f"--batch-cost was calibrated for {built[0]} ({built[1]}/{built[2]}), the live side serves "
                        f"{model_id} ({dtype}/{weights}): {make}")  # fmt: skip


def live_inputs(trace_path: str | None, cost_path: str | None, arms_text: str, flag: str = "--arms",
                loads: list[str] | None = None) -> tuple[Any, dict[str, dict[str, Any]], Any, list[str], str]:  # fmt: skip
    """What a live comparison with replay serves, each part checked before the model loads: the trace (default: the
    bundled one) and the drafter options it recorded (live serves them), the cost model (default: the shipped one),
    the arms of ``arms_text`` (a comma list; ``flag`` names it in errors; each one the trace recorded and the cost
    model prices, at ``loads``) and the dtype the target is served in (the cost model's: one measured for another
    target, dtype or weight format, or simulated, is refused). Also refused: a trace with no held-out prompt."""
    from env.batch_cost import load_batch_cost
    from env.model import DEFAULT_MODEL
    from env.serve_sim import ServeSim, default_serve_trace
    from env.trace import load_trace
    from env.trace_record import recorded_drafter_options
    from policies.split import trace_split

    arms = list(dict.fromkeys(a.strip() for a in arms_text.split(",") if a.strip()))
    if not arms:
        raise UserError(f"{flag} names no arm (got {arms_text!r}); e.g. {flag} none,ngram-d3")
    trace = default_serve_trace() if trace_path is None else load_trace(trace_path)
    options = recorded_drafter_options(trace, trace_path or "the bundled trace")
    cost = load_batch_cost(cost_path)
    ServeSim(
        1, trace=trace, arms=arms, cost=cost, loads=loads or ["1"]
    )  # an arm the trace or the cost model lacks
    if not trace_split(trace, 4, 0).test:
        raise UserError(f"the trace holds no held-out prompt to serve ({trace.num_prompts} prompts; the split keeps "
                        "up to 4 per category out of training and needs 2 or more in a category)")  # fmt: skip
    dtype = getattr(cost, "dtype", "bfloat16")  # a roofline model has none (and is refused)
    check_live_cost(cost, DEFAULT_MODEL, dtype, "dense")
    return trace, options, cost, arms, dtype


def load_and_warm(
    trace: Any, cost: Any, arms: list[str], options: dict[str, dict[str, Any]], dtype: str
) -> Any:
    """The target, loaded in ``dtype`` (a trace of another model refused), after the live warm-up over ``arms``
    (``experiments.serve_live.warm_up``: untimed, so that no measurement pays first calls)."""
    from env.engine import parse_arm
    from env.model import load_model
    from env.serve_sim import ServeSim
    from env.trace import model_fingerprint
    from experiments.serve_live import warm_up

    loaded = load_model(None, dtype=dtype, weights="dense")
    trace.check_model(model_fingerprint(loaded))  # a trace of another model: refused, not compared
    sim = ServeSim(1, trace=trace, arms=arms, cost=cost, loads=["2"])
    sim.reset()
    warm_up(loaded, sim, [parse_arm(a) for a in arms], sim.max_batch, cost, drafter_options=options)
    return loaded


PROG = "python -m experiments.serve_fidelity"


def main(argv: list[str] | None = None) -> int:
    from env.cli import run_program
    from experiments.errors import USER_ERROR_TYPES

    return run_program(PROG, _main, argv, USER_ERROR_TYPES)


def _main(argv: list[str] | None) -> int:
    from env.cli import Parser, int_at_least, output_file
    from experiments.serve_policies import MAX_REQUESTS

    p = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-cost", default=None, help="batch cost model JSON (default: the shipped one)")
    p.add_argument("--trace", default=None, help="serving trace (.npz; default: the bundled one)")
    p.add_argument("--arms", "--arm", dest="arms", default="none",
                   help="comma list of static arms served, each in turn (drafters the trace recorded)")  # fmt: skip
    p.add_argument("--loads", default="1,4,16", help="comma list of closed-loop concurrencies (or ramp)")
    # (at most what a serving episode takes: the simulator refuses more, which was found after the model's warm-up)
    p.add_argument("--requests", type=int_at_least(1, MAX_REQUESTS), default=16)
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    from env.batch_cost import default_batch_cost_path
    from env.model import model_folder
    from env.serve_sim import parse_load

    loads = [x.strip() for x in args.loads.split(",") if x.strip()]
    if not loads:
        raise UserError("--loads names no load")
    for x in loads:
        parse_load(x, 16)
    trace, options, cost, arms, dtype = live_inputs(args.trace, args.batch_cost, args.arms, "--arms", loads)
    recorded = sorted(trace.drafters)
    json_out = output_file(args.json, flag="--json", inputs=(args.batch_cost or default_batch_cost_path(), args.trace),
                           folders=(model_folder(None),))  # fmt: skip
    loaded = load_and_warm(trace, cost, arms, options, dtype)  # untimed: no cell pays first calls
    recorded_in = trace.header["model"].get("dtype")
    # greedy tokens may part between dtypes: steps may then differ for that alone
    if recorded_in not in (None, dtype):
        print(f"note: the trace was recorded in {recorded_in}, the target is served in {dtype}", flush=True)
    rows = []
    print(f"replay / live seconds; cost model: {cost.label}; drafters recorded: {', '.join(recorded)}")
    print(f"{'load':>5} {'arm':>10} {'prefill':>15} {'steps':>11} {'forward s':>15} {'draft s':>15} "
          f"{'total':>15} {'live book':>9} {'live other':>10}")  # fmt: skip
    for load in loads:
        for arm in arms:
            r = diagnose(
                cost, arm, load, loaded, args.requests, trace=trace, arms=arms, drafter_options=options
            )
            rows.append(r)
            a, b = r["replay"], r["live"]
            print(f"{load:>5} {arm:>10} {a['prefill_s']:6.2f} / {b['prefill_s']:6.2f} {a['steps']:>5}/{b['steps']:<5} "
                  f"{a['forward_s']:6.2f} / {b['forward_s']:6.2f} {a['draft_s']:6.2f} / {b['draft_s']:6.2f} "
                  f"{a['wall_s']:6.2f} / {b['wall_s']:6.2f} {b['bookkeeping_s']:9.2f} {b['other_s']:10.2f}",
                  flush=True)  # fmt: skip
            if json_out is not None:  # as measured: a kill keeps the cells done
                from env.files import atomic_write_text

                atomic_write_text(json_out, json.dumps({"rows": rows, "cost": cost.label}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
