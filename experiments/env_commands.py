"""``draftgym calibrate`` (measure this machine's step costs into a cost-model JSON) and ``draftgym record``
(record a replay trace of a workload; resumable)."""

from __future__ import annotations

import argparse
import json
import sys
import time
import zipfile
from typing import Any

from experiments.args import drafter_options, output_file


def _drafter_list(text: str) -> list[str]:
    from drafters import DRAFTERS, DrafterError

    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:  # (", ," ran as none)
        raise DrafterError(f"--drafters names no drafter, got {text!r:.40}; give a comma list, or none")
    for n in names:
        if n != "none" and n not in DRAFTERS:
            raise DrafterError(
                f"unknown drafter {n!r}; known drafters: {', '.join(sorted([*DRAFTERS, 'none']))}"
            )
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:  # timed or recorded twice over, to the same entry
        raise DrafterError(f"--drafters lists {', '.join(twice)} more than once")
    return [n for n in names if n != "none"]


def _options_of(names: list[str], items: list[str] | None, verb: str) -> dict[str, dict[str, Any]]:
    """``--drafter-option`` items, checked before the model loads, for the drafters ``names`` only: an option for
    another is a one-line ``UserError`` (the command would not ``verb`` that drafter)."""
    from experiments.errors import UserError

    options = drafter_options(items)
    unused = sorted(set(options) - set(names))
    if unused:
        raise UserError(f"--drafter-option names {', '.join(unused)}, which --drafters does not {verb}")
    return options


def cmd_calibrate(args: argparse.Namespace) -> int:
    from env.calibrate import calibrate
    from env.model import load_model

    names = _drafter_list(args.drafters)
    options = _options_of(names, args.drafter_option, "time")
    # an existing file there must be an earlier cost model of the kind written, not a policy, a trace or another
    # command's results named by a misplaced flag
    from env.batch_cost import FORMAT as BATCH_FORMAT
    from env.cost import FORMAT as COST_FORMAT
    from env.model import model_folder

    out = args.out or ("runs/batch_cost.json" if args.batch else "runs/cost_model.json")
    kind = BATCH_FORMAT if args.batch else COST_FORMAT
    # (in no model folder: a model's config.json is JSON too)
    out = output_file(out, flag="--out", folders=(model_folder(args.model),), formats=(kind,))
    if args.batch:  # one calibration at a time writes OUT.partial (released as the command returns)
        from env.batch_calibrate_state import CalibrationState
        from env.folder_lock import claim_file

        claim_file(out.with_name(out.name + ".partial"), f"--out {out}")
        CalibrationState.check_file(
            out.with_name(out.name + ".partial")
        )  # a damaged one: before the model loads
    loaded = load_model(
        args.model, dtype=args.dtype, device=args.device, weights=args.weights, forward=args.forward
    )
    if args.batch:
        return _calibrate_batch(args, loaded, names, out, options)
    t0 = time.perf_counter()
    cm = calibrate(loaded, names, reps=args.reps, progress=not args.json, drafter_options=options)
    cm.meta["command"] = " ".join(["draftgym", *sys.argv[1:]])
    cm.meta["drafter_options"] = options  # what the drafters were timed with ({}: their defaults)
    cm.save(out)
    summary = {
        "out": str(out),
        "seconds": round(time.perf_counter() - t0, 1),
        "model": cm.model_id,
        "dtype": cm.dtype,
        "weights": cm.meta.get("weights", "dense"),
        "ar_ms": round(1e3 * float(cm.ar_cost(cm.context_ref)), 2),
        "chain_ms": {n: round(1e3 * s, 2) for n, s in zip(cm.chain.nodes, cm.chain.seconds)},
        "tree_ms": {n: round(1e3 * s, 2) for n, s in zip(cm.tree.nodes, cm.tree.seconds)},
        "per_context_us": round(1e6 * cm.per_context, 3),
        "per_node_context_us": round(1e6 * cm.per_node_context, 4),
        "draft_ms": {
            n: {a: round(1e3 * s, 3) for a, s in d["shapes"].items()} for n, d in cm.drafters.items()
        },
    }
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"cost model for {cm.model_id} ({cm.dtype}, {cm.device}) -> {out}  [{summary['seconds']} s]")
    print(f"one autoregressive token at context {cm.context_ref}: {summary['ar_ms']} ms")
    print(f"{'nodes':>6} {'chain ms':>9} {'tree ms':>9}")
    for n in sorted(set(cm.chain.nodes) | set(cm.tree.nodes)):
        c = f"{1e3 * float(cm.chain(n)):9.2f}" if n in cm.chain.nodes else f"{'':9}"
        t = f"{1e3 * float(cm.tree(n)):9.2f}" if n in cm.tree.nodes else f"{'':9}"
        print(f"{n:>6} {c} {t}")
    print(
        f"context: +{summary['per_context_us']} us/token, +{summary['per_node_context_us']} us/(node*token)"
    )
    for n, d in cm.drafters.items():
        print(f"drafter {n}: {1e3 * d['base_s']:.3f} ms + {1e6 * d['per_node_s']:.2f} us/node")
    return 0


def cmd_record(args: argparse.Namespace) -> int:
    from env.model import load_model
    from env.trace_record import check_parts_folders, record
    from env.workloads import load_workload
    from experiments.errors import UserError

    out = output_file(args.out, flag="--out")
    check_parts_folders(out)  # (what they hold is checked once record() holds them)
    # a finished trace is fine: record() returns it when its settings are these (a rerun), else refuses it
    if out.exists() and not args.overwrite and not zipfile.is_zipfile(out):
        raise UserError(f"{out} already exists; delete it or pass --overwrite")
    if args.max_new_tokens < 2:
        raise UserError(f"--max-new-tokens must be >= 2, got {args.max_new_tokens}")
    names = _drafter_list(args.drafters)
    options = _options_of(names, args.drafter_option, "record")
    prompts = load_workload(args.workload, per_category=args.per_category)
    if args.limit:
        prompts = prompts[: args.limit]
    loaded = load_model(
        args.model, dtype=args.dtype, device=args.device, weights=args.weights, forward=args.forward
    )
    # record() says how many prompts a resume finds recorded, once it has checked their parts
    t0 = time.perf_counter()
    trace = record(
        loaded,
        prompts,
        names,
        out,
        max_new_tokens=args.max_new_tokens,
        drafter_options=options,
        workload=args.workload or "builtin",
        progress=not args.json,
        overwrite=args.overwrite,
    )
    nodes = {n: round(float(t.off[-1]) / max(1, trace.traj.shape[0]), 1) for n, t in trace.trees.items()}
    summary: dict[str, Any] = {
        "out": str(out),
        "prompts": trace.num_prompts,
        "positions": int(trace.traj.shape[0]),
        "mb": round(out.stat().st_size / 1e6, 2),
        "seconds": round(time.perf_counter() - t0, 1),
        "mean_tree_nodes": nodes,
        "drafters": {n: ("exact" if d["exact"] else "approximate") for n, d in trace.drafters.items()},
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            f"{out}: {summary['prompts']} prompts, {summary['positions']} positions, {summary['mb']} MB, "
            f"{summary['seconds']} s; replay per drafter: {summary['drafters']}; mean tree nodes {nodes}"
        )
    return 0


def _calibrate_batch(
    args: argparse.Namespace, loaded: Any, names: list[str], out: Any, options: dict[str, dict[str, Any]]
) -> int:
    from env.batch_calibrate import calibrate_batch

    t0 = time.perf_counter()
    # the measurements so far, beside the output: a rerun after a kill resumes from them
    work = out.with_name(out.name + ".partial")  # held by cmd_calibrate since before the model loaded
    resuming = work.exists()
    bc = calibrate_batch(loaded, names, reps=max(args.reps, 3), progress=not args.json, work=work,
                         drafter_options=options)  # fmt: skip
    bc.meta["command"] = " ".join(["draftgym", *sys.argv[1:]])
    bc.meta["drafter_options"] = options  # what the drafters were timed with ({}: their defaults)
    bc.save(out)
    work.unlink(missing_ok=True)
    if resuming and not args.json:
        print(
            f"(resumed from {work}: {'the measurements of the run before were kept' if bc.meta['resumed'] else 'nothing to keep'})"
        )
    ms = {
        f"{r}x{n}": round(1e3 * float(bc.base[i, j]), 2)
        for i, r in enumerate(bc.rows)
        for j, n in enumerate(bc.nodes)
    }
    summary = {"out": str(out), "seconds": round(time.perf_counter() - t0, 1), "model": bc.model_id, "dtype": bc.dtype,
               "weights": bc.weights, "context_ref": bc.context_ref, "step_ms": ms,
               "draft_us_per_row": {k: round(1e6 * v, 1) for k, v in bc.drafters.items() if k not in bc.batched},
               "draft_ms_batched": {k: {"rows": list(b.rows), "fixed_ms": [round(1e3 * x, 3) for x in b.fixed_s],
                                        "level_ms": [round(1e3 * x, 3) for x in b.level_s]}
                                    for k, b in bc.batched.items()}}  # fmt: skip
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"batch cost model for {bc.model_id} ({bc.dtype}, {bc.weights}) -> {out}  [{summary['seconds']} s]")
    print(f"ms of a batch step at context {bc.context_ref} (rows x nodes per row):")
    print(f"{'rows':>6}" + "".join(f"{n:>9}" for n in bc.nodes))
    for i, r in enumerate(bc.rows):
        print(f"{r:>6}" + "".join(f"{1e3 * bc.base[i, j]:9.1f}" for j in range(len(bc.nodes))))
    print(f"drafters, us per row: {summary['draft_us_per_row']}")
    for k, b in bc.batched.items():  # a model head drafts a batch's rows together: ms per batch
        cells = ", ".join(
            f"{r} rows {1e3 * f:.2f} + {1e3 * lv:.2f}/level" for r, f, lv in zip(b.rows, b.fixed_s, b.level_s)
        )
        print(f"{k}, ms per batch: {cells}")
        if b.catch_s is not None:  # its catch-up past the last step's commits
            print(
                f"{k}, catch-up us per token: "
                + ", ".join(f"{r} rows {1e6 * c:.1f}" for r, c in zip(b.rows, b.catch_s))
            )
    return 0


def register(sub: Any) -> None:
    from experiments.args import drafter_option_args, int_at_least, model_args, new_tokens, positive_int

    c = sub.add_parser("calibrate", help="measure this machine's step costs into a cost-model JSON")
    model_args(c)
    c.add_argument("--drafters", default="ngram", help="comma list of drafters to time (default: ngram)")
    c.add_argument(
        "--reps",
        type=int_at_least(1, 10_000),
        default=4,
        help="measurements per grid point (the median is kept)",
    )
    c.add_argument(
        "--out",
        default=None,
        help="output JSON (default: runs/cost_model.json; --batch: runs/batch_cost.json)",
    )
    c.add_argument("--batch", action="store_true",
                   help="the batch cost model of the serving env: the step over rows x nodes x context, prefill")  # fmt: skip
    c.add_argument("--json", action="store_true", help="print one JSON summary")
    drafter_option_args(c)  # time the drafters as a trace recorded them (draftgym record --drafter-option)
    c.set_defaults(func=cmd_calibrate)

    r = sub.add_parser("record", help="record a replay trace (greedy) of a workload; re-run to resume")
    r.add_argument("--workload", default=None, help="Spec-Bench JSONL file (default: the built-in set)")
    r.add_argument("--per-category", type=positive_int, default=None, help="first N prompts of each category")
    r.add_argument("--limit", type=positive_int, default=None, help="first N prompts in all")
    r.add_argument("--drafters", default="ngram", help="comma list of drafters to record (default: ngram)")
    r.add_argument("--out", required=True, help="trace file (.npz); a killed run resumes from OUT.parts/")
    r.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    r.add_argument("--max-new-tokens", type=new_tokens, default=128)
    drafter_option_args(r)  # kept in the trace's header: a resume with other options is refused
    model_args(r)
    r.set_defaults(dtype="fp32")  # greedy exactness is defined in fp32
    r.add_argument("--json", action="store_true", help="print one JSON summary")
    r.set_defaults(func=cmd_record)
