"""Replay scores: a policy's speedup on a trace, and the oracle ceilings every learned policy is compared with.

Accounting (the same for policies and oracles): an episode's autoregressive time is ``sum over steps of tokens *
ar_cost_s`` and its time is ``sum of cost_s`` (both from the cost model, ``env.replay``); the replay speedup over a
set of prompts is the ratio of the sums (aggregate throughputs, as ``env.metrics.speedup``), over our own
autoregressive loop. The first token of every prompt (the prefill) is outside the episode, for every method alike.

Oracles (they see the future; replay only):

- ``best_arm``: the single arm with the best speedup on the scored prompts themselves (hindsight);
- ``best_arm_per_prompt``: each prompt's own best single arm;
- ``greedy``: at every step, the arm with the largest instantaneous speedup given the true acceptance;
- ``optimal``: the arm sequence of least total time (dynamic programming over positions: the text is fixed, only
  the time to produce it depends on the arms), an upper bound on every policy's replay speedup.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from numbers import Integral
from typing import Any

import numpy as np

from env.features import history_init
from env.replay import ReplayTables, replay_observe, replay_step
from policies.base import PolicyError


@dataclass
class ReplayScore:
    """Per-prompt totals of one method in replay."""

    name: str
    kind: str
    prompts: list[str]
    ar_s: np.ndarray  # [P] autoregressive seconds
    cost_s: np.ndarray  # [P] seconds with this method
    tokens: np.ndarray  # [P] committed tokens
    steps: np.ndarray  # [P]
    arm_counts: np.ndarray | None = None  # [K] how often each arm was chosen
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def speedup(self) -> float:
        return float(self.ar_s.sum() / self.cost_s.sum()) if self.cost_s.sum() > 0 else float("nan")

    @property
    def tau(self) -> float:
        return float(self.tokens.sum() / max(self.steps.sum(), 1))

    def subset(self, keep: Sequence[int]) -> ReplayScore:
        idx = np.asarray(keep, dtype=np.int64)
        return ReplayScore(
            self.name, self.kind, [self.prompts[i] for i in idx], self.ar_s[idx], self.cost_s[idx],
            self.tokens[idx], self.steps[idx], self.arm_counts, dict(self.extra),
        )  # fmt: skip


def prompt_indices(env: Any, prompt_ids: Sequence[str] | None) -> np.ndarray:
    ids = list(env.prompt_ids)
    tb: ReplayTables = env.tables
    if prompt_ids is None:
        return np.asarray(tb.startable, dtype=np.int64)
    if isinstance(prompt_ids, str):  # ("12" was prompts 1 and 2)
        raise PolicyError(f"prompt_ids must be a list of prompt ids, got the string {prompt_ids[:40]!r}")
    missing = [p for p in prompt_ids if p not in ids]
    if missing:
        raise PolicyError(f"prompts {missing[:5]} are not in the trace")
    idx = np.array([ids.index(str(p)) for p in prompt_ids], dtype=np.int64)
    return idx[tb.length[idx] >= 2]


def rollout_actions(tb: ReplayTables, prompts: np.ndarray, choose) -> tuple[np.ndarray, ...]:
    """Replay every prompt in ``prompts`` at once; ``choose(obs [B, F], prompt [B], pos [B]) -> actions [B]`` for
    the episodes still running. Returns per-prompt (ar_s, cost_s, tokens, steps) and arm counts [K]."""
    b = prompts.shape[0]
    k = tb.accept.shape[0]
    f = tb.feat.shape[1] + 1 + np.arange(k + 2)[tb.cols].size  # position, position features, history columns
    pos = np.zeros(b, dtype=np.int64)
    hist = history_init(b, k)
    ar_s, cost_s = np.zeros(b), np.zeros(b)
    tokens, steps = np.zeros(b, dtype=np.int64), np.zeros(b, dtype=np.int64)
    counts = np.zeros(k, dtype=np.int64)
    active = np.ones(b, dtype=bool)
    while active.any():
        rows = np.flatnonzero(active)
        obs = replay_observe(tb, prompts[rows], pos[rows], hist[rows], np.empty((rows.size, f), np.float32))
        acts = np.asarray(choose(obs, prompts[rows], pos[rows]), dtype=np.int64)
        out = replay_step(tb, prompts[rows], pos[rows], hist, rows, acts)
        ar_s[rows] += out.tokens * out.ar_cost_s
        cost_s[rows] += out.cost_s
        tokens[rows] += out.tokens
        steps[rows] += 1
        np.add.at(counts, acts, 1)
        pos[rows] = out.pos
        active[rows] = ~(out.terminated | out.truncated)
    return ar_s, cost_s, tokens, steps, counts


def score_batch(
    env: Any, act_batch, prompt_ids: Sequence[str] | None = None, *, name: str, kind: str
) -> ReplayScore:
    """A policy that acts on a batch of observations (``act_batch(obs [B, F]) -> [B]``; no online updates),
    replayed on all prompts at once."""
    tb, idx = env.tables, prompt_indices(env, prompt_ids)
    res = rollout_actions(tb, idx, lambda obs, p, pos: act_batch(obs))
    return ReplayScore(name, kind, [env.prompt_ids[i] for i in idx], *res)


def score_static(env: Any, arm: int, prompt_ids: Sequence[str] | None = None) -> ReplayScore:
    if (
        isinstance(arm, bool) or not isinstance(arm, Integral) or not 0 <= arm < len(env.arm_names)
    ):  # (-1: the last)
        raise PolicyError(f"arm must be an index in 0..{len(env.arm_names) - 1}, got {str(arm)[:40]}")
    tb, idx = env.tables, prompt_indices(env, prompt_ids)
    res = rollout_actions(tb, idx, lambda obs, p, pos: np.full(p.shape[0], arm))
    return ReplayScore(env.arm_names[arm], "static", [env.prompt_ids[i] for i in idx], *res)


def score_greedy_oracle(env: Any, prompt_ids: Sequence[str] | None = None) -> ReplayScore:
    """Each step the arm of largest instantaneous speedup, knowing every arm's true acceptance there."""
    tb, idx = env.tables, prompt_indices(env, prompt_ids)

    def choose(obs, p, pos):
        g = tb.offset[p] + pos
        rem = tb.length[p] - 1 - pos
        tok = np.minimum(tb.accept[:, g] + 1, rem[None, :])  # [K, B]
        return np.argmax(tok / tb.cost[:, g], axis=0)

    res = rollout_actions(tb, idx, choose)
    return ReplayScore("oracle:per-step-greedy", "oracle", [env.prompt_ids[i] for i in idx], *res)


def score_optimal_oracle(env: Any, prompt_ids: Sequence[str] | None = None) -> ReplayScore:
    """The least-time arm sequence per prompt: ``V[pos] = min_a cost[a, pos] + V[pos + tokens_a]``."""
    tb, idx = env.tables, prompt_indices(env, prompt_ids)
    plans = {}
    for p in idx:
        n = int(tb.length[p]) - 1  # positions 0..n-1 are roots with a step to take
        g = tb.offset[p] + np.arange(n)
        rem = n - np.arange(n)
        tok = np.minimum(tb.accept[:, g] + 1, rem[None, :])  # [K, n]
        value = np.zeros(n + 1)
        best = np.zeros(n, dtype=np.int64)
        for pos in range(n - 1, -1, -1):
            total = tb.cost[:, g[pos]] + value[pos + tok[:, pos]]
            best[pos] = int(np.argmin(total))
            value[pos] = total[best[pos]]
        plans[int(p)] = best
    res = rollout_actions(
        tb, idx, lambda obs, p, pos: np.array([plans[int(a)][int(b)] for a, b in zip(p, pos)])
    )
    return ReplayScore("oracle:optimal", "oracle", [env.prompt_ids[i] for i in idx], *res)


def static_table(env: Any, prompt_ids: Sequence[str] | None = None) -> list[ReplayScore]:
    """Every arm of the menu as a static policy."""
    return [score_static(env, a, prompt_ids) for a in range(len(env.arm_names))]


def best_static(scores: Sequence[ReplayScore]) -> int:
    return int(np.argmax([s.speedup for s in scores]))


def score_best_arm_per_prompt(statics: Sequence[ReplayScore]) -> ReplayScore:
    cost = np.stack([s.cost_s for s in statics])  # [K, P]
    pick = np.argmin(cost, axis=0)
    cols = np.arange(cost.shape[1])
    s0 = statics[0]

    def take(attr: str) -> np.ndarray:
        return np.stack([getattr(s, attr) for s in statics])[pick, cols]

    return ReplayScore(
        "oracle:best-arm-per-prompt", "oracle", s0.prompts, take("ar_s"), take("cost_s"), take("tokens"),
        take("steps"), np.bincount(pick, minlength=len(statics)),
    )  # fmt: skip


def oracle_scores(env: Any, prompt_ids: Sequence[str] | None = None) -> list[ReplayScore]:
    """The ceilings: best single arm (hindsight), best arm per prompt, per-step greedy, optimal."""
    statics = static_table(env, prompt_ids)
    best = statics[best_static(statics)]
    best_row = ReplayScore(
        f"oracle:best-arm ({best.name})",
        "oracle",
        best.prompts,
        best.ar_s,
        best.cost_s,
        best.tokens,
        best.steps,
    )
    return [
        best_row,
        score_best_arm_per_prompt(statics),
        score_greedy_oracle(env, prompt_ids),
        score_optimal_oracle(env, prompt_ids),
    ]


def score_policy(
    policy: Any,
    env: Any,
    prompt_ids: Sequence[str] | None = None,
    *,
    name: str | None = None,
    learn: bool = True,
) -> ReplayScore:
    """Run ``policy`` episode by episode on the replay env (``SpecDecodeEnv``), in prompt order; online learners
    keep learning across prompts when ``learn`` (as they would inside the decoder). A policy whose ``update`` is
    its decision rule, not learning (``warm_start = False``: the HF schedule's length moves with each step's
    acceptance), is updated either way: frozen, it would be scored as the static arm it starts at."""
    idx = prompt_indices(env, prompt_ids)
    k = len(env.arm_names)
    n = idx.shape[0]
    ar_s, cost_s = np.zeros(n), np.zeros(n)
    tokens, steps = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    counts = np.zeros(k, dtype=np.int64)
    rule = not getattr(policy, "warm_start", True)
    update = getattr(policy, "update", None) if learn or rule else None
    for i, p in enumerate(idx):
        obs, _ = env.reset(options={"prompt_id": env.prompt_ids[p]})
        if hasattr(policy, "reset"):
            policy.reset()
        done = False
        while not done:
            a = int(policy.act(obs))
            nxt, reward, terminated, truncated, info = env.step(a)
            if update is not None:
                update(obs, a, reward, info)
            ar_s[i] += info["tokens"] * info["ar_cost_s"]
            cost_s[i] += info["cost_s"]
            tokens[i] += info["tokens"]
            steps[i] += 1
            counts[a] += 1
            obs, done = nxt, terminated or truncated
    kind = getattr(policy, "kind", "policy")
    label = name or getattr(policy, "name", type(policy).__name__)
    return ReplayScore(label, kind, [env.prompt_ids[p] for p in idx], ar_s, cost_s, tokens, steps, counts)
