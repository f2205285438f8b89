"""``draftgym serve-bench``: a workload served under a list of load levels, every method on the same requests at the
same load, with continuous batching (``env.serving``) on the batch-native engine (``env.batch``).

Methods: ``ar`` (our engine, no draft), arm names (``ngram-d4``, ``recycling-d3-k2-b6``, ...), ``mix(ARM,ARM,...)``
(the arms given to the requests in turn, so one batch holds rows with different arms) and ``hf_batch`` (Hugging
Face ``generate`` on left-padded batches of ``concurrency`` prompts, wave after wave: the static-batching peer).
Closed loop by default (``concurrency`` requests in flight); ``--rate R``: open loop, Poisson arrivals at R
requests/s, at most ``concurrency`` in the batch; ``--arrivals FILE``: open loop from a recorded arrival trace.
``--prefill-chunk N``: entering requests are prefilled N tokens at a time between batch steps.

Per method and load: goodput (committed tokens/s over all requests, ``env.metrics.goodput``), time per output token
(mean, p50, p99), time to first token (p50), τ, and speedup over ``ar`` at the same load. ``OUT/cells.jsonl`` gets
one line per finished (method, load) as it finishes, with the session (this call) that served it (a rerun
skips those: resume after a kill); ``OUT/serve.json`` (``rows``, ``requests`` with each one's arm — ``policy``
under ``--policy`` — and its steps per arm, settings with the machine, provenance, ``notes``) and
``OUT/goodput.png`` at the end. A speedup whose cell and ``ar`` cell come from different sessions is marked
(``experiments.serve_summary``).
"""

from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from env.cli import seed_int
from env.files import Appending, atomic_write_text, jsonl_lines
from experiments.serve_summary import (
    format_rows,
    request_rows,
    session_notes,
    summarize_cell,
    summary_rows,
)

HF_BATCH = "hf_batch"
DEFAULT_METHODS = ("ar", HF_BATCH, "ngram-d2", "ngram-d4", "ngram-d8")
DEFAULT_LEVELS = (1, 2, 4, 8, 16)


def split_methods(text: str) -> list[str]:
    """``ar,mix(none,ngram-d4),ngram-d8`` -> ``["ar", "mix(none,ngram-d4)", "ngram-d8"]`` (commas in parentheses
    stay)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    out.append(cur.strip())
    return [m for m in out if m]


def method_arms(method: str) -> list[Any]:
    """The arms a method gives its requests, in turn (``mix``), or its one arm (a policy: none of its own)."""
    from drafters import DrafterError
    from env.engine import parse_arm

    if method == HF_BATCH or method.startswith("policy:"):
        return []
    if method.startswith("mix(") and method.endswith(")"):
        names = [a.strip() for a in method[4:-1].split(",") if a.strip()]
        if not names:
            raise DrafterError(f"{method}: a mix needs at least one arm, e.g. mix(none,ngram-d4)")
        return [parse_arm(a) for a in names]
    if "(" in method or ")" in method:
        raise DrafterError(f"cannot read method {method!r}; a mix is written mix(ARM,ARM,...)")
    return [parse_arm(method)]


def run_hf_batch(
    loaded: Any, prompts: list[list[int]], rids: list[str], level: int, max_new: int
) -> list[dict]:
    """Hugging Face ``generate`` on left-padded waves of ``level`` prompts (greedy); per request its tokens (cut at
    end of sequence), and the wave's times: a request arrives when its wave starts (as ours when it enters the batch)
    and finishes with it. ``generate`` times no token on its own, so no first-token time: TTFT and TPOT are not
    reported for it (goodput is)."""
    import torch

    tok = loaded.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    eos = set(loaded.eos_token_ids)
    out, t0 = [], time.perf_counter()
    for i in range(0, len(prompts), level):
        wave = prompts[i : i + level]
        width = max(len(p) for p in wave)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in wave], device=loaded.device)
        att = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in wave], device=loaded.device)
        start = time.perf_counter() - t0
        with torch.no_grad():
            gen = loaded.model.generate(
                ids, attention_mask=att, max_new_tokens=max_new, do_sample=False, pad_token_id=pad
            )
        end = time.perf_counter() - t0
        for j, row in enumerate(gen[:, width:].tolist()):
            cut = next((k + 1 for k, t in enumerate(row) if t in eos), len(row))
            toks = row[:cut]
            out.append({"rid": rids[i + j], "arm": HF_BATCH, "token_ids": toks, "arrival_s": start,
                        "first_token_s": None, "finish_s": end, "steps": len(toks), "accepted": 0, "drafted": 0,
                        "wave_start_s": start})  # fmt: skip
    return out


def run_cell(loaded, method, level, prompts, rids, args, engine_cache) -> list[dict[str, Any]]:
    from dataclasses import asdict

    from env.batch import BatchEngine
    from env.engine import NO_DRAFT, parse_arm
    from env.serving import Request, ServeLog, poisson_arrivals, serve

    if method == HF_BATCH:
        wave = min(args.max_batch or level, level)  # the batch limit every method runs under
        return run_hf_batch(loaded, prompts, rids, wave, args.max_new_tokens), None
    policy = args.policy_objects.get(method)
    if (
        policy is not None
    ):  # each cell (and warm-up) serves with the policy as loaded: an online one's learning
        policy = copy.deepcopy(
            policy
        )  # in one cell must not carry into the next (order-, resume-independent)
    # a policy's requests hold a placeholder arm: serve ignores it, records arm "policy" and each request's
    # steps per arm the policy chose (arm_steps)
    arms = method_arms(method) if policy is None else [NO_DRAFT]
    if args.arrivals:
        arrivals = args.arrival_times
    elif args.rate:
        arrivals = poisson_arrivals(len(prompts), args.rate, args.seed)
    else:
        arrivals = [0.0] * len(prompts)
    open_loop = bool(args.rate or args.arrivals)
    reqs = [Request(r, p, arms[i % len(arms)], args.max_new_tokens, arrivals[i])
            for i, (r, p) in enumerate(zip(rids, prompts))]  # fmt: skip
    rows = min(args.max_batch or level, level, len(reqs))  # more rows than requests would stay empty
    engine = engine_cache.get(rows)
    if engine is None:
        engine = engine_cache[rows] = BatchEngine(loaded, max_rows=rows)
    log = ServeLog()
    extra: dict[str, Any] = {}
    if policy is not None:  # the policy picks every step's arm from its menu (env.serve_env observation)
        extra = {
            "policy": policy,
            "arms": [parse_arm(a) for a in policy.arm_names],
            "cost": args.batch_cost_model,
            "obs_max_batch": args.policy_max_batch[method],
        }
        rows = min(rows, args.policy_max_batch[method])
    served = serve(engine, reqs, concurrency=None if open_loop else level, max_batch=rows, kv_budget=args.kv_budget,
                   prefill_chunk=args.prefill_chunk, log=log, drafter_options=args.drafter_options, **extra)  # fmt: skip
    return [asdict(s) for s in served], log.as_dict()


def load_cells(path: Path) -> dict[tuple[str, int], dict[str, Any]]:
    """Finished cells of an earlier (maybe killed) run; a torn last line is dropped (and cut from the file), a
    line that is no JSON is skipped (its cell is served again), and one that is JSON but no cell this command
    wrote (``serve_summary.cell_problem``) is a ``UserError`` naming the file and the line."""
    from experiments.errors import UserError
    from experiments.serve_summary import cell_problem

    out = {}
    for n, line in enumerate(jsonl_lines(path), 1):
        try:
            c = json.loads(line)
        except (ValueError, RecursionError):
            continue
        why = cell_problem(c)
        if why:
            raise UserError(
                f"{path}: line {n} {why}: not a cell serve-bench wrote; delete that line (its cell is served "
                "again) or use another --out"
            )
        out[(c["method"], c["concurrency"])] = c
    return out


def cmd_serve_bench(args: Any) -> int:
    from tqdm import tqdm

    from env.decoder import chat_prompt
    from env.model import load_model
    from env.serving import ServeError, check_load
    from env.target import check_prompt
    from env.workloads import load_workload, prompts_digest
    from experiments import plots
    from experiments.args import (
        drafter_options,
        output_dir,
        same_drafter_options,
        same_settings,
        served_drafter_options,
    )
    from experiments.errors import UserError
    from experiments.provenance import provenance
    from experiments.records import machine_identity, machine_label, new_session

    session = new_session()  # stamped on each cell served here (a resume: another session)
    levels = parse_levels(args.concurrency)
    methods = split_methods(args.methods)
    typed = [m for m in methods if m.startswith("policy:")]
    if typed:  # a policy method comes from its file alone (it had no arm to serve: a crash mid-run)
        raise UserError(f"--methods {typed[0]}: a serving policy is served through --policy FILE, which names it "
                        "policy:STEM; leave it out of --methods")  # fmt: skip
    args.policy_objects, args.policy_max_batch, args.batch_cost_model = {}, {}, None
    for path in args.policy or []:  # serving policies (draftgym serve-train): one method each
        from env.batch_cost import load_batch_cost
        from experiments.policy_commands import check_meta, serving_max_batch
        from policies.base import load_policy

        pol = check_meta(load_policy(path), path)  # a hand-edited meta: one line, as evaluate --serve says it
        m = serving_max_batch(pol, path)
        name = f"policy:{Path(path).stem}"
        if name in args.policy_objects:
            raise UserError(f"--policy {path}: another --policy file is named {name} too (rename one)")
        methods.append(name)
        args.policy_objects[name], args.policy_max_batch[name] = pol, m
        args.batch_cost_model = load_batch_cost(args.batch_cost)
    # every method serves the drafters as the policies were trained on them, unless --drafter-option says otherwise
    args.drafter_options = served_drafter_options(args.policy_objects, drafter_options(args.drafter_option))
    if args.batch_cost is not None and not args.policy:
        raise UserError("--batch-cost prices a serving policy's choices; it needs --policy (none given)")
    if not methods or len(set(methods)) != len(methods):
        raise UserError(f"--methods must name each method once, got {methods}")
    for m in methods:
        method_arms(m)  # bad names fail before the model loads
    if args.rate is not None and args.rate <= 0:
        raise ServeError(f"--rate must be > 0 requests/s, got {args.rate}")
    if args.rate is not None and args.arrivals:
        raise UserError("--rate and --arrivals both set the arrivals; give one")
    prompts = load_workload(args.workload, per_category=args.per_category)
    if args.limit:
        prompts = prompts[: args.limit]
    args.arrival_times = read_arrivals(args.arrivals, len(prompts)) if args.arrivals else None
    if args.rate is not None:  # served in real time, as a file's arrivals are
        from env.serving import poisson_arrivals

        last = poisson_arrivals(len(prompts), args.rate, args.seed)[-1]
        if last > MAX_ARRIVAL_S:
            raise UserError(
                f"--rate {args.rate:g}: request {len(prompts)} would arrive at {last:g} s; a served stream spans "
                f"at most {MAX_ARRIVAL_S} s (a higher rate, or fewer requests)"
            )
    if HF_BATCH in methods and (args.rate is not None or args.arrivals):
        if args.methods != ",".join(DEFAULT_METHODS):
            raise UserError(
                f"{HF_BATCH} serves waves of prompts from time 0 and cannot follow arrivals: drop it, or "
                "--rate/--arrivals"
            )
        methods.remove(
            HF_BATCH
        )  # the default methods under an open loop: the static-batching peer cannot run
    out = output_dir(args.out or "runs/serve-bench", exclusive=True)
    started = bool(load_cells(out / "cells.jsonl"))
    same_drafter_options(
        out, args.drafter_options, started=started, write=False
    )  # other options: before the model
    loaded = load_model(
        args.model, dtype=args.dtype, device=args.device, weights=args.weights, forward=args.forward
    )
    from env.engine import parse_arm
    from experiments.methods import prepare_arm_drafters

    served = [a for m in methods for a in method_arms(m)]  # and the serving policies' menus
    served += [parse_arm(a) for pol in args.policy_objects.values() for a in getattr(pol, "arm_names", ())]
    prepare_arm_drafters(
        loaded, served, args.drafter_options
    )  # a bad head file: before the folder holds anything
    same_drafter_options(out, args.drafter_options, started=started)
    ids = [chat_prompt(loaded.tokenizer, p.text) for p in prompts]
    rids = [p.prompt_id for p in prompts]
    for p, i in zip(prompts, ids):
        check_prompt(i, loaded.max_context, f"prompt {p.prompt_id}")
    from env.serving import Request

    for m in methods:  # the KV budget must hold the largest request of every method
        for arm in method_arms(m) or []:
            check_load([Request(r, i, arm, args.max_new_tokens) for r, i in zip(rids, ids)],
                       concurrency=max(levels), max_batch=args.max_batch or max(levels), kv_budget=args.kv_budget)  # fmt: skip
    settings = {
        "model": loaded.model_id, "dtype": str(loaded.dtype).removeprefix("torch."), "device": str(loaded.device),
        "workload": args.workload or "builtin", "per_category": args.per_category, "requests": len(prompts),
        "max_new_tokens": args.max_new_tokens, "concurrency": levels, "rate": args.rate, "methods": methods,
        "drafter_options": args.drafter_options,
        "max_batch": args.max_batch, "kv_budget": args.kv_budget, "arrivals": args.arrivals,
        "prefill_chunk": args.prefill_chunk, "loop": "open" if args.rate or args.arrivals else "closed",
        "command": " ".join(["draftgym", *sys.argv[1:]]),
        "machine": machine_identity(loaded.device),  # as bench names it; settings.json keeps its keys flat (below)
    }  # fmt: skip
    cells_path = out / "cells.jsonl"
    cells = load_cells(cells_path)
    from env.files import file_digest
    from experiments.records import (
        cost_identity,
        head_identity,
        method_drafters,
        run_identity,
        workload_digest,
        workload_identity,
    )

    same_settings(out, {
        **run_identity(loaded, args.max_new_tokens, args.drafter_options),
        **settings["machine"],
        "workload": workload_identity(args.workload), "workload_sha256": workload_digest(args.workload),
        "workload_prompts_sha256": prompts_digest(args.workload),  # built-in, code: (no file)
        "prompt_ids": rids, "rate": args.rate,
        "arrivals": None if args.arrivals is None else file_digest(args.arrivals), "max_batch": args.max_batch,
        "kv_budget": args.kv_budget, "prefill_chunk": args.prefill_chunk, "seed": args.seed if args.rate else None,
        "policies": {m: file_digest(p) for m, p in zip(args.policy_objects, args.policy or [])},
        "batch_cost": cost_identity(args.batch_cost) if args.policy else None,
        # the heads the methods' drafters load, by their contents (a head swapped under its file name: refused)
        **head_identity(method_drafters([*(a for m in methods for a in method_arms(m) or []),
                                         *(a for p in args.policy_objects.values() for a in p.arm_names)]),
                        args.drafter_options, loaded.model_id),
    }, started=bool(cells), command="serve-bench")  # fmt: skip
    todo = [(m, c) for c in levels for m in methods if (m, c) not in cells]
    engines: dict[int, Any] = {}
    warm = args.__class__(**{**vars(args), "max_new_tokens": 4, "rate": None})
    warm.arrivals, warm.arrival_times = None, None
    bar = tqdm(
        total=len(levels) * len(methods),
        initial=sum(1 for c in levels for m in methods if (m, c) in cells),
        desc="serve-bench",
        disable=args.json,
    )
    longest = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
    warmed: set[int] = set()
    with Appending(cells_path) as fh:
        for m, c in todo:
            # untimed, once per level: every method on this level's engine with its longest prompts (the lazy
            # set-up of each method, and the first touches of this batch size's buffers)
            if c not in warmed:
                warmed.add(c)
                pick = longest[:c]
                for wm in dict.fromkeys(m for m, _ in todo):
                    run_cell(loaded, wm, c, [ids[i] for i in pick], [rids[i] for i in pick], warm, engines)
            served, log = run_cell(loaded, m, c, ids, rids, args, engines)
            cell = {
                "method": m,
                "concurrency": c,
                "session": session,
                "served": served,
                "summary": summarize_cell(m, c, served, log),
            }
            fh.write(json.dumps(cell) + "\n")
            fh.flush()
            cells[(m, c)] = cell
            bar.update(1)
            bar.set_postfix_str(f"{m} @ {c}: {cell['summary']['goodput_tok_s']:.1f} tok/s")
    bar.close()
    rows = summary_rows(cells, levels, methods)
    notes = session_notes(rows)
    requests = request_rows(cells, levels, methods)
    result = {
        "settings": settings,
        "provenance": provenance(),
        "rows": rows,
        "requests": requests,
        "notes": notes,
    }
    atomic_write_text(out / "serve.json", json.dumps(result))
    machine = machine_label(settings)
    sessions = len({r["session"] for r in rows})  # the plot's goodputs too: of the runs these cells came from
    footer = f"measured on {machine}" + (
        f"; cells from {sessions} sessions (a resumed run)" if sessions > 1 else ""
    )
    arrivals = f"Poisson arrivals at {args.rate} req/s" if args.rate else "arrivals from a file"
    xlabel = f"max batch (open loop: {arrivals})" if args.rate or args.arrivals else None
    png = plots.goodput_vs_concurrency(rows, out / "goodput.png", title=f"{loaded.model_id} ({settings['dtype']})",
                                       note=footer, **({"xlabel": xlabel} if xlabel else {}))  # fmt: skip
    if args.json:
        print(json.dumps({"rows": rows, "notes": notes, "out": str(out)}))
    else:
        print(f"{loaded.model_id} ({settings['dtype']}) on {machine or settings['device']}")
        print(format_rows(rows))
        print("".join(f"\n{n}" for n in notes))
        print(f"\ngoodput: committed tokens/s over all requests; results in {out}/serve.json, plot {png}")
    return 0


MAX_ARRIVAL_S = (
    3600  # the last served request's arrival, seconds from the start (serve-bench waits in real time)
)


MAX_ARRIVALS_BYTES = 16 << 20  # a line per request: far more than any served trace


def read_arrivals(path: str, n: int) -> list[float]:
    """A recorded arrival trace: one arrival time (seconds from the start, non-decreasing) per line, the i-th for
    the i-th request; at least as many as there are requests."""
    from experiments.errors import UserError, describe_os_error

    src = Path(path)
    if src.exists() and not src.is_file():  # a FIFO would block, a device never end
        raise UserError(f"--arrivals {path} is not a regular file")
    if src.is_file() and src.stat().st_size > MAX_ARRIVALS_BYTES:
        raise UserError(f"--arrivals {path} is over {MAX_ARRIVALS_BYTES >> 20} MiB: not an arrival trace")
    try:
        text = src.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(
            f"--arrivals {path}: {describe_os_error(err) if isinstance(err, OSError) else 'not UTF-8 text'}"
        ) from None
    times = []
    for k, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            t = float(line)
        except ValueError:
            raise UserError(
                f"--arrivals {path}, line {k}: {line.strip()[:40]!r} is not a time in seconds"
            ) from None
        if not np.isfinite(t) or t < 0 or (times and t < times[-1]):
            raise UserError(f"--arrivals {path}, line {k}: times must be finite, >= 0 and non-decreasing")
        times.append(t)
    if len(times) < n:
        raise UserError(f"--arrivals {path} has {len(times)} arrival times for {n} requests")
    if times[n - 1] > MAX_ARRIVAL_S:  # served in real time: a trace of days would be a run of days
        raise UserError(
            f"--arrivals {path}: request {n} arrives at {times[n - 1]:g} s; a served trace spans at most "
            f"{MAX_ARRIVAL_S} s (scale the times down, or serve fewer requests)"
        )
    return times[:n]


MAX_LEVEL = 4096  # rows a batch engine is built for (each row's KV cache is allocated up front)


def parse_levels(text: str) -> list[int]:
    from experiments.errors import UserError

    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--concurrency must be a comma list of integers, got {text!r}") from None
    if not levels or any(c < 1 or c > MAX_LEVEL for c in levels):
        raise UserError(f"--concurrency levels must be in [1, {MAX_LEVEL}], got {text!r}")
    return sorted(dict.fromkeys(levels))


def register(sub: Any) -> None:
    from experiments.args import (
        drafter_option_args,
        float_in,
        int_at_least,
        model_args,
        new_tokens,
        positive_int,
    )

    p = sub.add_parser(
        "serve-bench", help="goodput against load: continuous batching, every method, each level"
    )
    p.add_argument("--workload", default=None, help="Spec-Bench JSONL file (default: the built-in set)")
    p.add_argument("--per-category", type=positive_int, default=None, help="first N prompts of each category")
    p.add_argument("--limit", type=positive_int, default=None, help="first N prompts in all")
    p.add_argument(
        "--concurrency", default=",".join(map(str, DEFAULT_LEVELS)), help="load levels, e.g. 1,2,4,8,16"
    )
    p.add_argument("--rate", type=float_in(0.0, 1e6, low_open=True), default=None,
                   help="open loop: Poisson arrivals at R requests/s (default: closed loop)")  # fmt: skip
    p.add_argument("--arrivals", default=None,
                   help="open loop from a recorded arrival trace: one time in seconds per line, per request")  # fmt: skip
    p.add_argument("--prefill-chunk", type=positive_int, default=None,
                   help="prefill entering requests N tokens at a time between batch steps (default: whole)")  # fmt: skip
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help="comma list: ar, hf_batch, arm names, mix(ARM,ARM,...)")  # fmt: skip
    p.add_argument("--policy", action="append", default=None, metavar="PATH",
                   help="a serving policy (draftgym serve-train) choosing each step's arm: method policy:NAME; "
                   "every method serves the drafters with the options the policy was trained on (its trace's; "
                   "--drafter-option overrides them)")  # fmt: skip
    p.add_argument("--batch-cost", default=None,
                   help="--policy: the batch cost model its online updates price steps with (default: the shipped)")  # fmt: skip
    p.add_argument("--max-new-tokens", type=new_tokens, default=128)
    p.add_argument(
        "--max-batch", type=positive_int, default=None, help="rows in the batch at most (default: the level)"
    )
    p.add_argument("--kv-budget", type=int_at_least(1), default=1 << 22,
                   help="KV positions all requests in flight may reserve (prompt + answer + a tree each)")  # fmt: skip
    p.add_argument("--seed", type=seed_int, default=0, help="arrival seed (--rate)")
    p.add_argument(
        "--out", default=None, help="run directory (default runs/serve-bench); re-use it to resume"
    )
    model_args(p)
    drafter_option_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_serve_bench)
