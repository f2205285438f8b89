"""A sweep's trials as rows (``sweep.json``, ``trials.jsonl``) and as the table ``draftgym sweep`` prints.

A trial's value is the mean of its per-prompt values. Optuna stores a pruned trial's value as its last
intermediate value (one prompt's); ``trial_value`` gives the mean of the prompts it ran instead, so that a pruned
trial compares with the complete ones on the same footing.
"""

from __future__ import annotations

from typing import Any

from experiments.config import Config

FINISHED = ("COMPLETE", "PRUNED")


def trial_value(t: Any) -> float | None:
    """The mean over the prompts the trial ran: its value if complete; for a pruned one, the mean of its
    intermediate (per-prompt) values."""
    if t.state.name == "PRUNED" and t.intermediate_values:
        values = list(t.intermediate_values.values())
        return sum(values) / len(values)
    return t.value


def trial_row(t: Any) -> dict[str, Any]:
    return {
        "number": t.number,
        "state": t.state.name,
        "value": trial_value(t),
        "params": t.params,
        "method": t.user_attrs.get("method"),
        "default": bool(t.user_attrs.get("default")),
        "intermediate": [t.intermediate_values[k] for k in sorted(t.intermediate_values)],
    }


def format_trials(trials: list[dict[str, Any]], cfg: Config, top: int = 10) -> str:
    """The best finished trials, best first (pruned ones, with the mean of the prompts they ran, after complete
    ones)."""
    rows = sorted(
        (t for t in trials if t["state"] in FINISHED and t["value"] is not None),
        key=lambda t: (t["state"] != "COMPLETE", -t["value"]),
    )[:top]
    keys = list(dict.fromkeys(k for t in rows for k in t["params"]))
    width = {k: max(10, len(k) + 2) for k in keys}
    head = f"{'trial':>5}  {'state':<9}{cfg.sweep.objective:>9}  {'method':<20}" + "".join(
        f"{k:>{width[k]}}" for k in keys
    )
    lines = [head, "-" * len(head)]
    for t in rows:
        vals = "".join(f"{_fmt(t['params'].get(k)):>{width[k]}}" for k in keys)
        mark = " (config as written)" if t["default"] else ""
        if t["state"] == "PRUNED":
            mark += f" (mean of {len(t['intermediate'])} prompts)"
        lines.append(
            f"{t['number']:>5}  {t['state']:<9}{t['value']:>9.3f}  {str(t['method']):<20}{vals}{mark}"
        )
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if isinstance(v, float) else str(v)
