"""Metric definitions, in one place (DESIGN.md "Metrics").

- tau (mean accepted length) = committed tokens / verification steps, bonus included (plain decoding = 1.00);
- acceptance rate alpha = accepted draft tokens / drafted tokens;
- speedup = tokens/s of a method / tokens/s of a baseline measured in the same run on the same prompts. Here it
  is a ratio of aggregate throughputs (sum of tokens / sum of seconds over the prompts), i.e. a ratio of
  token-weighted means, not a mean of per-prompt ratios;
- reward of a step = (tokens committed / step cost) * (cost of one autoregressive token): the step's
  instantaneous speedup.
"""

from __future__ import annotations

from collections.abc import Iterable


def tau(committed_tokens: int, steps: int) -> float:
    return committed_tokens / steps if steps else 0.0


def acceptance_rate(accepted: int, drafted: int) -> float:
    return accepted / drafted if drafted else 0.0


def throughput(tokens: Iterable[float], seconds: Iterable[float]) -> float:
    """Aggregate tokens/s over prompts: sum of tokens / sum of seconds."""
    total_s = sum(seconds)
    return sum(tokens) / total_s if total_s > 0 else 0.0


def speedup(method_tps: float, baseline_tps: float) -> float:
    return method_tps / baseline_tps if baseline_tps > 0 else float("nan")


def step_reward(tokens: int, cost_s: float, ar_cost_s: float) -> float:
    """Instantaneous speedup of one step over autoregressive decoding."""
    return tokens * ar_cost_s / cost_s if cost_s > 0 else 0.0


def chain_expected_tokens(alpha: float, depth: int) -> float:
    """Tokens per step of a depth-k chain with i.i.d. acceptance alpha: (1 - alpha^(k+1)) / (1 - alpha)."""
    if alpha >= 1.0:
        return float(depth + 1)
    return (1 - alpha ** (depth + 1)) / (1 - alpha)
