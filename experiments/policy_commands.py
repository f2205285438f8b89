"""``draftgym evaluate`` (every policy side by side, replay and live, on prompts held out from training, next to
the best static arm and the oracles; ``--serve``: the serving policies under load), and the helpers behind
``--policy PATH`` of ``generate`` and ``bench`` and behind ``draftgym train`` (``experiments.policy_train``).
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from env.cli import seed_int
from env.files import atomic_write_text
from experiments.args import output_dir, output_file

# ---------------------------------------------------------------------------------------------- shared helpers


def shipped_policy_paths() -> list[Path]:
    """The small policies shipped with the package (trained on the bundled trace)."""
    folder = Path(str(resources.files("policies") / "data"))
    return sorted(folder.glob("*.zip")) if folder.is_dir() else []


def _user_error(msg: str) -> Exception:
    from experiments.errors import UserError

    return UserError(msg)


def policy_decoder(loaded: Any, policy: Any, drafter_options: dict[str, dict[str, Any]] | None = None) -> Any:
    """A ``SpeculativeDecoder`` driven by ``policy`` (a loaded policy or a path), checked against the decoder's
    arm menu and observation (feature spec from the policy's training trace). Its ``position`` feature is a
    fraction of the ``max_new_tokens`` the policy was trained at (``meta.max_new_tokens``, which ``draftgym train``
    records), whatever a run's own; a policy file without it (older files, the shipped policies, all trained at
    the bundled trace's 128) sees each run's ``max_new_tokens`` instead, as before."""
    from env.decoder import SpeculativeDecoder
    from env.engine import parse_arm
    from env.features import FeatureSpec
    from policies import check_compatible, load_policy

    if not hasattr(policy, "act"):
        policy = load_policy(policy)
    spec = FeatureSpec.from_dict(policy.meta.get("feature_spec"))
    horizon = check_meta(policy, policy.source or policy.name).meta.get(
        "max_new_tokens"
    )  # None or an int >= 1
    arms = [parse_arm(a) for a in policy.arm_names]
    cost = (
        None  # an online policy learns live from the rewards of the cost model it was trained with, when here
    )
    trained = policy.meta.get("cost_model")
    if isinstance(trained, str) and Path(trained).is_file():
        from env.cost import load_cost_model

        cost = load_cost_model(trained)
    dec = SpeculativeDecoder(
        loaded,
        arms,
        policy=policy,
        drafter_options=drafter_options,
        features=spec,
        cost_model=cost,
        position_horizon=horizon,
    )
    names = dec.feature_names
    check_compatible(policy, arms=[a.name for a in arms], obs_size=len(names), features=names,
                     source=f"policy {policy.source or policy.name}")  # fmt: skip
    return dec


def policy_label(policy: Any, path: str | Path | None = None) -> str:
    return Path(path).stem if path else policy.name


def replay_env(trace: Any, arms: Any, cost_model: Any = None, features: Any = None) -> Any:
    from env.spec_env import SpecDecodeEnv

    return SpecDecodeEnv(
        backend="replay", trace=trace, arms=list(arms), cost_model=cost_model, features=features
    )


# ---------------------------------------------------------------------------------------------- evaluate


def check_meta(policy: Any, path: Any) -> Any:
    """The training record a policy file carries (``meta``: its trace, cost model, prompt split, sizes), checked
    for the types the evaluation reads, so that a hand-edited or foreign file fails in one line here and not as a
    traceback later. Returns ``policy``."""
    from policies.base import PolicyError

    meta = policy.meta if isinstance(policy.meta, dict) else None

    def bad(field: str, want: str) -> PolicyError:
        return PolicyError(f"policy {path}: meta.{field} is not {want}")

    if meta is None:
        raise PolicyError(f"policy {path}: its meta is not an object")
    for key in ("trace", "cost_model", "name"):
        if meta.get(key) is not None and not isinstance(meta[key], str):
            raise bad(key, "a string")
    for key in ("max_new_tokens", "max_batch"):
        v = meta.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise bad(key, "a positive integer")
    split = meta.get("split")
    if split is not None:
        if not isinstance(split, dict):
            raise bad("split", "an object")
        for key in ("train", "test"):  # both present: a split names what it held out and what it trained on
            v = split.get(key)
            if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                raise bad(f"split.{key}", "a list of prompt ids")
        for key in ("seed", "test_per_category"):
            v = split.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise bad(f"split.{key}", "a non-negative integer")
    options = meta.get("drafter_options")  # the trace's drafter options it was trained on (serve-train)
    if options is not None:
        from drafters.base import shown
        from env.trace_record import drafter_options_problem

        if not isinstance(options, dict):
            raise bad("drafter_options", "an object")
        for name, opts in options.items():
            why = drafter_options_problem(name, opts)
            if why:
                raise PolicyError(f"policy {path}: meta.drafter_options.{shown(name, 40)}: {why}")
    return policy


def serving_max_batch(policy: Any, path: Any) -> int:
    """The max batch a serving policy (``draftgym serve-train``) was trained for, its observation's size checked
    against it: a per-sequence policy (``draftgym train``) is refused in one line, not served a batch it reads
    nothing of."""
    from drafters.base import shown
    from env.serve_env import obs_size
    from env.serve_sim import MAX_BATCH
    from policies.base import PolicyError

    m = policy.meta.get("max_batch", 16)
    if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= MAX_BATCH:
        raise PolicyError(
            f"{path}: its meta.max_batch must be an integer in [1, {MAX_BATCH}], got {shown(m, 40)}"
        )
    if policy.obs_size != obs_size(m):
        raise PolicyError(f"{path} is not a serving policy (draftgym serve-train makes them): it observes "
                          f"{policy.obs_size} values, where a serving policy for a max batch of {m} observes "
                          f"{obs_size(m)}")  # fmt: skip
    return m


def _test_split(
    policies: list[Any], trace: Any, test_per_category: int | None, seed: int
) -> tuple[list[str], str]:
    """The held-out prompts: the first policy's recorded test split (when it was trained on this trace), or a
    fresh split."""
    from policies.split import trace_split

    if test_per_category is None:
        for p in policies:
            split = p.meta.get("split")
            if split and set(split["test"]) <= set(trace.prompt_ids):
                return list(split["test"]), f"held out when {p.meta.get('name', p.name)} was trained"
        test_per_category = 5
    split = trace_split(trace, test_per_category, seed)
    return list(split.test), f"split seed {seed}, {test_per_category} per category"


def evaluate(
    policy_paths: list[Path],
    *,
    trace_path: str | None = None,
    cost_model: str | None = None,
    test_per_category: int | None = None,
    seed: int = 0,
    live: bool = True,
    loaded: Any = None,
    load: Any = None,
    workload: str | None = None,
    max_new_tokens: int | None = None,
    live_limit: int | None = None,
    out_dir: Path | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """The rows of the comparison table (see ``cmd_evaluate``)."""
    from env.arms import make_arms
    from env.cost import load_cost_model
    from env.features import FeatureSpec
    from env.trace import load_trace
    from policies import load_policy
    from policies.oracle import best_static, oracle_scores, score_policy, score_static, static_table

    policies = [check_meta(load_policy(p), p) for p in policy_paths]
    if not policies:
        raise _user_error("no policy to evaluate (none given, and none shipped in policies/data)")
    labels = [policy_label(p, path) for p, path in zip(policies, policy_paths)]
    if len(set(labels)) != len(labels):
        raise _user_error(
            f"two policy files share a name ({labels}); the table names them by file: rename one"
        )
    trace_file = trace_path or policies[0].meta.get("trace")
    trace = load_trace(trace_file)
    cm = load_cost_model(cost_model or policies[0].meta.get("cost_model"))
    test, split_note = _test_split(policies, trace, test_per_category, seed)
    if not test:
        raise _user_error(
            f"the trace {trace_file} leaves no held-out prompt ({split_note}); record more prompts per category "
            "or pass --test-per-category"
        )
    train = [p for p in trace.prompt_ids if p not in set(test)]
    menu_names = [a.name for a in make_arms(list(dict.fromkeys(a for p in policies for a in p.arm_names)))]
    env = replay_env(trace, menu_names, cm)
    statics_train = static_table(env, train)
    best = best_static(statics_train)
    best_name = menu_names[best]
    rows: list[dict[str, Any]] = []
    static_test = score_static(env, best, test)
    rows.append({"policy": f"static:{best_name}", "kind": "static", "replay_speedup": static_test.speedup,
                 "live_speedup": None, "note": "best single arm on the training prompts"})  # fmt: skip
    envs: dict[Any, Any] = {}
    for policy, path in zip(policies, policy_paths):
        seen = set((policy.meta.get("split") or {}).get("train", [])) & set(test)
        spec = FeatureSpec.from_dict(policy.meta.get("feature_spec") or trace.spec.as_dict())
        key = (policy.arm_names, spec)
        if key not in envs:
            envs[key] = replay_env(trace, policy.arm_names, cm, spec)
        e = envs[key]
        score = score_policy(policy, e, test, learn=True)
        rows.append({
            "policy": policy_label(policy, path), "kind": policy.kind, "replay_speedup": score.speedup,
            "live_speedup": None, "path": str(path), "tau": score.tau,
            "note": f"trained on {len(seen)} test prompts!" if seen else "", "leaked": len(seen),
        })  # fmt: skip
    for o in oracle_scores(env, test):
        rows.append({"policy": o.name, "kind": "oracle", "replay_speedup": o.speedup, "live_speedup": None})
    settings = {
        "trace": trace_file or "bundled",
        "test_prompts": test,
        "train_prompts": len(train),
        "split": split_note,
        "menu": menu_names,
        "best_static": best_name,
        "replay_baseline": "our autoregressive loop, cost model",
    }
    if live:
        live_rows = _live(policy_paths, policies, best_name, trace, test, loaded=load if loaded is None else loaded, workload=workload,
                          max_new_tokens=max_new_tokens or trace.max_new_tokens, limit=live_limit,
                          out_dir=out_dir, progress=progress)  # fmt: skip
        for r in rows:
            r["live_speedup"] = live_rows["speedups"].get(r["policy"])
        settings["live"] = live_rows["settings"]
    return {"rows": rows, "settings": settings, "summary": acceptance_summary(rows)}


def _live(policy_paths, policies, best_name, trace, test, *, loaded, workload, max_new_tokens, limit, out_dir,
          progress) -> dict[str, Any]:  # fmt: skip
    """Decode the held-out prompts with HF greedy, the best static arm and every policy, interleaved per prompt
    (``experiments.bench.run_bench``); speedups are ratios of aggregate tokens/s over HF greedy."""
    import datetime as dt

    from env.model import load_model
    from env.trace import model_fingerprint
    from env.workloads import load_workload
    from experiments.bench import resume_note, run_bench
    from policies import load_policy

    if loaded is None:
        loaded = load_model(None, dtype=trace.header["model"]["dtype"], device="cpu")
    elif callable(loaded):  # the command's own model, loaded once the policies, trace and split were checked
        loaded = loaded()
    trace.check_model(model_fingerprint(loaded))
    source = workload or trace.header.get("workload") or "builtin"
    by_id = {p.prompt_id: p for p in load_workload(source)}
    missing = [t for t in test if t not in by_id]
    if missing:
        raise _user_error(
            f"held-out prompts {missing[:3]} are not in workload {source}; pass --workload FILE"
        )
    prompts = [by_id[t] for t in test][: limit or None]
    from env.trace_record import recorded_drafter_options

    options = recorded_drafter_options(
        trace, "the trace"
    )  # live decodes with the drafters the trace recorded
    from experiments.records import trace_heads_note

    if note := trace_heads_note(trace.header, options, loaded.model_id):
        print(note, file=sys.stderr)
    decoders = {}
    for policy, path in zip(policies, policy_paths):
        fresh = load_policy(path)  # live starts from the file, not from what replay taught an online policy
        decoders[f"policy:{policy_label(policy, path)}"] = policy_decoder(loaded, fresh, options)
    methods = ["hf_greedy", best_name, *decoders]
    out = out_dir or Path(f"runs/evaluate-{dt.datetime.now():%Y%m%d-%H%M%S}")
    settings = {"workload": str(source), "prompts": len(prompts), "max_new_tokens": max_new_tokens,
                "model": loaded.model_id, "dtype": str(loaded.dtype).removeprefix("torch."), "out": str(out),
                "baseline": "Hugging Face generate, greedy"}  # fmt: skip
    from env.files import file_digest
    from experiments.records import workload_digest, workload_identity

    identity = {"workload": workload_identity(source), "workload_sha256": workload_digest(source),
                "policies": {m: file_digest(p) for m, p in zip(decoders, policy_paths)}}  # fmt: skip
    result = run_bench(loaded, prompts, methods, max_new_tokens=max_new_tokens, out_dir=out, settings=settings,
                       progress=progress, decoders=decoders, identity=identity, drafter_options=options,
                       start_note=resume_note("evaluate", out), command="evaluate")  # fmt: skip
    overall = {r["method"]: r["speedup_vs_hf"] for r in result["summary"] if r["category"] == "overall"}
    speedups = {f"static:{best_name}": overall.get(best_name)}
    for m in decoders:
        speedups[m.removeprefix("policy:")] = overall.get(m)
    return {"speedups": speedups, "settings": settings}


def acceptance_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The best learned policy against the best static arm and the oracles (replay and live); a policy trained on
    some of the evaluated prompts (``leaked``) is left out: its row is in the table, flagged, not in the summary."""
    static = next(r for r in rows if r["kind"] == "static")
    learned = [
        r for r in rows if r["kind"] in ("bandit", "rl", "predictor", "heuristic") and not r.get("leaked")
    ]
    out: dict[str, Any] = {}
    if not learned:
        return out
    for key in ("replay_speedup", "live_speedup"):
        cands = [r for r in learned if r.get(key) is not None]
        if not cands or static.get(key) is None:
            continue
        b = max(cands, key=lambda r: r[key])
        out[key.removesuffix("_speedup")] = {"best": b["policy"], "ratio_to_static": b[key] / static[key]}
    best_replay = max(learned, key=lambda r: r["replay_speedup"])
    for r in rows:
        if r["kind"] == "oracle" and r["policy"].startswith(("oracle:per-step", "oracle:optimal")):
            gain = r["replay_speedup"] - static["replay_speedup"]
            got = best_replay["replay_speedup"] - static["replay_speedup"]
            out[f"recovered_{r['policy'].split(':')[1]}"] = got / gain if gain > 0 else None
    return out


def format_rows(rows: list[dict[str, Any]]) -> str:
    def f(x: Any) -> str:
        return "-" if x is None else f"{x:.3f}"

    head = f"{'policy':<34}{'kind':<11}{'replay x AR':>12}{'live x HF':>11}  note"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['policy']:<34}{r['kind']:<11}{f(r['replay_speedup']):>12}{f(r['live_speedup']):>11}  {r.get('note', '')}"
        )
    return "\n".join(lines)


def _named_inputs(paths: list[Path]) -> list[str]:
    """The trace and cost model files the policy files at ``paths`` name (their training's), which evaluate reads
    where no --trace or --cost-model is given."""
    from policies.base import PolicyError, read_policy

    named = []
    for p in paths:
        try:
            meta = read_policy(p)[0].meta
        except PolicyError:
            continue  # not readable: evaluate says so when it loads the policies
        named += [v for v in (meta.get("trace"), meta.get("cost_model")) if isinstance(v, str) and v]
    return named


# options one mode of evaluate reads and the other does not (given there, they were ignored without a word)
SERVE_ONLY = (
    "batch_cost",
    "loads",
    "episodes",
    "requests",
    "repeats",
    "live_policies",
    "no_policy_cost",
    "no_probe",
)
SEQUENCE_ONLY = ("cost_model", "workload", "limit")


def cmd_evaluate(args: argparse.Namespace) -> int:
    from env.model import load_model

    defaults = getattr(args, "mode_defaults", {})
    given = [
        d
        for d in (SEQUENCE_ONLY if args.serve else SERVE_ONLY)
        if d in defaults and getattr(args, d) != defaults[d]
    ]
    if given:
        flag = "--" + given[0].replace("_", "-")
        why = " (its batch cost model is --batch-cost)" if flag == "--cost-model" else ""
        raise _user_error(f"{flag} is not read by evaluate --serve{why}"
                          if args.serve else f"{flag} is read by evaluate --serve only")  # fmt: skip

    if args.serve:
        from experiments.serve_policies import cmd_evaluate_serve

        return cmd_evaluate_serve(args)
    paths = [Path(p) for p in args.policies] or shipped_policy_paths()
    if args.limit is not None and args.limit < 1:
        raise _user_error(f"--limit must be >= 1, got {args.limit}")
    if args.json:  # (nor the trace and cost model a policy file names: its defaults)
        output_file(args.json, flag="--json", inputs=(*args.policies, args.trace, args.cost_model, args.workload,
                                                      *_named_inputs(paths)))  # fmt: skip
    if args.out:
        output_dir(args.out, exclusive=True)

    def load() -> Any:
        return load_model(
            args.model, dtype=args.dtype, device=args.device, weights=args.weights, forward=args.forward
        )

    result = evaluate(
        paths, trace_path=args.trace, cost_model=args.cost_model, test_per_category=args.test_per_category,
        seed=args.seed, live=not args.no_live, load=load, workload=args.workload,
        max_new_tokens=args.max_new_tokens, live_limit=args.limit, out_dir=Path(args.out) if args.out else None,
        progress=sys.stderr.isatty(),
    )  # fmt: skip
    from experiments.provenance import provenance

    result["provenance"] = provenance()
    if args.json:
        atomic_write_text(args.json, json.dumps(result, indent=2))
    s = result["settings"]
    print(format_rows(result["rows"]))
    print(
        f"\nreplay: {len(s['test_prompts'])} held-out prompts ({s['split']}), speedup over our AR loop (cost model);"
        f" live: speedup over HF greedy, same run, same prompts"
        + ("" if "live" in s else " (not run: --no-live)")
    )
    for key, val in result["summary"].items():
        if isinstance(val, dict):
            print(f"{key}: best learned {val['best']} = {val['ratio_to_static']:.3f} x best static")
        elif val is not None:
            print(f"{key}: {100 * val:.0f}% of the oracle's gain over the best static arm")
    return 0


# ---------------------------------------------------------------------------------------------- registration


def register(sub: Any) -> None:
    from experiments.args import model_args as _model_args
    from experiments.args import new_tokens, path_arg, positive_int

    e = sub.add_parser("evaluate", help="policies vs the best static arm and the oracles, replay and live")
    e.add_argument(
        "policies",
        nargs="*",
        type=path_arg,
        help="saved policy files (default: the policies shipped with draftgym)",
    )
    e.add_argument(
        "--trace", default=None, help="replay trace (default: the one the first policy was trained on)"
    )
    e.add_argument(
        "--cost-model", default=None, help="cost model JSON (default: the policy's, else the shipped)"
    )
    e.add_argument(
        "--workload", default=None, help="prompt texts for live runs (default: the trace's workload)"
    )
    e.add_argument(
        "--test-per-category",
        type=positive_int,
        default=None,
        help="held-out prompts per category (default: the split recorded in the first policy)",
    )
    e.add_argument("--seed", type=seed_int, default=0, help="split seed when a fresh split is made")
    e.add_argument(
        "--no-live", action="store_true", help="replay only (no model, seconds instead of minutes)"
    )
    e.add_argument("--limit", type=positive_int, default=None, help="live: first N held-out prompts only")
    e.add_argument("--max-new-tokens", type=new_tokens, default=None, help="live: default the trace's")
    e.add_argument("--out", default=None, help="live run directory (re-use it to resume)")
    e.add_argument("--json", default=None, metavar="FILE", help="write the rows as JSON to FILE")
    _model_args(e)
    from experiments.serve_policies import add_serve_args

    add_serve_args(e)
    e.set_defaults(mode_defaults={d: e.get_default(d) for d in (*SERVE_ONLY, *SEQUENCE_ONLY)})
    e.set_defaults(func=cmd_evaluate)
