"""Metric definitions, in one place (DESIGN.md "Metrics").

- tau (mean accepted length) = committed tokens / verification steps, bonus included (plain decoding = 1.00);
- acceptance rate alpha = accepted draft tokens / drafted tokens;
- speedup = tokens/s of a method / tokens/s of a baseline measured in the same run on the same prompts. Here it
  is a ratio of aggregate throughputs (sum of tokens / sum of seconds over the prompts), i.e. a ratio of
  token-weighted means, not a mean of per-prompt ratios;
- reward of a step = (tokens committed / step cost) * (cost of one autoregressive token): the step's
  instantaneous speedup;
- goodput under a load = committed tokens of all requests / seconds from the first arrival to the last finish
  (tokens/s of the whole server, not of one request); time per output token (TPOT) of a request = (finish - first
  token) / (tokens - 1); time to first token (TTFT) = first token - arrival (queueing and prefill included).
"""

from __future__ import annotations

from collections.abc import Iterable


def tau(committed_tokens: int, steps: int) -> float:
    """Committed tokens (the bonus token included) per step: 1 for plain decoding; 0 for no steps."""
    return committed_tokens / steps if steps else 0.0


def acceptance_rate(accepted: int, drafted: int) -> float:
    """Accepted drafts over drafted tokens; 0 where nothing was drafted."""
    return accepted / drafted if drafted else 0.0


def throughput(tokens: Iterable[float], seconds: Iterable[float]) -> float:
    """Aggregate tokens/s over prompts: sum of tokens / sum of seconds."""
    total_s = sum(seconds)
    return sum(tokens) / total_s if total_s > 0 else 0.0


def speedup(method_tps: float, baseline_tps: float) -> float:
    """The method's rate over the baseline's; NaN without a baseline rate (no ratio, not infinity)."""
    return method_tps / baseline_tps if baseline_tps > 0 else float("nan")


def step_reward(tokens: int, cost_s: float, ar_cost_s: float) -> float:
    """Instantaneous speedup of one step over autoregressive decoding."""
    return tokens * ar_cost_s / cost_s if cost_s > 0 else 0.0


def chain_expected_tokens(alpha: float, depth: int) -> float:
    """Tokens per step of a depth-k chain with i.i.d. acceptance alpha: (1 - alpha^(k+1)) / (1 - alpha)."""
    if alpha >= 1.0:
        return float(depth + 1)
    return (1 - alpha ** (depth + 1)) / (1 - alpha)


def goodput(tokens: Iterable[int], first_arrival_s: float, last_finish_s: float) -> float:
    """Committed tokens per second over all requests of a load level (DESIGN.md "Batches and load")."""
    span = last_finish_s - first_arrival_s
    return sum(tokens) / span if span > 0 else 0.0


def tpot(tokens: int, first_token_s: float, finish_s: float) -> float | None:
    """Seconds per output token after the first; None for a one-token answer."""
    return (finish_s - first_token_s) / (tokens - 1) if tokens > 1 else None
