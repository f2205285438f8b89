"""``draftgym train CONFIG``: train the ``[policies.NAME]`` of a config on the replay env.

Reads top to bottom: config -> trace and train/test split by prompt -> one trainer per policy kind -> saved file
whose header ``meta`` records the trace, the split, the feature spec, the cost model and the env's
``max_new_tokens`` (the horizon of the ``position`` feature, which the policy's decoder keeps whatever a run's
length: ``experiments.policy_commands.policy_decoder``), so that ``draftgym evaluate``
(``experiments.policy_commands``) scores it on exactly the prompts it never saw.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from experiments.args import output_dir, output_file, path_arg
from experiments.policy_commands import _user_error, replay_env

TRAINABLE = ("static", "hf_schedule", "confidence", "ucb1", "thompson", "exp3", "linucb", "predictor", "sb3")


def sb3_inputs(t: Any) -> dict[str, Any]:
    """What an SB3 training's folder records of its inputs (with its parameters and prompts): the trace's and
    cost model's sha256, and whether the observation holds draft features."""
    from env.files import file_digest

    cost = t.cost_model
    return {"trace": file_digest(t.trace) if t.trace else "bundled",
            "cost_model": file_digest(cost) if cost and Path(cost).is_file() else cost or "default",
            "draft_features": t.draft_features}  # fmt: skip


def sb3_inputs_changed(name: str, pcfg: Any, run_dir: Path) -> str | None:
    """The one line when ``[policies.NAME]``'s SB3 training folder holds a started run on other inputs (a trace
    recorded again under the same name): checked before any policy trains, so that a refused ``train`` leaves the
    folder's other policies as they were (they were retrained on the new trace first, and then this one refused)."""
    from policies.rl_train import checkpoint_files, eval_rows

    out = run_dir / "train" / name
    try:
        before = json.loads((out / "settings.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None  # none, or damaged: the training's own check says so
    started = bool(checkpoint_files(out / "checkpoints")) or bool(eval_rows(out / "eval.jsonl"))
    if not started or not isinstance(before, dict):
        return None
    now = sb3_inputs(pcfg.train)
    for key, value in now.items():
        if key in before and before[key] != value:
            return (f"{out} holds results run with other settings ({key}: {before[key]!r} there, {value!r} now): "
                    "use another output folder, or the same settings to resume")  # fmt: skip
    return None


def train_policy(
    name: str, pcfg: Any, *, seed: int, run_dir: Path, progress: bool = False
) -> tuple[Any, Path, dict[str, Any]]:
    """Train ``[policies.NAME]`` (``pcfg``: ``experiments.config.PolicyConfig``) on the replay env of its trace's
    training prompts; returns (policy, saved path, summary)."""
    from env.cost import load_cost_model
    from env.trace import load_trace
    from experiments.config import keywords_of, policy_class
    from policies.oracle import best_static, score_batch, score_policy, static_table
    from policies.split import split_prompts, subset_trace

    t = pcfg.train
    if pcfg.kind not in TRAINABLE:
        raise _user_error(
            f"policies.{name}.kind {pcfg.kind!r} cannot be trained; trainable: {', '.join(TRAINABLE)}"
        )
    t0 = time.perf_counter()
    trace = load_trace(t.trace or None)
    cost_model = load_cost_model(t.cost_model or None)
    split, train_trace, spec, env = train_env(name, pcfg, seed, trace, cost_model)
    arms, obs_size, feats = list(env.arm_names), len(env.feature_names), list(env.feature_names)
    cls = policy_class(pcfg.kind)
    params = dict(pcfg.params)
    if "seed" in keywords_of(cls) and "seed" not in params:
        params["seed"] = seed
    summary: dict[str, Any] = {"policy": name, "kind": pcfg.kind, "train_prompts": len(split.train)}

    if pcfg.kind == "static" and "arm" not in params:  # training a static policy = choosing its arm
        statics = static_table(env)
        params["arm"] = statics[best_static(statics)].name
        summary["static_speedups"] = {s.name: round(s.speedup, 4) for s in statics}
    if pcfg.kind == "predictor":
        from policies.predictor import train_predictor

        policy = train_predictor(env, **params)
    elif pcfg.kind == "sb3":
        from env.vector_env import make_sb3_vec_env
        from policies.rl_train import plateau, train_sb3

        # validation prompts (for the eval callback and the best checkpoint) come out of the training prompts
        cats = train_trace.header["prompts"]["categories"]
        val = split_prompts(train_trace.prompt_ids, cats, max(1, t.test_per_category // 2), seed + 1)
        if not val.test:  # too few prompts to spare any: validate on the training prompts themselves
            val = type(val)(val.train, val.train, val.seed, val.test_per_category)
        fit_trace = subset_trace(train_trace, val.train)
        val_env = replay_env(subset_trace(train_trace, val.test), arms, cost_model, spec)
        policy = cls(arms, obs_size, feats, **params)
        venv = make_sb3_vec_env(t.n_envs, trace=fit_trace, arms=arms, cost_model=cost_model, features=spec)
        venv.seed(seed)
        out = run_dir / "train" / name

        def eval_fn(p: Any) -> float:
            return score_batch(val_env, p.act_batch, name=name, kind="rl").speedup

        policy = train_sb3(
            policy, venv, out, total_timesteps=t.total_timesteps, eval_fn=eval_fn, eval_freq=t.eval_freq,
            checkpoint_freq=t.checkpoint_freq, progress=progress,
            settings={**sb3_inputs(t), "fit_prompts": list(val.train), "validation_prompts": list(val.test)},
        )  # fmt: skip
        summary["run_dir"] = str(out)
        summary["plateau"] = plateau(out)
        summary["validation_prompts"] = len(val.test)
    else:
        policy = cls(arms, obs_size, feats, **params)
    learns_online = hasattr(policy, "update") and getattr(policy, "warm_start", True)
    if learns_online:  # warm start: learn online in replay, over the training prompts again and again
        steps = 0
        while steps < t.total_timesteps:
            score = score_policy(policy, env, learn=True)
            steps += int(score.steps.sum())
        summary["warm_start_steps"] = steps
    if hasattr(policy, "act_batch"):
        score = score_batch(env, policy.act_batch, name=name, kind=policy.kind)
    else:
        score = score_policy(policy, env, learn=False)
    summary["train_replay_speedup"] = round(score.speedup, 4)
    policy.meta = {
        "name": name,
        "trace": str(Path(t.trace).resolve()) if t.trace else None,
        "trace_model": trace.header["model"]["model_id"],
        "cost_model": str(Path(t.cost_model).resolve()) if t.cost_model else None,
        "feature_spec": env.feature_spec.as_dict(),
        "max_new_tokens": int(env.max_new_tokens),  # position = generated / this, in training and in decoding
        "split": split.as_dict(),
        "total_timesteps": t.total_timesteps,
        "train_replay_speedup": score.speedup,
        "train_seconds": round(time.perf_counter() - t0, 1),
        "train_settings": training_settings(pcfg, seed),
    }
    path = policy_path(name, pcfg, run_dir)
    summary["out"] = str(path)
    summary["seconds"] = policy.meta["train_seconds"]
    # (its time is train_seconds; its path, where it is found)
    policy.meta["summary"] = {k: v for k, v in summary.items() if k not in ("seconds", "out", "run_dir")}
    policy.save(path)
    return policy, path, summary


def train_env(name: str, pcfg: Any, seed: int, trace: Any, cost_model: Any) -> tuple[Any, Any, Any, Any]:
    """``[policies.NAME]``'s split of ``trace`` (its ``train.test_per_category``), the training prompts' trace, the
    feature spec and the replay env over its arms: (split, train_trace, spec, env). A split the trace cannot make and
    arms it did not record are one-line errors (``cmd_train`` asks for every policy before any trains)."""
    from policies.split import subset_trace, trace_split

    t = pcfg.train
    split = trace_split(trace, t.test_per_category, seed)
    train_trace = subset_trace(trace, split.train)
    spec = replace(trace.spec, draft_features=t.draft_features)
    env = replay_env(train_trace, pcfg.arms, cost_model, spec)
    if tuple(env.arm_names) != tuple(pcfg.arms):
        raise _user_error(
            f"policies.{name}.arms must list the env's menu in its order, with 'none' first: {list(env.arm_names)}"
        )
    return split, train_trace, spec, env


def policy_path(name: str, pcfg: Any, run_dir: Path) -> Path:
    return Path(pcfg.train.out) if pcfg.train.out else run_dir / "policies" / f"{name}.zip"


def training_settings(pcfg: Any, seed: int) -> dict[str, Any]:
    """What a trained policy depends on: its table of the config (kind, arms, parameters, training settings), the
    seed, and the trace's and cost model's bytes. A rerun keeps a saved policy of the same settings."""
    from dataclasses import asdict

    from env.files import file_digest

    def digest(path: str) -> str | None:
        return file_digest(path) if path and Path(path).is_file() else (path or None)

    train = {k: v for k, v in asdict(pcfg.train).items() if k != "out"}
    out = {"kind": pcfg.kind, "arms": list(pcfg.arms), "params": dict(pcfg.params), "train": train, "seed": seed,
           "trace": digest(pcfg.train.trace), "cost_model": digest(pcfg.train.cost_model)}  # fmt: skip
    return json.loads(json.dumps(out, default=str))


def kept_summary(name: str, pcfg: Any, seed: int, run_dir: Path) -> dict[str, Any] | None:
    """The summary of ``name``'s policy if a run killed later already saved it with these settings, else None."""
    from policies.base import PolicyError, load_policy

    path = policy_path(name, pcfg, run_dir)
    if pcfg.kind == "sb3" or not path.is_file():  # SB3 training resumes from its own checkpoints
        return None
    try:
        meta = load_policy(path).meta or {}
    except PolicyError:
        return None
    if meta.get("train_settings") != training_settings(pcfg, seed) or not isinstance(
        meta.get("summary"), dict
    ):
        return None
    return {**meta["summary"], "out": str(path), "seconds": meta.get("train_seconds", 0.0), "kept": True}


def _not_run_state(path: Path, name: str) -> None:
    """Refuse to train over ``path`` when it holds the state a ``draftgym run`` learned online (the run keeps its
    policies' state in its folder's ``policies/``, where ``train`` saves by default): the run's resume would go on
    from a replay-trained state it never had."""
    from experiments.records import RUN_LEARNED
    from policies.base import PolicyError, read_policy

    if not path.is_file():
        return
    try:
        meta = read_policy(path)[0].meta
    except PolicyError:
        return  # not a policy: the output checks say so
    if RUN_LEARNED in meta:
        raise _user_error(
            f"{path} holds the state policy {name} learned online in a draftgym run (from "
            f"{len(meta[RUN_LEARNED]) if isinstance(meta[RUN_LEARNED], list) else 0} prompts); train into another --out (or the policy's train.out)"
        )


def cmd_train(args: argparse.Namespace) -> int:
    from experiments.config import load_config

    cfg = load_config(args.config, sets=args.set or [])
    if not cfg.policies:
        raise _user_error(f"{args.config} defines no [policies.NAME] table to train")
    # a policy named twice is trained and reported once
    names = list(dict.fromkeys(args.policy or cfg.policies))
    unknown = [n for n in names if n not in cfg.policies]
    if unknown:
        raise _user_error(f"no [policies.{unknown[0]}] in {args.config}; defined: {', '.join(cfg.policies)}")
    planned = Path(args.out or f"runs/{cfg.name}")  # the run folder, not made yet
    where: dict[Path, str] = {}
    for name in cfg.policies:  # one file per policy: two sharing one would overwrite each other
        other = where.setdefault(policy_path(name, cfg.policies[name], planned).resolve(), name)
        if other != name:
            raise _user_error(f"policies {other} and {name} would both be saved to "
                              f"{policy_path(name, cfg.policies[name], planned)}; give each its own train.out")  # fmt: skip
    run_dir = output_dir(args.out or f"runs/{cfg.name}", exclusive=True)
    from policies.archive import is_policy_zip

    inputs = (args.config, *(p.train.trace or None for p in cfg.policies.values()),
              *(p.train.cost_model or None for p in cfg.policies.values()))  # fmt: skip
    for name in names:  # a policy a run learned online is that run's result, not a file to train over (one
        if (
            kept_summary(name, cfg.policies[name], cfg.seed, run_dir) is None
        ):  # trained with these settings: kept)
            _not_run_state(policy_path(name, cfg.policies[name], run_dir), name)
    for name in names:  # a train.out that cannot be written fails now, not after the training
        if cfg.policies[name].train.out:  # (nor one that is an input, or a file other than an earlier policy)
            output_file(cfg.policies[name].train.out, flag=f"policies.{name}.train.out", inputs=inputs,
                        earlier=(is_policy_zip, "a draftgym policy"))  # fmt: skip
    from env.cost import load_cost_model
    from env.trace import load_trace

    for (
        name
    ) in names:  # every policy's kind and inputs checked before any trains: a bad one of the second policy
        if cfg.policies[name].kind not in TRAINABLE:  # failed after the first's training
            raise _user_error(f"policies.{name}.kind {cfg.policies[name].kind!r} cannot be trained; trainable: "
                              f"{', '.join(TRAINABLE)}")  # fmt: skip
    traces = {spec: load_trace(spec or None) for spec in {cfg.policies[n].train.trace for n in names}}
    costs = {
        spec: load_cost_model(spec or None) for spec in {cfg.policies[n].train.cost_model for n in names}
    }
    for name in names:  # and each one's split and arms: a bad one fails now, not after the others' training
        pcfg = cfg.policies[name]
        if kept_summary(name, pcfg, cfg.seed, run_dir) is None:
            train_env(name, pcfg, cfg.seed, traces[pcfg.train.trace], costs[pcfg.train.cost_model])
            why = sb3_inputs_changed(name, pcfg, run_dir) if pcfg.kind == "sb3" else None
            if why:
                raise _user_error(why)
    del traces, costs
    rows = []
    for name in names:
        summary = kept_summary(name, cfg.policies[name], cfg.seed, run_dir)
        if summary is None:
            _, path, summary = train_policy(name, cfg.policies[name], seed=cfg.seed, run_dir=run_dir,
                                            progress=not args.json)  # fmt: skip
        path = policy_path(name, cfg.policies[name], run_dir)
        rows.append(summary)
        if not args.json:
            print(
                f"{name:<16} {summary['kind']:<12} train replay speedup {summary['train_replay_speedup']:.3f}  "
                f"({summary['seconds']:.0f} s) -> {path}"
            )
            if summary.get("plateau"):
                pl = summary["plateau"]
                print(
                    f"{'':<16} plateau (within 1% of the best validation speedup {pl['best']:.3f}) at "
                    f"{pl['timesteps']} steps, {pl['cpu_s'] / 60:.1f} CPU-min, {pl['wall_s'] / 60:.1f} wall-min"
                )
    if args.json:
        print(json.dumps({"policies": rows}))
    return 0


def register(sub: Any) -> None:
    t = sub.add_parser(
        "train", help="train the policies of a config on the replay env (bandits, RL, predictors)"
    )
    t.add_argument("config", type=path_arg, help="TOML config with [policies.NAME] tables")
    t.add_argument("--policy", action="append", default=None, help="train only this policy (repeatable)")
    t.add_argument("--set", action="append", default=None, metavar="KEY=VALUE", help="override a config key")
    t.add_argument(
        "--out", default=None, help="run directory (default runs/<config name>); re-use it to resume"
    )
    t.add_argument("--json", action="store_true", help="print one JSON object")
    t.set_defaults(func=cmd_train)
