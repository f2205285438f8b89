"""Replay fidelity and cost-model accuracy against the live env: ``python -m env.fidelity [--prompts 10]``.

For each of the first N prompts of a trace (default: the shipped one), one fixed random arm sequence (seeded) is
played in the live env (greedy, fp32, the trace's model) and in replay. Reports, per step:

- whether replay's accepted length (and committed tokens) equal the live env's, overall and per arm;
- the cost model's predicted step seconds against the live step's measured wall time: median (and p90) absolute
  relative error, overall and per arm.

``--calibrate`` first re-calibrates the cost model in the same process, so both see the same machine load.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from env.trace import Trace


def run(
    prompts: int = 10,
    trace_path: str | Trace | None = None,
    cost_model: Any = None,
    seed: int = 0,
    max_new_tokens: int | None = None,
    progress: bool = True,
    on_prompt: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """``on_prompt(summary)``: called after each prompt with the summary of the prompts done so far (``complete``:
    whether all are), so that a caller can keep it on disk as it grows."""
    from env.cli import progress_bar
    from env.model import load_model, model_spec
    from env.spec_env import SpecDecodeEnv
    from env.trace import Trace, load_trace
    from env.trace_record import recorded_drafter_options

    trace = trace_path if isinstance(trace_path, Trace) else load_trace(trace_path)
    # live decodes with the drafters as the trace recorded them
    options = recorded_drafter_options(
        trace, str(trace_path) if trace_path is not None else "the bundled trace"
    )
    loaded = load_model(model_spec(trace.header["model"]["model_id"]), dtype="fp32", device="cpu")
    ids = trace.prompt_ids[:prompts]
    new = max_new_tokens or trace.max_new_tokens
    replay = SpecDecodeEnv(trace=trace, model=loaded, cost_model=cost_model, max_new_tokens=new)
    live = SpecDecodeEnv("live", model=loaded, workload=trace, cost_model=cost_model, max_new_tokens=new,
                         drafter_options=options)  # fmt: skip
    rng = np.random.default_rng(seed)
    rows: list[dict[str, Any]] = []
    same_text = 0
    bar = progress_bar(len(ids), "fidelity", enabled=progress)
    for n, pid in enumerate(ids):
        actions = rng.integers(len(live.arms), size=new)
        live.reset(seed=seed, options={"prompt_id": pid})
        replay.reset(seed=seed, options={"prompt_id": pid})
        for a in actions:
            _, _, lt, ltr, li = live.step(int(a))
            _, _, rt, rtr, ri = replay.step(int(a))
            rows.append(
                {
                    "prompt": pid,
                    "arm": li["arm"],
                    "live": [li["accepted"], li["tokens"]],
                    "replay": [ri["accepted"], ri["tokens"]],
                    "predicted_s": li["cost_s"],
                    "wall_s": live.last_wall_s,
                }
            )
            if lt or ltr or rt or rtr:
                break
        traj = trace.trajectory(trace.prompt_ids.index(pid))[:new]
        same_text += list(live._seq.tokens[: len(traj)]) == list(traj)  # the generated ids, as counted
        bar.update(1)
        if on_prompt is not None:
            on_prompt({**summarize(rows, same_text, n + 1, trace), "complete": n + 1 == len(ids)})
    bar.close()
    return summarize(rows, same_text, len(ids), trace)


def summarize(rows: list[dict[str, Any]], same_text: int, prompts: int, trace: Any) -> dict[str, Any]:
    def err(rs, scale=1.0):
        e = np.array([abs(scale * r["predicted_s"] - r["wall_s"]) / r["wall_s"] for r in rs])
        return {"median": float(np.median(e)), "p90": float(np.quantile(e, 0.9)), "steps": len(rs)}

    # machine load scales every step's time alike; the reward (a ratio of costs) does not see that scale
    scale = float(np.median([r["wall_s"] / r["predicted_s"] for r in rows])) if rows else 1.0

    by_arm: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_arm[r["arm"]].append(r)
    return {
        "prompts": prompts,
        "steps": len(rows),
        "greedy_text_equal": same_text,
        "accepted_exact": sum(r["live"][0] == r["replay"][0] for r in rows) / max(1, len(rows)),
        "tokens_exact": sum(r["live"] == r["replay"] for r in rows) / max(1, len(rows)),
        "per_arm_exact": {a: sum(r["live"] == r["replay"] for r in rs) / len(rs) for a, rs in by_arm.items()},
        "drafters": {n: ("exact" if d["exact"] else "approximate") for n, d in trace.drafters.items()},
        "cost_abs_rel_error": err(rows),
        "load_scale": scale,
        "cost_abs_rel_error_rescaled": err(rows, scale),
        "per_arm_cost_error": {a: err(rs) for a, rs in by_arm.items()},
        "mean_wall_s": float(np.mean([r["wall_s"] for r in rows])) if rows else None,
        "rows": rows,
    }


PROG = "python -m env.fidelity"


def main(argv: list[str] | None = None) -> int:
    from env.cli import run_program

    return run_program(PROG, _main, argv)


def _main(argv: list[str] | None) -> int:
    from env.cli import Parser, ProgramError, output_file, positive_int, seed_int, write_json

    p = Parser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=positive_int, default=10)
    p.add_argument("--trace", default=None, help="trace file (default: the shipped one)")
    p.add_argument("--cost-model", default=None, help="cost-model JSON (default: the shipped one)")
    p.add_argument("--calibrate", action="store_true", help="calibrate first, in this process, and use that")
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument(
        "--json", default=None, help="write the full result (rows included) here, after each prompt"
    )
    p.add_argument("--save-cost-model", default=None, help="with --calibrate: save that cost model here")
    args = p.parse_args(argv)
    if args.save_cost_model and not args.calibrate:
        p.error("argument --save-cost-model: only with --calibrate (it saves the cost model calibrated here)")
    if args.calibrate and args.cost_model:
        p.error("argument --cost-model: not with --calibrate (that calibrates the cost model used)")
    from env.cost import FORMAT as COST_FORMAT
    from env.cost import default_cost_model_path, load_cost_model
    from env.trace import default_trace_path, load_trace

    trace_file = args.trace or default_trace_path()
    from env.model import model_folder

    read = (model_folder(None),)  # the embedded model's folder (no output goes in it)
    out = output_file(
        args.json, inputs=(trace_file, args.cost_model or default_cost_model_path()), folders=read
    )
    save_to = output_file(args.save_cost_model, "--save-cost-model", inputs=(trace_file,), folders=read,
                          formats=(COST_FORMAT,))  # fmt: skip
    if out is not None and save_to is not None and out.resolve() == save_to.resolve():
        raise ProgramError(
            f"--json and --save-cost-model both name {out}; the rows would overwrite the cost model"
        )
    trace = load_trace(args.trace)  # a bad file fails here, in one line, before the model loads
    cost_model: Any = None if args.calibrate else load_cost_model(args.cost_model)
    if args.calibrate:
        from env.calibrate import calibrate
        from env.model import load_model

        t0 = time.perf_counter()
        cost_model = calibrate(load_model(dtype="fp32", device="cpu"), ["ngram"], progress=True)
        print(f"calibrated in {time.perf_counter() - t0:.0f} s")
        if save_to is not None:
            cost_model.save(save_to)
    res = run(args.prompts, trace, cost_model, args.seed, on_prompt=lambda doc: write_json(out, doc))
    e = res["cost_abs_rel_error"]
    print(
        f"prompts {res['prompts']}, steps {res['steps']}, greedy text equal to the trace: {res['greedy_text_equal']}"
    )
    print(
        f"accepted length exact: {res['accepted_exact']:.4f}; (accepted, tokens) exact: {res['tokens_exact']:.4f}"
    )
    print(f"replay per drafter: {res['drafters']}")
    print(f"cost model |predicted - wall| / wall: median {e['median']:.3f}, p90 {e['p90']:.3f}")
    r = res["cost_abs_rel_error_rescaled"]
    print(f"  after one global rescale (x{res['load_scale']:.3f}, machine load): median {r['median']:.3f}")
    print(f"{'arm':18} {'steps':>6} {'exact':>7} {'cost err med':>13}")
    for arm, ex in res["per_arm_exact"].items():
        ce = res["per_arm_cost_error"][arm]
        print(f"{arm:18} {ce['steps']:>6} {ex:>7.3f} {ce['median']:>13.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
