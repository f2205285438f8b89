"""What a sweep trial measures: one value per prompt (reported to the pruner as it comes), averaged.

Backends (``sweep.backend``):

- ``live``: decode the workload with the trial's method on the real model. ``speedup`` = the method's tokens/s
  over our autoregressive loop's on the same prompt, both measured by the same worker (the AR time of a prompt
  is measured again in each trial, or with ``sweep.ar_every_trial = false`` once per worker and reused);
- ``replay``: the replay env (``env.spec_env.SpecDecodeEnv(backend="replay")``) on a recorded trace, costs from
  the cost model: per prompt, tokens / (sum of step costs in units of one AR token). Runs at memory speed; the
  prompts are the trace's;
- ``analytic``: a closed-form toy (no model): a tree of ``n`` nodes over ``d`` levels accepts each level with
  probability ``1 - (1 - alpha)^(n/d)``, so it commits ``(1 - a^(d+1)) / (1 - a)`` tokens per step
  (``env.metrics.chain_expected_tokens``: the ``tau`` objective) at a cost of ``1 + node_cost * n`` AR steps
  (``speedup``: tokens over cost; ``tokens_per_s`` is refused: there are no seconds). Prompt i has
  ``alpha_i`` spread +-0.1 around ``sweep.analytic_alpha``. It exercises the sweep machinery (workers, pruning,
  kill/resume) in milliseconds, and its optimum is known.

An evaluator is built once per worker process and called once per trial with the trial's resolved config and a
``report(step, value, n_steps)`` callback (prompt ``step`` of ``n_steps``) that may raise ``optuna.TrialPruned``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from tqdm import tqdm

from env.metrics import chain_expected_tokens
from experiments.config import Config, ConfigError
from experiments.space import tuned_method

Report = Callable[[int, float, int], None]  # (step, value, n_steps)


ANALYTIC_OBJECTIVES = ("speedup", "tau")  # the closed form has no seconds
ANALYTIC_OBJECTIVE_ERROR = "sweep.objective = 'tokens_per_s' needs seconds, which the analytic backend does not model: use speedup or tau"


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def replay_prompts(cfg: Config, trace: Any, pids: list[str]) -> list[str]:
    """The prompts of ``pids`` (the trace's) a replay sweep scores: ``workload.categories``, then the first
    ``workload.per_category`` of each category in the trace's order, then the first ``workload.limit`` (the
    categories were ignored: every prompt was scored). An unknown category, or none left, is a ``ConfigError``."""
    w = cfg.workload
    cats = dict(
        zip((str(p) for p in trace.prompt_ids), (str(c) for c in trace.header["prompts"]["categories"]))
    )
    if w.categories:
        unknown = sorted(set(w.categories) - set(cats.values()))
        if unknown:
            raise ConfigError(
                f"workload.categories {unknown}: the replay trace holds {sorted(set(cats.values()))}"
            )
        pids = [p for p in pids if cats.get(p) in w.categories]
    if w.per_category:
        counts: dict[str, int] = {}
        kept = []
        for p in pids:
            c = cats.get(p, "")
            counts[c] = counts.get(c, 0) + 1
            if counts[c] <= w.per_category:
                kept.append(p)
        pids = kept
    pids = pids[: w.limit] if w.limit else pids
    if not pids:
        raise ConfigError("the replay trace holds no prompt the workload selection keeps")
    return pids


class AnalyticEvaluator:
    def __call__(self, cfg: Config, params: dict[str, Any], report: Report) -> dict[str, Any]:
        from env.engine import parse_arm

        sw = cfg.sweep
        method = tuned_method(cfg)
        if method.startswith("policy:"):
            raise ConfigError(
                "sweep.backend = 'analytic' evaluates tree shapes only; use live or replay for policies"
            )
        if sw.objective not in ANALYTIC_OBJECTIVES:
            raise ConfigError(ANALYTIC_OBJECTIVE_ERROR)
        arm = parse_arm(method)
        n_prompts = max(1, cfg.workload.limit or 4)
        nodes, depth = arm.shape.max_nodes, arm.shape.depth
        values = []
        for i in range(n_prompts):
            alpha = sw.analytic_alpha + (0.2 * i / (n_prompts - 1) - 0.1 if n_prompts > 1 else 0.0)
            alpha = min(max(alpha, 0.0), 0.999)
            a = 1 - (1 - alpha) ** (nodes / depth)
            tau = chain_expected_tokens(a, depth)
            value = tau if sw.objective == "tau" else tau / (1 + sw.analytic_node_cost * nodes)
            if sw.analytic_prompt_s:
                time.sleep(sw.analytic_prompt_s)
            values.append(value)
            report(i, value, n_prompts)
        return {"value": _mean(values), "per_prompt": values}


class LiveEvaluator:
    """Holds the model (loaded once per worker) and the AR baseline time of each prompt."""

    def __init__(self) -> None:
        self.loaded: Any = None
        self.key: tuple[str, str, str, str] | None = None
        self.ar_tps: dict[tuple[str, int], float] = {}
        self.progress = False

    def _model(self, cfg: Config) -> Any:
        key = (cfg.model.name, cfg.model.dtype, cfg.model.device, cfg.model.weights)
        if self.key != key:
            from env.model import load_model

            loaded = load_model(key[0], dtype=key[1], device=key[2], weights=key[3])
            self.loaded, self.key, self.ar_tps = loaded, key, {}
            self._warmup(cfg)
        return self.loaded

    def _warmup(self, cfg: Config) -> None:
        from env.decoder import chat_prompt
        from experiments.bench import run_method

        run_method("ar", self.loaded, {}, chat_prompt(self.loaded.tokenizer, "Say hello."), 4)

    def __call__(self, cfg: Config, params: dict[str, Any], report: Report) -> dict[str, Any]:
        from env.decoder import chat_prompt
        from experiments.bench import run_method
        from experiments.methods import make_decoders, sampling_of
        from experiments.runner import select_prompts

        loaded = self._model(cfg)
        method = tuned_method(cfg)
        decoders = make_decoders(replace(cfg, methods=(method,)), loaded)
        sampling, objective = sampling_of(cfg), cfg.sweep.objective
        values, tokens, seconds, taus = [], 0, 0.0, []
        prompts = select_prompts(cfg)
        for i, p in enumerate(tqdm(prompts, desc="  prompts", leave=False, disable=not self.progress)):
            ids = chat_prompt(loaded.tokenizer, p.text)
            ar_tps = self._ar(cfg, p.prompt_id, ids, cfg.seed + i) if objective == "speedup" else None
            out, wall, _, tau, _ = run_method(method, loaded, decoders, ids, cfg.decode.max_new_tokens,
                                              sampling=sampling, seed=cfg.seed + i)  # fmt: skip
            tps = len(out) / wall if wall > 0 else 0.0
            tokens, seconds = tokens + len(out), seconds + wall
            taus.append(tau or 0.0)
            if objective == "speedup":
                value = tps / ar_tps
            elif objective == "tau":
                value = tau or 0.0
            else:
                value = tps
            values.append(value)
            report(i, value, len(prompts))
        return {
            "value": _mean(values),
            "per_prompt": values,
            "tokens_per_s": tokens / seconds,
            "tau": _mean(taus),
        }

    def _ar(self, cfg: Config, prompt_id: str, ids: list[int], seed: int) -> float:
        """The AR baseline's tokens/s on one prompt, sampled with the seed the tuned method gets there (as ``run``
        seeds every method of a prompt alike)."""
        from experiments.bench import run_method
        from experiments.methods import sampling_of

        if (prompt_id, seed) not in self.ar_tps or cfg.sweep.ar_every_trial:
            out, wall, *_ = run_method(
                "ar", self.loaded, {}, ids, cfg.decode.max_new_tokens, sampling=sampling_of(cfg), seed=seed
            )
            self.ar_tps[prompt_id, seed] = len(out) / wall if wall > 0 else float("inf")
        return self.ar_tps[prompt_id, seed]


class ReplayEvaluator:
    """The replay env on a recorded trace: static arms and policies alike act on its observations."""

    def __init__(self) -> None:
        self.trace: Any = None
        self.trace_key: str | None = None

    def __call__(self, cfg: Config, params: dict[str, Any], report: Report) -> dict[str, Any]:
        from env.engine import parse_arm

        try:
            from env.spec_env import SpecDecodeEnv
            from env.trace import load_trace
        except ImportError as err:
            raise ConfigError(
                f"sweep.backend = 'replay' needs the replay env, which is unavailable ({err})"
            ) from err
        if self.trace_key != cfg.sweep.trace:
            self.trace, self.trace_key = load_trace(cfg.sweep.trace or None), cfg.sweep.trace
        method = tuned_method(cfg)
        arms = list(cfg.policies[method[7:]].arms) if method.startswith("policy:") else ["none", method]
        max_new = min(cfg.decode.max_new_tokens, self.trace.max_new_tokens)
        env = SpecDecodeEnv("replay", arms=arms, trace=self.trace, max_new_tokens=max_new,
                            cost_model=cfg.sweep.cost_model or None)  # fmt: skip
        policy = None
        if method.startswith("policy:"):
            from experiments.methods import build_policy

            name = method.removeprefix("policy:")
            policy = build_policy(name, cfg.policies[name], seed=cfg.seed, obs_size=env.observation_space.shape[0],
                                  features=env.feature_names)  # fmt: skip
        to_env = [env.arm_names.index(parse_arm(a).name) for a in arms]  # the env puts "none" first
        pids = replay_prompts(cfg, self.trace, [env.prompt_ids[int(i)] for i in env.tables.startable])
        values = []
        for i, pid in enumerate(pids):
            obs, _ = env.reset(seed=cfg.seed + i, options={"prompt_id": pid})
            if policy is not None and hasattr(policy, "reset"):
                policy.reset()
            tokens, cost_s, cost_ar, steps, done = 0, 0.0, 0.0, 0, False
            while not done:
                a = int(policy.act(obs)) if policy is not None else 1  # the policy's index into its own menu
                nxt, reward, term, trunc, info = env.step(to_env[a])
                if policy is not None and hasattr(policy, "update"):
                    policy.update(obs, a, reward, info)
                obs, done = nxt, term or trunc
                tokens, steps = tokens + info["tokens"], steps + 1
                cost_s, cost_ar = cost_s + info["cost_s"], cost_ar + info["cost_s"] / info["ar_cost_s"]
            objective = cfg.sweep.objective
            value = {"tau": tokens / steps, "tokens_per_s": tokens / cost_s}.get(objective, tokens / cost_ar)
            values.append(value)
            report(i, value, len(pids))
        return {"value": _mean(values), "per_prompt": values, "max_new_tokens": max_new}


EVALUATORS: dict[str, Callable[[], Any]] = {
    "analytic": AnalyticEvaluator,
    "live": LiveEvaluator,
    "replay": ReplayEvaluator,
}
