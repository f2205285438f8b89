"""``draftgym oracle-gap``: how much of the per-step oracle's gain can a policy learn from what it sees?

The per-step greedy oracle (``policies.oracle``) picks each step's arm knowing every arm's true accepted length
there; a policy sees only the observation. This command measures the gap between the two on a trace split by
prompt, with accept-length predictors of two kinds (ridge regression, gradient-boosted trees) on two feature sets:

- ``position``: the observation's position features (entropy, top-1 probability and margin, suffix match length,
  the hidden-state projection, and each menu drafter's largest proposal at the root);
- ``position+ngram``: those plus what the committed text says about copying, computed from the trace's tokens:
  how many of the latest tokens the n-gram drafter's first proposal (read from its recorded trees) guessed in a
  row, its hit rate over the last 8 tokens, whether it guessed the root, and
  whether it had no guess. Every feature at a position uses only tokens committed before that step.

Each predictor is fitted twice: on the training prompts (what a trained policy can do on held-out prompts) and on
the held-out prompts themselves (in-sample: what the features can express with no generalization needed; not an
upper bound, since the fit minimizes squared error in accepted length, not time). Each plays, on the held-out prompts in replay, the better (on the prompts it was fitted on)
of the predictor policy's two rules: most predicted tokens per unit cost, or most tokens beyond what the cost buys
at the rule's own speedup. The table reports speedup over our autoregressive loop (cost model) and the share of the oracle's gain
over the best static arm (chosen on the training prompts) that each recovers.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
from tqdm import tqdm

from env.cli import seed_int
from env.files import atomic_write_text
from env.trace import Trace

DEFAULT_MENU = ("none", "ngram-d2", "ngram-d4", "ngram-d8", "ngram-d16", "ngram-d4-k2", "ngram-d8-k4-b24")
NGRAM_FEATURES = ("ngram_streak", "ngram_hit_rate8", "ngram_hit_root", "ngram_no_guess")


class OracleGapError(ValueError):
    """Settings the measurement cannot use (a split with no test or no training prompt); meant for the user."""


def ngram_features(trace: Trace) -> np.ndarray:
    """float32 [T, 4] per trace position (root = the position's committed token), ``NGRAM_FEATURES`` in order.

    The n-gram drafter's guess for generated token j is the first child of its recorded tree at position j - 1
    (what it proposed right after token j - 1); token 0 came from the prompt's forward pass, with no guess."""
    from env.replay import tree_index

    if "ngram" not in trace.trees:
        raise OracleGapError(
            "the n-gram features need the n-gram drafter's trees, which the trace did not record"
        )
    ix = tree_index(trace, "ngram")
    npos = trace.traj.shape[0]
    first = np.flatnonzero((ix["depth"] == 1) & (ix["rank"] == 0))  # one per position that had a guess
    guessed_next = np.full(
        npos, -1, dtype=np.int64
    )  # per position g: 1 / 0 the guess for g + 1 was right / wrong
    guessed_next[ix["pos"][first]] = ix["match"][first]
    out = np.zeros((npos, len(NGRAM_FEATURES)), np.float32)
    for p in range(trace.num_prompts):
        a, b = int(trace.traj_off[p]), int(trace.traj_off[p + 1])
        hits = np.concatenate([[-1], guessed_next[a : b - 1]])  # hits[j]: token j against the guess before it
        streak = 0
        for t, h in enumerate(hits.tolist()):
            streak = streak + 1 if h == 1 else 0
            recent = hits[max(0, t - 7) : t + 1]
            recent = recent[recent >= 0]
            rate = float((recent == 1).mean()) if recent.size else 0.0
            out[a + t] = [min(streak, 16) / 16, rate, float(h == 1), float(h == -1)]
    return out


def _positions(tb: Any, prompts: np.ndarray) -> np.ndarray:
    return np.concatenate([np.arange(tb.offset[p], tb.offset[p] + tb.length[p] - 1) for p in prompts])


def measure(
    trace: Trace,
    arms: Sequence[str] = DEFAULT_MENU,
    cost_model: Any = None,
    *,
    test_per_category: int = 5,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """Rows {features, model, fit, replay_speedup, recovered} plus the best static arm and the oracle."""
    from sklearn.ensemble import HistGradientBoostingRegressor
    from sklearn.linear_model import Ridge
    from threadpoolctl import threadpool_limits

    from env.spec_env import SpecDecodeEnv
    from policies.oracle import (
        best_static,
        prompt_indices,
        rollout_actions,
        score_greedy_oracle,
        score_optimal_oracle,
        static_table,
    )
    from policies.split import trace_split

    spec = replace(trace.spec, draft_features=True)
    env = SpecDecodeEnv(backend="replay", trace=trace, arms=list(arms), cost_model=cost_model, features=spec)
    tb = env.tables
    split = trace_split(trace, test_per_category, seed)
    if not split.test or not split.train:
        raise OracleGapError(
            f"a split of {test_per_category} per category leaves no test or no training prompt "
            f"({len(trace.prompt_ids)} prompts in the trace)"
        )
    test_idx = prompt_indices(env, list(split.test))
    train_idx = prompt_indices(env, list(split.train))
    if not test_idx.size or not train_idx.size:  # (a prompt that ends after its first token has no step)
        raise OracleGapError(
            f"a split of {test_per_category} per category leaves no test or no training prompt with a step to "
            f"take ({test_idx.size} and {train_idx.size} of {len(trace.prompt_ids)} prompts in the trace)"
        )
    best_arm = best_static(static_table(env, list(split.train)))
    base = static_table(env, list(split.test))[best_arm].speedup
    oracle = score_greedy_oracle(env, list(split.test)).speedup
    optimal = score_optimal_oracle(env, list(split.test)).speedup
    gain = oracle - base

    def play(scores: np.ndarray, idx: np.ndarray) -> float:
        """Replay speedup on prompts ``idx`` of taking, each step, the arm of highest ``scores`` [T, K]."""

        def choose(obs: np.ndarray, p: np.ndarray, pos: np.ndarray) -> np.ndarray:
            return np.argmax(scores[tb.offset[p] + pos], axis=1)

        ar, cost, *_ = rollout_actions(tb, idx, choose)
        return float(ar.sum() / cost.sum())

    def best_rule(tokens: np.ndarray, cost: np.ndarray, idx: np.ndarray) -> np.ndarray:
        """Scores of the better rule on the prompts ``idx``: the ratio tokens / cost, or the margin
        tokens - rate * cost with Dinkelbach's rate (the rule's own speedup, iterated; policies.predictor)."""
        top = (play(tokens / cost, idx), tokens / cost)
        rate = top[0]
        for _ in range(4):
            scores = tokens - rate * cost
            got = play(scores, idx)
            top = max(top, (got, scores), key=lambda b: b[0])
            if abs(got - rate) < 1e-3:
                break
            rate = got
        return top[1]

    fits = {
        "train": (_positions(tb, train_idx), train_idx),
        "in-sample": (_positions(tb, test_idx), test_idx),
    }
    feature_sets = {
        "position": tb.feat,
        "position+ngram": np.concatenate([tb.feat, ngram_features(trace)], 1),
    }
    models = {
        "ridge": lambda: Ridge(alpha=1.0),
        "gbdt": lambda: HistGradientBoostingRegressor(max_iter=200, max_depth=4, random_state=0),
    }
    rel_cost = (tb.cost / tb.ar_cost[None]).T  # [T, K] a step's cost in autoregressive steps
    rows = []
    combos = [(f, m, w) for f in feature_sets for m in models for w in fits]
    for fname, mname, wname in tqdm(combos, desc="oracle-gap", disable=not progress):
        x, (g, idx) = feature_sets[fname], fits[wname]
        pred = np.zeros(rel_cost.shape)
        with threadpool_limits(1):
            for k in range(len(arms)):
                pred[:, k] = models[mname]().fit(x[g], tb.accept[k, g]).predict(x)
        speed = play(best_rule(np.maximum(pred, 0.0) + 1.0, rel_cost, idx), test_idx)
        rows.append({"features": fname, "model": mname, "fit": wname, "replay_speedup": speed,
                     "recovered": (speed - base) / gain if gain > 0 else None})  # fmt: skip
    return {
        "rows": rows,
        "best_static": {"arm": env.arm_names[best_arm], "replay_speedup": base},
        "oracle": {"name": "per-step-greedy", "replay_speedup": oracle},
        "optimal": {"name": "optimal", "replay_speedup": optimal},
        "test_prompts": [env.prompt_ids[i] for i in test_idx],  # those scored: each with a step to take
        "train_prompts": int(train_idx.size),
        "menu": list(env.arm_names),
    }


def format_result(res: dict[str, Any]) -> str:
    lines = [
        f"{'features':<16} {'model':<6} {'fitted on':<18} {'replay x AR':>11} {'recovered':>9}",
        "-" * 64,
    ]
    for r in res["rows"]:
        fit = "training prompts" if r["fit"] == "train" else "held-out (in-smp)"
        rec = "-" if r["recovered"] is None else f"{100 * r['recovered']:.0f}%"
        lines.append(f"{r['features']:<16} {r['model']:<6} {fit:<18} {r['replay_speedup']:>11.3f} {rec:>9}")
    b, o, opt = res["best_static"], res["oracle"], res["optimal"]
    lines.append(f"\nbest static arm (training prompts): {b['arm']} {b['replay_speedup']:.3f}; per-step greedy "
                 f"oracle {o['replay_speedup']:.3f} (optimal {opt['replay_speedup']:.3f}); "
                 f"{len(res['test_prompts'])} held-out prompts")  # fmt: skip
    return "\n".join(lines)


def cmd_oracle_gap(args: argparse.Namespace) -> int:
    from env.arms import make_arms
    from env.cost import CostModelError, default_cost_model_path, load_cost_model
    from env.trace import TraceError, load_trace
    from experiments.args import output_file
    from experiments.errors import UserError
    from experiments.provenance import provenance

    if args.test_per_category < 1 or args.seed < 0:
        raise UserError(
            f"--test-per-category must be >= 1 and --seed >= 0, got {args.test_per_category} and {args.seed}"
        )
    if args.json:
        output_file(
            args.json, flag="--json", inputs=(args.trace, args.cost_model or default_cost_model_path())
        )
    try:
        trace = load_trace(args.trace)
        named = [a for a in args.arms.split(",") if a.strip()]
        arms = [a.name for a in make_arms(named)] if named else []
        if len(arms) < 2:  # "none" alone (or nothing): nothing to choose between
            raise UserError(
                f"--arms {args.arms!r} names no drafting arm (e.g. --arms none,ngram-d2,ngram-d4)"
            )
        cm = load_cost_model(args.cost_model)
        res = measure(trace, arms, cm, test_per_category=args.test_per_category, seed=args.seed,
                      progress=sys.stderr.isatty())  # fmt: skip
    except (TraceError, CostModelError, OracleGapError) as err:
        raise UserError(str(err)) from err
    print(format_result(res))
    if args.json:
        res["settings"] = {
            "trace": args.trace or "bundled",
            "arms": arms,
            "cost_model": args.cost_model or "shipped",
            "test_per_category": args.test_per_category,
            "seed": args.seed,
        }
        res["provenance"] = provenance()
        atomic_write_text(args.json, json.dumps(res, indent=2))
    return 0


def register(sub: Any) -> None:
    from experiments.args import positive_int

    g = sub.add_parser(
        "oracle-gap", help="how much of the per-step oracle's gain predictors can learn (replay)"
    )
    g.add_argument("--trace", default=None, help="replay trace (default: the bundled one)")
    g.add_argument("--arms", default=",".join(DEFAULT_MENU), help="comma list of arms (the menu)")
    g.add_argument("--cost-model", default=None, help="cost model JSON (default: the shipped one)")
    g.add_argument("--test-per-category", type=positive_int, default=5, help="held-out prompts per category")
    g.add_argument("--seed", type=seed_int, default=0, help="split seed")
    g.add_argument("--json", default=None, metavar="FILE", help="write the result as JSON to FILE")
    g.set_defaults(func=cmd_oracle_gap)
