"""``draftgym serve-train``: fit and train the serving policies on the replayed serving env
``draftgym/SpecServe-v0``, on the training prompts of a split (``experiments.serve_policies`` evaluates them).

The policies: the engines' batch-size table fitted on this cost curve, TensorRT-LLM's AUTO rule, the SmartSpec
rule and the same rule with its cost model corrected online by the step times it serves (``turbospec``), a bandit
per batch-size bucket, LinUCB, the accept-length predictor under SmartSpec's pricing (``predictor``,
``policies.serve_predictor``), PPO (stable-baselines3 on the vectorized replay) with one arm for the batch, and PPO
with one arm per row (``ppo-rows``, ``policies.rl_rows``). Each is saved under ``--out`` as soon as it is made,
with ``train.json``; a rerun checks its settings and trains only what is missing; PPO, killed midway,
resumes from its latest checkpoint (``ppo-checkpoints/``, ``ppo-rows-checkpoints/``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from env.cli import seed_int
from env.files import atomic_write_text
from experiments.serve_policies import MAX_REQUESTS, _sim_factory, _split, check_streams, train_loads


def _same_trained(path: Path, meta: dict[str, Any], pre: str = "ppo") -> dict[str, Any] | None:
    """The training report a trained policy (PPO, ``pre`` "ppo" or "ppo_rows"; the predictor) at ``path`` carries
    when it was trained with these settings (its file's meta: split, cost model, lengths, timesteps), else None; a folder made before the settings check may hold one
    trained with others. The file alone decides: a kill between writing it and ``train.json`` loses nothing."""
    from policies.base import PolicyError, load_policy

    if not path.is_file():
        return None
    try:
        saved = dict(load_policy(path).meta or {})
    except PolicyError:
        return None
    saved.pop("name", None)
    # a file from before policies kept their trace's drafter options: the same trace (the caller checked the
    # folder's settings), so the same options
    saved.setdefault("drafter_options", meta.get("drafter_options"))
    report = saved.pop(f"{pre}_report", None)
    if json.loads(json.dumps(saved)) != json.loads(json.dumps(meta)):
        return None
    return report if isinstance(report, dict) else {}


def train_all(trace: Any, cost: Any, arms: list[str], split: Any, *, out: Path, max_new: int, requests: int,
              max_batch: int, timesteps: int, seed: int, progress: bool,
              row_timesteps: int | None = None, predictor_episodes: int = 16,
              drafter_options: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:  # fmt: skip
    """Fit and train every serving policy into ``out``. Each is saved as soon as it is made (the fitted ones before
    PPO starts), with ``train.json`` (the report so far); a rerun into the same folder (its settings checked by the
    caller) keeps the policies already saved and trains only the missing ones — after a kill during PPO, PPO, from
    its latest checkpoint. ``row_timesteps``: the per-row PPO's (None: ``timesteps`` where the menu is a grid,
    ``_row_timesteps``; 0: none). ``drafter_options``: the drafters' options the trace recorded, kept in every
    policy's meta (``{}``: the defaults) so that serving it (``serve-bench --policy``) serves the drafters it was
    trained on. ``predictor_episodes``: the streams at each load of each of the predictor's replays (0: no
    predictor); a rerun keeps a predictor saved with these settings."""
    from env.batch_cost import cost_digest
    from env.serve_env import feature_names, levels_upto, make_sb3_serve_env, obs_size
    from policies.linucb import LinUCB
    from policies.serve_rows import fit_table_first, has_table_and_other, table_first_moves
    from policies.serving import (
        BucketUCB,
        SmartSpecPolicy,
        fit_batch_table,
        run_policy,
        static_goodputs,
        train_serve_ppo,  # fmt: skip
        trt_auto,
    )
    from policies.turbospec import TurboSpecPolicy

    feats, size = feature_names(max_batch), obs_size(max_batch)
    row_timesteps = _row_timesteps(arms, timesteps, row_timesteps)
    loads = train_loads(max_batch)
    make = _sim_factory(trace, cost, arms, list(split.train), max_new, requests, max_batch)
    meta = {"split": split.as_dict(), "batch_cost": cost.label, "batch_cost_sha256": cost_digest(cost),
            "max_new_tokens": max_new, "requests": requests,
            "max_batch": max_batch, "trace_prompts": trace.num_prompts,
            "drafter_options": drafter_options or {}}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    report_path = out / "train.json"
    report: dict[str, Any] = {}
    if report_path.is_file():
        try:
            report = json.loads(report_path.read_text())
        except (ValueError, RecursionError):
            report = {}
        report = report if isinstance(report, dict) else {}

    def save(name: str, pol: Any, extra: dict[str, Any] | None = None) -> None:
        pol.meta = {**meta, "name": name, **(extra or {})}
        pol.save(out / f"{name}.zip")
        report["saved"] = sorted({*report.get("saved", []), name})
        atomic_write_text(report_path, json.dumps(report, indent=1))

    from tqdm import tqdm

    levels = [int(x) for x in loads if x.isdigit()]
    fit_table = has_table_and_other(
        arms
    )  # per row: the table drafter where the text repeats, another arm elsewhere
    total = len(levels) * len(arms) + (table_first_moves(arms, levels) if fit_table else 0) + 2
    bar = tqdm(total=total, desc="serve-train: fitting", unit="eval", disable=not progress, leave=False)
    t0 = time.perf_counter()
    goodputs = static_goodputs(make, arms, [str(x) for x in levels], episodes=16, seed=seed, tick=bar.update)
    report["static_train_goodput"] = goodputs
    policies: dict[str, Any] = {"fitted-table": fit_batch_table(goodputs, arms, size, feats)}
    if all(a in arms for a in ("ngram-d5", "ngram-d3", "none")):
        policies["trt-auto"] = trt_auto(arms, size, feats)
    policies["smartspec"] = SmartSpecPolicy(arms, size, feats, cost=cost.to_json())
    if "none" in arms:  # SmartSpec bent live to measured step times (it prices arms against a plain step)
        policies["turbospec"] = TurboSpecPolicy(arms, size, feats, cost=cost.to_json())
    if fit_table:
        policies["table-first"] = fit_table_first(make, arms, size, feats, levels, goodputs, seed=seed,
                                                  tick=bar.update)  # fmt: skip
    # online bandits: trained in replay on the training prompts, over the mixed training loads
    bucket = BucketUCB(arms, size, feats, buckets=levels_upto(max_batch))  # one bandit per load level
    lin = LinUCB(arms, size, feats, alpha=0.3)
    for pol in (bucket, lin):
        sim = make(8, loads=loads, seed=seed + 1)
        for _ in range(3):
            sim.reset()
            run_policy(sim, pol, learn=True)
        bar.update()
    bar.close()
    policies["bucket-ucb"], policies["linucb"] = bucket, lin
    report["fit_s"] = round(time.perf_counter() - t0, 1)
    report["saved"] = []
    for name, pol in policies.items():  # seconds to make again, deterministic: saved anew (a rerun's report)
        # rules that read no training prompt: evaluating them on any prompts is held out
        save(
            name,
            pol,
            {"fitted_on_prompts": False} if name in ("trt-auto", "smartspec", "turbospec") else None,
        )

    def make_vec(action: str) -> Any:
        return make_sb3_serve_env(64, trace=trace, arms=arms, cost=cost, max_batch=max_batch, loads=loads,
                                  requests=requests, max_new_tokens=max_new, prompt_ids=list(split.train),
                                  reward="goodput_ratio", seed=seed, action=action)  # fmt: skip

    def make_eval() -> Any:
        sim = make(8, loads=["ramp"], seed=seed + 2)
        sim.reset()
        return sim

    if predictor_episodes <= 0:  # none asked for: one of an earlier run is not this run's
        (out / "predictor.zip").unlink(missing_ok=True)
        report.pop("predictor", None)
        report["saved"] = [n for n in report["saved"] if n != "predictor"]
    else:
        _train_predictor(trace, cost, arms, split, loads, levels, meta, out, report, max_new=max_new,
                         requests=requests, max_batch=max_batch, episodes=predictor_episodes, seed=seed,
                         progress=progress)  # fmt: skip

    # PPO with one arm for the batch ("ppo"), then with one per row ("ppo-rows", policies.rl_rows)
    for name, steps, rows in (("ppo", timesteps, False), ("ppo-rows", row_timesteps, True)):
        pre = "ppo" if name == "ppo" else "ppo_rows"  # report keys: ppo_s, ppo_rows_s, ...
        keys = tuple(f"{pre}_{k}" for k in ("s", "timesteps", "curve", "plateau"))
        kept = (
            _same_trained(out / f"{name}.zip", {**meta, f"{pre}_timesteps": steps}, pre)
            if steps > 0
            else None
        )
        if kept is not None:  # trained before a kill of a later stage, or a finished run again: kept
            report.update({k: v for k, v in kept.items() if k in keys}, **{f"{pre}_timesteps": steps})
            report["saved"] = sorted({*report["saved"], name})
            continue
        if steps <= 0:
            continue
        t1 = time.perf_counter()
        ckpt = out / f"{name}-checkpoints"  # a kill during PPO resumes from its latest checkpoint
        policies[name], curve = train_serve_ppo(lambda rows=rows: make_vec("row" if rows else "batch"), arms, size,
                                                feats, timesteps=steps, seed=seed, progress=progress,
                                                make_eval=make_eval, checkpoints=ckpt, rows=rows)  # fmt: skip
        report[f"{pre}_s"] = round(getattr(policies[name], "train_wall_s", time.perf_counter() - t1), 1)
        report[f"{pre}_timesteps"] = steps
        report[f"{pre}_curve"] = curve  # replayed goodput on a ramp of training prompts, training seconds
        if curve:
            top = max(c["goodput"] for c in curve)
            first = next(c for c in curve if c["goodput"] >= 0.99 * top)
            report[f"{pre}_plateau"] = {
                "goodput": top,
                "timesteps": first["timesteps"],
                "seconds": first["seconds"],
            }
        save(name, policies[name], {f"{pre}_timesteps": steps,
                                    f"{pre}_report": {k: report[k] for k in keys if k in report}})  # fmt: skip
        shutil.rmtree(ckpt, ignore_errors=True)  # the policy file holds what a rerun needs
    return report


def _train_predictor(trace: Any, cost: Any, arms: list[str], split: Any, loads: list[str], levels: list[int],
                     meta: dict[str, Any], out: Path, report: dict[str, Any], *, max_new: int, requests: int,
                     max_batch: int, episodes: int, seed: int, progress: bool) -> None:  # fmt: skip
    """The serve predictor (``policies.serve_predictor``) into ``out/predictor.zip``, unless one trained with these
    settings is there (minutes of replay and fitting)."""
    from tqdm import tqdm

    from env.serve_env import feature_names, obs_size
    from policies.serve_predictor import predictor_ticks, train_serve_predictor

    settings = {**meta, "predictor_episodes": episodes}
    kept = _same_trained(out / "predictor.zip", settings, "predictor")
    if kept is None:
        rounds = 2
        bar = tqdm(total=predictor_ticks(len(split.train), len(levels), rounds), desc="serve-train: predictor", unit="fit",
                   disable=not progress, leave=False)  # fmt: skip
        t0 = time.perf_counter()

        def make_for(prompts: Any) -> Any:
            return _sim_factory(trace, cost, arms, list(prompts), max_new, requests, max_batch)

        pol = train_serve_predictor(make_for, list(split.train), arms, obs_size(max_batch), feature_names(max_batch),
                                    cost.to_json(), loads=loads, levels=levels, episodes=episodes, rounds=rounds,
                                    seed=seed, tick=bar.update)  # fmt: skip
        bar.close()
        kept = {"s": round(time.perf_counter() - t0, 1), "shrink": pol.shrink}
        pol.meta = {**settings, "name": "predictor", "predictor_report": kept}
        pol.save(out / "predictor.zip")
    report["predictor"] = {**kept, "episodes": episodes}
    report["saved"] = sorted({*report["saved"], "predictor"})
    atomic_write_text(out / "train.json", json.dumps(report, indent=1))


def _row_timesteps(arms: list[str], timesteps: int, given: int | None) -> int:
    """The per-row PPO's steps: as given, else PPO's where the menu is a grid of drafters and shapes with
    ``none`` (``policies.rl_rows.menu_grid``; else none). Given for a menu that is no grid: a ``UserError``."""
    from experiments.errors import UserError
    from policies.base import PolicyError
    from policies.rl_rows import menu_grid

    try:
        menu_grid(arms)
    except PolicyError as err:
        if given:
            raise UserError(f"--row-timesteps: {err}") from None
        return 0
    return timesteps if given is None else given


def cmd_serve_train(args: argparse.Namespace) -> int:
    from env.batch_cost import load_batch_cost
    from env.engine import parse_arm
    from env.serve_env import DEFAULT_ARMS, default_serve_trace
    from env.trace import load_trace
    from env.trace_record import recorded_drafter_options
    from experiments.args import output_dir
    from experiments.errors import UserError

    trace = default_serve_trace() if args.trace is None else load_trace(args.trace)
    options = recorded_drafter_options(trace, args.trace or "the bundled trace")  # checked: from a file
    cost = load_batch_cost(args.batch_cost)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()] if args.arms else list(DEFAULT_ARMS)
    if not arms:
        raise UserError(f"--arms names no arm (got {args.arms!r}); e.g. --arms none,ngram-d2,ngram-d5")
    for a in arms:  # before the run folder is touched
        arm = parse_arm(a)
        if arm.drafter is not None and arm.shape.topk != 1:  # (refused once settings.json was written)
            raise UserError(f"--arms: {a} is a tree, and the SmartSpec and TurboSpec policies serve-train fits price "
                            "chains only")  # fmt: skip
    if not 2 <= args.max_new_tokens <= trace.max_new_tokens:
        raise UserError(f"--max-new-tokens must be in 2..{trace.max_new_tokens} (what the trace recorded), "
                        f"got {args.max_new_tokens}")  # fmt: skip
    twice = sorted({a for a in arms if arms.count(a) > 1})
    if twice:
        raise UserError(f"--arms lists {', '.join(twice)} more than once")
    check_streams(max(64, args.predictor_episodes), args.requests, "--predictor-episodes x --requests")
    row_timesteps = _row_timesteps(arms, args.timesteps, args.row_timesteps)
    split = _split(trace, args.test_per_category, args.seed)
    from env.serve_env import obs_size
    from policies.linucb import MAX_FLOATS

    if len(arms) * (obs_size(args.max_batch) + 1) ** 2 > MAX_FLOATS:  # LinUCB's matrices: before any work
        most = max(m for m in range(1, args.max_batch) if len(arms) * (obs_size(m) + 1) ** 2 <= MAX_FLOATS)
        raise UserError(
            f"--max-batch {args.max_batch}: the LinUCB policy over {len(arms)} arms keeps a matrix per arm of the "
            f"observation's size squared, {len(arms) * (obs_size(args.max_batch) + 1) ** 2:,} floats; at most "
            f"--max-batch {most} with this menu"
        )
    out = output_dir(args.out, exclusive=True)
    from env.files import file_digest
    from experiments.args import same_settings
    from experiments.records import cost_identity

    if (
        any(out.glob("*.zip")) and not (out / "settings.json").exists()
    ):  # (it replaces and deletes its .zip files)
        raise UserError(
            f"--out {out} holds .zip files and no settings.json: not a serve-train folder; use another --out"
        )
    same_settings(out, {
        "trace": "bundled" if args.trace is None else file_digest(args.trace),
        "batch_cost": cost_identity(args.batch_cost), "arms": arms, "split": split.as_dict(),
        "max_new_tokens": args.max_new_tokens, "requests": args.requests, "max_batch": args.max_batch,
        "timesteps": args.timesteps, "row_timesteps": row_timesteps, "seed": args.seed,
    }, started=any(out.glob("*.zip")), command="serve-train")  # fmt: skip
    rep = train_all(trace, cost, arms, split, out=out, max_new=args.max_new_tokens, requests=args.requests,
                    max_batch=args.max_batch, timesteps=args.timesteps, seed=args.seed,
                    row_timesteps=row_timesteps, drafter_options=options, predictor_episodes=args.predictor_episodes,
                    progress=sys.stderr.isatty() and not args.json)  # fmt: skip
    rep.update(
        out=str(out), batch_cost=cost.label, train_prompts=len(split.train), test_prompts=len(split.test)
    )
    atomic_write_text(out / "train.json", json.dumps(rep, indent=1))
    if args.json:
        print(json.dumps(rep))
    else:
        print(f"serving policies ({', '.join(rep['saved'])}) -> {out}  [{cost.label}]")
        table = next((p for p in rep["saved"] if p == "fitted-table"), None)
        if table:
            print("best static arm per concurrency (replay, training prompts):")
            for load, g in rep["static_train_goodput"].items():
                best = max(g, key=g.get)
                print(
                    f"  {load:>3}: {best:<10} {g[best]:8.1f} tok/s   (none: {g.get('none', float('nan')):.1f})"
                )
    return 0


def register(sub: Any) -> None:
    from experiments.args import int_at_least, new_tokens, positive_int
    from experiments.serve_bench import MAX_LEVEL

    t = sub.add_parser("serve-train", help="fit and train the serving policies on the replayed serving env")
    t.add_argument("--trace", default=None, help="replay trace (default: the bundled serving trace)")
    t.add_argument("--batch-cost", default=None,
                   help="batch cost model JSON, or roofline:ACC/MODEL (simulated); default the shipped")  # fmt: skip
    t.add_argument("--arms", default=None, help="arm menu, comma list (default: env.serve_env.DEFAULT_ARMS)")
    t.add_argument("--test-per-category", type=positive_int, default=4, help="held-out prompts per category")
    t.add_argument("--seed", type=seed_int, default=0)
    t.add_argument("--max-new-tokens", type=new_tokens, default=64)
    t.add_argument("--requests", type=int_at_least(1, MAX_REQUESTS), default=32,
                   help="requests per training episode")  # fmt: skip
    t.add_argument(
        "--max-batch", type=int_at_least(1, MAX_LEVEL), default=16, help="rows in the batch at most"
    )
    t.add_argument("--timesteps", type=int_at_least(0), default=600_000, help="PPO steps (0: no PPO)")
    t.add_argument("--row-timesteps", type=int_at_least(0), default=None,
                   help="steps of PPO with one arm per row, ppo-rows (default: --timesteps where the menu has "
                        "none and every drafter at every shape, else 0)")  # fmt: skip
    t.add_argument("--predictor-episodes", type=int_at_least(0, 4096), default=16,
                   help="request streams at each load of each replay the accept-length predictor learns from "
                        "(0: no predictor)")  # fmt: skip
    t.add_argument("--out", default="runs/serve-policies", help="output folder of the policy files")
    t.add_argument("--json", action="store_true")
    t.set_defaults(func=cmd_serve_train)
