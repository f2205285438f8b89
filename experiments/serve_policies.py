"""Policies under load: ``draftgym evaluate --serve`` (every serving policy's goodput per load level, on a load
ramp 1 -> 16 -> 1 ("mixed") and on bursty arrivals, on held-out prompts, in replay and live, next to every static
arm, the best static arm of each load, the best single static arm overall and the per-step oracle), and what
``draftgym serve-train`` (``experiments.serve_train``) shares with it: the split, the replayed servers.

Replay prices steps with a batch cost model (``env.batch_cost``: fitted on this machine, or ``roofline:ACC/MODEL``,
simulated and labelled so); live serves the same request streams (prompts, arrival times, concurrency caps) with
the batch-native engine (``env.serving.serve`` with the policy choosing each step's arm).

Replay charges each policy that observes what serving it live adds to a step (``ServeSim.price_policy``: the cost
model's bookkeeping, the match drafter's proposals, the policy's act timed here), as the live server pays it; a
static arm and the oracle pay nothing; ``--no-policy-cost`` replays without it. The act timings are kept in
``OUT/policy_act.json`` (by policy file and CPU), so that a rerun replays with the same figures.

``--json FILE``: ``{"rows": [{"policy", "kind", "load", "replay_goodput", "live_goodput", "live_runs",
"live_passes", "replay_goodput_live_stream", "act_s"}, ...], "policy_priced", "paired", "live_streams", "settings",
...}``
(``replay_goodput``: the median over ``--episodes`` request streams; ``live_runs``: the live runs the median was
taken of; ``live_passes``: each run's pass, ``SESSION/r``, a session being one invocation of the command
(``legacy/r`` for a run kept by an older file, which tagged none);
``replay_goodput_live_stream``: the replay of the one stream served live, for replay fidelity; ``act_s``: the
policy's act charged a step, null where nothing is; ``policy_priced``: ``{"on", "book"}``, whether replay charged
the policies, and whether the cost model had the bookkeeping to charge; ``paired``: live, each policy against the
best static arms run by run, ``serve_eval_summary.paired``; ``live_streams``: each live load's stream, its requests
and distinct prompts, and the drafters that read other requests' tokens, ``serve_live.repeated_prompts``;
``live_arm_rows``: ``{load: {policy: {arm: rows}}}``, the rows each arm served live over a cell's runs, where
every run's count is known). Live
serves the drafters with the options the trace recorded (``env.trace_record.recorded_drafter_options``).
Live runs are appended to ``OUT/live.jsonl`` as they finish, and each cell's median when its load is done (a rerun
with the same ``--out`` skips finished cells and the runs of an unfinished load).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import uuid
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from env.files import Appending, atomic_write_text, file_digest, jsonl_lines
from experiments.serve_eval_summary import (
    LEGACY,
    fidelity,
    format_table,
    goodput_of,
    kept_passes,
    kept_runs,
    paired,
)
from experiments.serve_live import _live, add_rows, arm_rows, repeated_prompts, warm_up

EVAL_LOADS = ("1", "2", "4", "8", "16", "mixed", "bursty")
TRAIN_LOADS = ("1", "2", "4", "8", "16", "ramp", "bursty")  # at max_batch 16 (``train_loads``)


def train_loads(max_batch: int) -> list[str]:
    from env.serve_env import levels_upto

    return [str(c) for c in levels_upto(max_batch)] + ["ramp", "bursty"]


def sim_load(load: str) -> str:
    return "ramp" if load == "mixed" else load


def shipped_serve_policies() -> list[Path]:
    folder = Path(str(resources.files("policies") / "data" / "serve"))
    return sorted(folder.glob("*.zip")) if folder.is_dir() else []


def _split(trace: Any, test_per_category: int, seed: int) -> Any:
    from policies.split import trace_split

    return trace_split(trace, test_per_category, seed)


def _sim_factory(trace: Any, cost: Any, arms: list[str], prompts: Any, max_new: int, requests: int,
                 max_batch: int, reward: str = "goodput_ratio"):  # fmt: skip
    from env.serve_env import ServeSim

    def make(num_envs: int, loads: Any = TRAIN_LOADS, seed: int = 0) -> Any:
        return ServeSim(num_envs, trace=trace, arms=arms, cost=cost, max_batch=max_batch, loads=list(loads),
                        requests=requests, max_new_tokens=max_new, prompt_ids=prompts, reward=reward, seed=seed)  # fmt: skip

    return make


# ---------------------------------------------------------------------------------------------------- evaluation


def _streams(make: Any, load: str, episodes: int, seed: int) -> Any:
    sim = make(episodes, loads=[sim_load(load)], seed=seed)
    sim.reset()
    return sim


def _replay(make: Any, load: str, episodes: int, seed: int, policy: Any = None, oracle: bool = False,
            act_s: float | None = None) -> tuple[float, float]:  # fmt: skip
    """(median replayed goodput over ``episodes`` request streams, that of stream 0: the one served live).
    ``act_s``: the policy's own decision a step, timed: replay charges it and the live observation's bookkeeping
    (``ServeSim.price_policy``); None: neither (a static arm, the oracle)."""
    from policies.serving import run_policy

    sim = _streams(make, load, episodes, seed)
    sim.price_policy(act_s)
    g = run_policy(sim, policy, oracle=oracle, online=True)  # a bandit learns on each stream, as it does live
    return float(np.median(g)), float(g[0])


class _Static:
    kind = "static"

    def __init__(self, k: int, name: str) -> None:
        self.k, self.name = k, name

    @property
    def static_arm(self) -> int:  # served live as an engine configured with this arm (``env.serving.serve``)
        return self.k

    def act(self, obs: Any) -> int:
        return self.k

    def act_batch(self, obs: np.ndarray) -> np.ndarray:
        return np.full(len(obs), self.k)


def _act_times(policies: list[tuple[str, Any]], make: Any, load: str, episodes: int, seed: int, out: Path | None,
               arms: list[str], cost: Any, keys: dict[str, str] | None = None) -> dict[str, float]:  # fmt: skip
    """Each observing policy's live decision a step (``policies.act_cost``), timed on observations of ``load``'s
    streams; kept in ``out/policy_act.json`` with what it timed (``keys``: each policy's file digest, else its
    type and parameters; the timing code's version, the menu, the cost model, the CPU), so that a resumed
    evaluation replays with the same figures (a timing is noise apart from run to run) and another policy, code or
    machine is timed again."""
    import hashlib

    from env.batch_cost import cost_digest
    from env.machine import cpu_label
    from policies.act_cost import CALLS, VERSION, act_seconds, sample_observations

    # what a timing depends on beside the policy: the code timed, the menu, the cost model (an online policy's
    # reward), the CPU
    setting = hashlib.sha256(
        json.dumps([VERSION, CALLS, list(arms), cost_digest(cost)]).encode()
    ).hexdigest()[:16]

    def key(name: str, pol: Any) -> str:
        what = (keys or {}).get(name) or hashlib.sha256(json.dumps(
            [type(pol).__name__, pol.params()], sort_keys=True, default=str).encode()).hexdigest()  # fmt: skip
        return f"{what} {setting} @ {cpu_label()}"

    want = {n: (p, key(n, p)) for n, p in policies if getattr(p, "static_arm", None) is None}
    path = None if out is None else out / "policy_act.json"
    kept: dict[str, dict[str, Any]] = {}
    if path is not None and path.is_file():
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
            kept = {n: e for n, e in d.items() if isinstance(e, dict) and isinstance(e.get("key"), str)
                    and type(e.get("act_s")) in (int, float) and 0 <= e["act_s"] <= 10}  # fmt: skip
        except (ValueError, RecursionError, OSError, AttributeError):
            kept = {}  # our own cache: timed again
    stale = [n for n, (_, k) in want.items() if kept.get(n, {}).get("key") != k]
    if stale:
        seen = sample_observations(_streams(make, load, episodes, seed))
        for n in stale:
            kept[n] = {"act_s": act_seconds(want[n][0], seen, arms=arms, cost=cost), "key": want[n][1]}
        if path is not None:
            atomic_write_text(path, json.dumps(kept) + "\n")
    return {n: float(kept[n]["act_s"]) for n in want}


def evaluate_serve(policies: list[tuple[str, Any]], trace: Any, cost: Any, arms: list[str], split: Any, *,
                   loads: list[str], episodes: int, max_new: int, requests: int, max_batch: int, seed: int,
                   loaded: Any = None, repeats: int = 3, live_policies: set[str] | None = None,
                   out: Path | None = None, progress: bool = False, probe: bool = True,
                   price: bool = True, policy_keys: dict[str, str] | None = None,
                   drafter_options: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:  # fmt: skip
    """Replay every policy (and every static arm, the oracle) at every load on held-out prompts; live (when
    ``loaded``) the policies named in ``live_policies`` (default: all), ``repeats`` runs each, the median kept.

    ``price``: replay charges each policy that observes what serving it live adds to a step (its act, timed here
    on replayed observations, ``policies.act_cost``; the cost model's bookkeeping; the match drafter's proposals),
    as the live server pays it; a static arm pays nothing (served as an engine configured with it), nor the oracle.
    ``drafter_options``: the drafters' options live (the trace's, as recorded).

    With ``probe`` (and a fitted cost model whose calibration timed the probe: ``meta["probe"]``), each load's
    live runs are bracketed by a speed probe (``env.batch_calibrate.speed_probe``: the same one-node steps timed
    again), so that the fidelity summary can tell the cost model's error from the machine's drift since it was
    calibrated: ``fidelity[load]`` has the median |replay / live - 1| over the live policies as measured, and
    again with replay divided by the probe's speed factor."""
    from env.batch_calibrate import probe_rows, speed_probe
    from env.engine import parse_arm

    make = _sim_factory(trace, cost, arms, list(split.test), max_new, requests, max_batch)
    statics = [(f"static:{a}", _Static(k, a)) for k, a in enumerate(arms)]
    rows: list[dict[str, Any]] = []
    done, done_runs, done_passes = {}, {}, {}  # finished cells on disk: the median, its runs, their passes
    partial: dict[tuple[str, str], list[float]] = {}  # single live runs of a load not finished when killed
    partial_passes: dict[tuple[str, str], list[str]] = {}
    partial_arms: dict[tuple[str, str], list[Any]] = {}  # each kept run's rows per arm (None: not known)
    done_arms: dict[tuple[str, str], Any] = {}
    session = uuid.uuid4().hex[:8]  # tags this invocation's passes: a resume's pass r is not the killed one's
    probes: dict[str, dict[str, Any]] = {}
    live_path = None if out is None else out / "live.jsonl"
    if live_path is not None:
        for line in jsonl_lines(live_path):
            try:
                c = json.loads(line)
                if not isinstance(c, dict):
                    continue
                if "run" in c:
                    key = (c["policy"], c["load"])
                    # an older file's runs carry no pass: its run i of a cell was served in pass i
                    tag = c.get("pass", f"{LEGACY}/{len(partial.get(key, []))}")
                    if type(tag) is not str:
                        raise ValueError("a run's pass must be a string")  # the line is skipped: served again
                    partial.setdefault(key, []).append(goodput_of(c["run"]))
                    partial_passes.setdefault(key, []).append(tag)
                    partial_arms.setdefault(key, []).append(arm_rows(c.get("arm_rows"), arms))
                    continue
                g = goodput_of(c["live_goodput"])
                kept = kept_runs(c.get("runs"), g)  # checked first: a bad cell is skipped whole
                tags = kept_passes(c.get("passes"), kept)
                key = (c["policy"], c["load"])
                done[key], done_runs[key], done_passes[key] = g, kept, tags
                done_arms[key] = arm_rows(c.get("arm_rows"), arms)
                if isinstance(c.get("probe"), dict) and isinstance(c["probe"].get("factor"), (int, float)):
                    probes[c["load"]] = c["probe"]
            except (ValueError, RecursionError, KeyError, TypeError):
                continue
    menu = [parse_arm(a) for a in arms]
    cells = [(name, pol, load) for load in loads for name, pol in [*statics, *policies]]
    it = cells
    if progress:
        from tqdm import tqdm

        it = tqdm(cells, desc="evaluate --serve", unit="cell")
    act_s = (
        _act_times(policies, make, loads[0], episodes, seed, out, arms, cost, policy_keys)
        if price and policies
        else {}
    )
    replay: dict[tuple[str, str], float] = {}
    stream0: dict[tuple[str, str], float] = {}
    for name, pol, load in it:
        replay[(name, load)], stream0[(name, load)] = _replay(make, load, episodes, seed, pol,
                                                              act_s=act_s.get(name))  # fmt: skip
    oracle = {load: _replay(make, load, episodes, seed, oracle=True)[0] for load in loads}
    # the best static arm of each load, and the best single static arm over the per-level loads
    best_at = {load: max(arms, key=lambda a: replay[(f"static:{a}", load)]) for load in loads}
    levels = [x for x in loads if x.isdigit()]
    overall = max(arms, key=lambda a: statistics.fmean(replay[(f"static:{a}", x)] for x in (levels or loads)))
    kinds = {name: getattr(pol, "kind", "static") for name, pol in [*statics, *policies]}
    want_live = {n for n, _ in policies} if live_policies is None else set(live_policies)

    live_statics = {f"static:{best_at[x]}" for x in loads} | {f"static:{overall}"}
    live_statics |= {n for n in want_live if n.startswith("static:")}  # named by --live-policies
    live_set = [
        (n, p)
        for n, p in [*statics, *policies]
        if (n in live_statics if n.startswith("static:") else n in want_live)
    ]
    live: dict[tuple[str, str], float] = {}
    live_runs: dict[tuple[str, str], list[float]] = {}  # run r of every policy: one interleaved pass
    live_passes: dict[tuple[str, str], list[str]] = {}
    live_arms: dict[tuple[str, str], dict[str, int] | None] = {}
    live_loads = loads if loaded is not None else []
    streams: dict[str, dict[str, Any]] = {}  # each live load's stream: its requests, distinct prompts
    bar = None
    if progress and live_loads:
        from tqdm import tqdm

        left = sum(1 for x in live_loads for n, _ in live_set if (n, x) not in done)
        bar = tqdm(total=left * repeats, desc="evaluate --serve, live", unit="run")
    if any((n, x) not in done for x in live_loads for n, _ in live_set):
        warm_up(loaded, _streams(make, live_loads[0], 1, seed), menu, max_batch, cost,
                drafter_options=drafter_options)  # fmt: skip
    for load in live_loads:
        todo = [(n, p) for n, p in live_set if (n, load) not in done]
        runs: dict[str, list[float]] = {n: partial.get((n, load), [])[:repeats] for n, _ in todo}
        passes = {n: partial_passes.get((n, load), [])[:repeats] for n, _ in todo}
        counts = {n: partial_arms.get((n, load), [])[:repeats] for n, _ in todo}
        if bar is not None:
            bar.update(sum(len(r) for r in runs.values()))
        streams[load] = repeated_prompts(_streams(make, load, 1, seed), menu, drafter_options)
        pr = probe_rows(cost, load) if probe and todo else []
        before = speed_probe(loaded, cost, pr) if pr else None
        for r in range(repeats):  # interleaved: a drift of the machine's speed hits every policy alike
            for name, pol in todo:
                if len(runs[name]) > r:  # measured before a kill
                    continue
                from env.serving import ServeLog

                log = ServeLog()
                runs[name].append(_live(loaded, _streams(make, load, 1, seed), pol, menu, max_batch, max_new,
                                        cost, drafter_options, log))  # fmt: skip
                passes[name].append(f"{session}/{r}")
                counts[name].append(dict(log.arm_rows))
                if live_path is not None:  # each run as it finishes: a kill loses at most the one running
                    with Appending(live_path) as fh:
                        fh.write(json.dumps({"policy": name, "load": load, "run": runs[name][-1],
                                             "pass": passes[name][-1], "arm_rows": counts[name][-1]}) + "\n")  # fmt: skip
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix_str(f"{name} @ {load}: {runs[name][-1]:.1f} tok/s")
        after = speed_probe(loaded, cost, pr) if before is not None else None
        if before is not None and after is not None:
            probes[load] = {"rows": pr, "before": before, "after": after,
                            "factor": float(np.sqrt(before["factor"] * after["factor"]))}  # fmt: skip
        for name, _ in live_set:
            key = (name, load)
            if key in done:
                live[key], live_runs[key], live_passes[key] = done[key], done_runs[key], done_passes[key]
                live_arms[key] = done_arms[key]
                continue
            live[key] = float(statistics.median(runs[name]))
            live_runs[key], live_passes[key] = runs[name], passes[name]
            live_arms[key] = functools.reduce(add_rows, counts[name], {})
            if live_path is not None:
                with Appending(live_path) as fh:
                    fh.write(json.dumps({"policy": name, "load": load, "live_goodput": live[key], "runs": runs[name],
                                         "passes": passes[name], "probe": probes.get(load),
                                         "arm_rows": live_arms[key]}) + "\n")  # fmt: skip
    if bar is not None:
        bar.close()
    for load in loads:
        for name, _ in [*statics, *policies]:
            rows.append({"policy": name, "kind": kinds[name], "load": load, "replay_goodput": replay[(name, load)],
                         "live_goodput": live.get((name, load)), "live_runs": live_runs.get((name, load)),
                         "live_passes": live_passes.get((name, load)),
                         "replay_goodput_live_stream": stream0[(name, load)], "act_s": act_s.get(name)})  # fmt: skip
        rows.append({"policy": "oracle", "kind": "oracle", "load": load, "replay_goodput": oracle[load],
                     "live_goodput": None, "live_runs": None, "live_passes": None, "replay_goodput_live_stream": None,
                     "act_s": None})  # fmt: skip
    return {"rows": rows, "best_static_per_load": best_at, "best_static_overall": overall,
            "fidelity": fidelity(rows, probes), "paired": paired(rows, best_at, overall), "live_streams": streams,
            "live_arm_rows": {x: {n: c for (n, y), c in live_arms.items() if y == x and c is not None}
                              for x in live_loads},  # fmt: skip
            "policy_priced": {"on": price, "book": getattr(cost, "policy_book", None) is not None}}  # fmt: skip


def same_cost(meta: dict[str, Any], cost: Any) -> bool:
    """Whether a serving policy's file says it was built under ``cost``: the same label (the machine or the
    roofline model) and, where the file records one (since this check), the same model (``cost_digest``). A file
    that names no cost model is taken as built under it."""
    from env.batch_cost import cost_digest

    label, digest = meta.get("batch_cost"), meta.get("batch_cost_sha256")
    return (label is None or label == cost.label) and (digest is None or digest == cost_digest(cost))


def cmd_evaluate_serve(args: argparse.Namespace) -> int:
    from env.batch_cost import load_batch_cost
    from env.serve_env import DEFAULT_ARMS, default_serve_trace
    from env.trace import load_trace
    from env.trace_record import recorded_drafter_options
    from experiments.args import output_dir, output_file
    from experiments.errors import UserError
    from policies.base import load_policy

    paths = [Path(p) for p in args.policies] or shipped_serve_policies()
    policies = []
    from experiments.policy_commands import check_meta, serving_max_batch

    stems = [p.stem for p in paths]  # each policy is a row named by its file's stem
    twice = sorted({s for s in stems if stems.count(s) > 1 or s == "oracle" or s.startswith("static:")})
    if twice:  # two of one name would share their replay and live results
        raise UserError(f"two policies (or a policy and a baseline row) would be named {twice[0]!r}; "
                        "rename one of the files")  # fmt: skip
    for p in paths:
        policies.append((p.stem, check_meta(load_policy(p), p)))
    meta = policies[0][1].meta if policies else {}
    arms = list(policies[0][1].arm_names) if policies else list(DEFAULT_ARMS)
    for name, pol in policies:
        if list(pol.arm_names) != arms:
            raise UserError(
                f"{name}: its arms {list(pol.arm_names)} differ from {arms}; evaluate one menu at a time"
            )
        if pol.meta.get("max_batch", 16) != meta.get("max_batch", 16):
            raise UserError(f"{name}: trained for a max batch of {pol.meta.get('max_batch', 16)}, "
                            f"{policies[0][0]} for {meta.get('max_batch', 16)}; evaluate one max batch at a time")  # fmt: skip
    for p, (_, pol) in zip(paths, policies):
        serving_max_batch(pol, p)  # a per-sequence policy (draftgym train): no observation of a batch
    trace = default_serve_trace() if args.trace is None else load_trace(args.trace)
    # live serves the drafters as the trace recorded them (checked: the header comes from a file)
    options = recorded_drafter_options(trace, args.trace or "the bundled trace")
    cost = load_batch_cost(args.batch_cost)
    tpc = args.test_per_category or meta.get("split", {}).get("test_per_category", 4)
    split = _split(
        trace, int(tpc), args.seed if args.test_per_category else meta.get("split", {}).get("seed", args.seed)
    )
    # a policy trained on prompts of this evaluation (another --test-per-category or --seed than its training's)
    overlap = {name: n for name, pol in policies if pol.meta.get("fitted_on_prompts") is not False
               and (n := len(set((pol.meta.get("split") or {}).get("train") or []) & set(split.test)))}  # fmt: skip
    # a policy fitted, trained or (SmartSpec) deciding under another cost curve than the one it is evaluated under
    other_cost = {
        name: str(pol.meta["batch_cost"]) for name, pol in policies if not same_cost(pol.meta, cost)
    }
    # a policy trained on a trace whose drafters had other options than this one's, which live serves (``{}``:
    # the defaults; a policy from before serve-train kept them does not say: not flagged)
    other_options = {name: opts for name, pol in policies
                     if (opts := pol.meta.get("drafter_options")) is not None and opts != options}  # fmt: skip
    from env.serve_loads import parse_load

    max_new = args.max_new_tokens or int(meta.get("max_new_tokens", 64))
    max_batch = int(meta.get("max_batch", 16))
    loads = list(dict.fromkeys(x.strip() for x in args.loads.split(",") if x.strip()))  # once each, in order
    if not loads:
        raise UserError(f"--loads names no load (got {args.loads!r}); e.g. --loads 1,4,16,mixed")
    seen: dict[tuple[bool, float], str] = {}
    for x in loads:  # checked here, before a folder is made (a concurrency above the trace's rows too)
        if x not in ("mixed", "bursty") and not x.isdigit() and not x.startswith("poisson@"):
            raise UserError(f"--loads: unknown load {x!r}; valid: concurrencies, mixed, bursty, poisson@X")
        if x not in ("mixed", "bursty"):
            load = parse_load(x, max_batch)
            key = (load.closed, load.level)
            if key in seen:  # "4" and "04", "poisson@1" and "poisson@1.0": one load evaluated twice
                raise UserError(f"--loads names one load twice ({seen[key]!r} and {x!r})")
            seen[key] = x
    live_names = (
        None if not args.live_policies else {x.strip() for x in args.live_policies.split(",") if x.strip()}
    )
    # a static arm of the menu may be named too: served live beside the best static arms (which always are)
    statics = [f"static:{a}" for a in arms]
    unknown = sorted((live_names or set()) - {name for name, _ in policies} - set(statics))
    if unknown:
        raise UserError(f"--live-policies names {', '.join(unknown)}, not among the policies evaluated: "
                        f"{', '.join([*(name for name, _ in policies), *statics])}")  # fmt: skip
    check_streams(args.episodes, args.requests, "--episodes x --requests")
    if args.json:
        output_file(args.json, flag="--json", inputs=(*args.policies, args.trace, args.batch_cost))
    out = output_dir(args.out or "runs/evaluate-serve", exclusive=True)
    from env.files import other_command

    # (replay alone writes there too: evaluate.json, policy_act.json)
    why = other_command(out, None, "evaluate --serve")
    if why:
        raise UserError(why)
    loaded = None
    if not args.no_live:
        from env.model import load_model

        loaded = load_model(
            args.model, dtype=args.dtype, device=args.device, weights=args.weights, forward=args.forward
        )
    if loaded is not None:  # live cells on disk must come from the same settings (a resume), else refused
        from experiments.args import same_settings
        from experiments.records import (
            cost_identity,
            head_identity,
            machine_identity,
            method_drafters,
            run_identity,
            trace_heads_note,
        )

        same_settings(out, {
            **run_identity(loaded, max_new), **machine_identity(loaded.device), "trace": "bundled" if args.trace is None else file_digest(args.trace),
            "batch_cost": cost_identity(args.batch_cost), "test_prompts": list(split.test),
            "requests": args.requests, "max_batch": max_batch, "seed": args.seed, "repeats": args.repeats,
            "probe": not args.no_probe, "policies": {name: file_digest(p) for (name, _), p in zip(policies, paths)},
            **({"drafter_options": options} if options else {}),  # (runs before it served the drafters' defaults)
            **head_identity(method_drafters(arms), options, loaded.model_id),  # the heads its arms load
        }, started=bool(jsonl_lines(out / "live.jsonl")), command="evaluate --serve")  # fmt: skip
        if note := trace_heads_note(trace.header, options, loaded.model_id):
            print(note, file=sys.stderr)
    res = evaluate_serve(policies, trace, cost, arms, split, loads=loads, episodes=args.episodes, max_new=max_new,
                         requests=args.requests, max_batch=max_batch, seed=args.seed, loaded=loaded,
                         repeats=args.repeats, live_policies=live_names, out=out,
                         progress=sys.stderr.isatty(), probe=not args.no_probe,
                         price=not args.no_policy_cost,
                         policy_keys={name: file_digest(p) for (name, _), p in zip(policies, paths)},
                         drafter_options=options)  # fmt: skip
    from env.machine import machine_info
    from experiments.provenance import provenance

    res["settings"] = {"batch_cost": cost.label, "simulated": bool(cost.simulated), "loads": loads,
                       "episodes": args.episodes, "requests": args.requests, "max_new_tokens": max_new,
                       "max_batch": max_batch, "test_prompts": list(split.test), "arms": arms,
                       "live": loaded is not None, "repeats": args.repeats, "probe": not args.no_probe,
                       "machine": machine_info(),
                       "command": " ".join(["draftgym", *sys.argv[1:]])}  # fmt: skip
    res["trained_on_evaluated"] = overlap
    res["built_under_other_cost"] = other_cost
    res["trained_with_other_drafter_options"] = (
        {"trace": options, "policies": other_options} if other_options else {}
    )
    # a cost model that timed the drafters with other options than the trace's (calibrate --drafter-option; a file
    # from before it does not say), compared over the drafters it prices
    timed = (getattr(cost, "meta", None) or {}).get("drafter_options")
    priced = {*(getattr(cost, "drafters", None) or {}), *(getattr(cost, "batched", None) or {})}
    traced = {d: o for d, o in options.items() if d in priced}
    timed = None if timed is None else {d: o for d, o in timed.items() if d in priced}
    res["cost_timed_other_drafter_options"] = (
        {"cost": timed, "trace": traced} if timed is not None and timed != traced else {}
    )
    res["provenance"] = provenance()
    text = json.dumps(res, indent=1)
    atomic_write_text(out / "evaluate.json", text)
    if args.json:
        atomic_write_text(args.json, text)
    print(format_table(res))
    return 0


MAX_REQUESTS = 65_536  # per episode (serve-train, evaluate --serve): a stream of requests, not an allocation


def check_streams(servers: int, requests: int, flags: str) -> None:
    """``UserError`` before any folder is made when ``servers`` replayed servers of ``requests`` requests each
    exceed what the simulator draws at once (``env.serve_sim.MAX_SIM_REQUESTS``); ``flags`` names the options."""
    from env.serve_sim import MAX_SIM_REQUESTS
    from experiments.errors import UserError

    if servers * requests > MAX_SIM_REQUESTS:
        raise UserError(
            f"{flags}: {servers} servers x {requests} requests each; at most {MAX_SIM_REQUESTS} in all"
        )


def add_serve_args(e: Any) -> None:
    from experiments.args import int_at_least, positive_int

    e.add_argument("--serve", action="store_true", help="evaluate serving policies under load (SpecServe-v0)")
    e.add_argument("--batch-cost", default=None,
                   help="--serve: batch cost model JSON, or roofline:ACC/MODEL (simulated); default the shipped")  # fmt: skip
    e.add_argument("--loads", default=",".join(EVAL_LOADS), help="--serve: load levels, mixed (ramp), bursty")
    e.add_argument(
        "--episodes", type=int_at_least(1, 65_536), default=16, help="--serve: replayed servers per load"
    )
    e.add_argument("--requests", type=int_at_least(1, MAX_REQUESTS), default=32,
                   help="--serve: requests per episode (mixed: 46)")  # fmt: skip
    e.add_argument("--repeats", type=positive_int, default=3, help="--serve: live runs per cell (median)")
    e.add_argument(
        "--live-policies",
        default=None,
        help="--serve: live only these policies (comma list; static:ARM names a static arm of the "
        "menu, live beside the best static arms, which always are)",
    )
    e.add_argument("--no-policy-cost", action="store_true",
                   help="--serve: replay does not charge a policy its live overhead (its act, the observation)")  # fmt: skip
    e.add_argument("--no-probe", action="store_true",
                   help="--serve: no speed probe around each load's live runs (the machine's drift since calibration)")  # fmt: skip
