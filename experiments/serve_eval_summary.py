"""The summary of ``draftgym evaluate --serve``: the replay fidelity per load (``fidelity``), each live policy
against the best static arms run by run (``paired``, over the runs and passes ``kept_runs`` and ``kept_passes``
read back on a resume) and the table it prints (``format_table``): each policy's replayed and live goodput per
load, the best static arms, the notes under it."""

from __future__ import annotations

import json
import statistics
from typing import Any

import numpy as np


def fidelity(rows: list[dict[str, Any]], probes: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per load with live cells: the median over its live policies of |replay of the served stream / live - 1|
    (``median_abs_error``) and, where the live runs were bracketed by a speed probe, the same with replay divided
    by the probe's factor (``median_abs_error_at_probe``: the cost model's error with the machine's drift since
    calibration taken out), the factor and the probe itself."""
    out: dict[str, dict[str, Any]] = {}
    for load in dict.fromkeys(r["load"] for r in rows):
        cells = [(r["replay_goodput_live_stream"], r["live_goodput"]) for r in rows
                 if r["load"] == load and r["live_goodput"] and r["replay_goodput_live_stream"]]  # fmt: skip
        if not cells:
            continue
        p = probes.get(load)
        f = float(p["factor"]) if p else None
        out[load] = {
            "policies": len(cells),
            "median_abs_error": float(np.median([abs(a / b - 1) for a, b in cells])),
            "speed_factor": f,
            "median_abs_error_at_probe": None
            if f is None
            else float(np.median([abs(a / f / b - 1) for a, b in cells])),
            "probe": p,
        }
    return out


def goodput_of(v: Any) -> float:
    """A live goodput as ``live.jsonl`` keeps it: a finite number of tokens/s >= 0 (a NaN or negative one, resumed,
    was shown in the table and written to --json)."""
    if type(v) not in (int, float) or not np.isfinite(v) or v < 0:
        raise ValueError(f"a live goodput must be a finite number >= 0, got {str(v)[:40]}")
    return float(v)


def kept_runs(v: Any, goodput: float) -> list[float]:
    """A finished live cell's runs as kept in ``live.jsonl``: finite numbers whose median is the cell's goodput
    (none in older files)."""
    if v is None:
        return []
    if (
        not isinstance(v, list)
        or not v
        or not all(type(x) in (int, float) and np.isfinite(x) and x >= 0 for x in v)
    ):
        raise ValueError("live runs must be a non-empty list of finite numbers >= 0")
    if not np.isclose(statistics.median(v), goodput, rtol=1e-9, atol=0.0):
        raise ValueError("live runs do not give the cell's median")
    return [float(x) for x in v]


LEGACY = "legacy"  # the session of runs kept by a file that tagged none: run i was made in pass i


def kept_passes(v: Any, runs: list[float]) -> list[str]:
    """A finished live cell's pass tags as kept in ``live.jsonl``, one string per run; a cell of an older file has
    none, and its run i gets ``legacy/i`` (the runs of a finished load were served in one session, pass by pass)."""
    if v is None:
        return [f"{LEGACY}/{i}" for i in range(len(runs))]
    if not isinstance(v, list) or len(v) != len(runs) or not all(type(x) is str for x in v):
        raise ValueError("live passes must be a list of strings, one per run")
    return list(v)


def _pairs(
    rs: list[float], ps: list[str] | None, base: list[float], bps: list[str] | None
) -> list[tuple[float, float]]:
    """The runs of two cells made in the same pass: by their pass tags, or by index where neither cell has tags
    (rows made without them)."""
    if ps is None and bps is None:
        return list(zip(rs, base))
    at = dict(zip(bps or (), base))
    return [(a, at[t]) for t, a in zip(ps or (), rs) if t in at]


def paired(rows: list[dict[str, Any]], best_at: dict[str, str], overall: str) -> dict[str, dict[str, Any]]:
    """Per load with live runs: each live policy's goodput over the load's best static arm, and over the best single
    static arm where that is another, run by run. Run r of every policy of a load is served in one interleaved
    pass, so a drift of the machine's speed between passes cancels in the ratio. ``paired[load][policy][static]``
    holds the median of the run-by-run ratios, their range (the noise of the comparison) and the runs paired.
    Each run carries its pass's tag (``live_passes``: the evaluation's session and the pass), so after a resume a
    pass the kill cut in two pairs only the runs made on the same side of it. A policy and a static arm with no
    pass in common (served in different sessions: a policy added to a finished ``--out``) get ``runs`` 0 and no
    ratio, said rather than left out."""
    runs = {
        (r["policy"], r["load"]): (r["live_runs"], r.get("live_passes")) for r in rows if r.get("live_runs")
    }
    out: dict[str, dict[str, Any]] = {}
    for load in dict.fromkeys(r["load"] for r in rows):
        per: dict[str, Any] = {}
        for ref in dict.fromkeys(f"static:{a}" for a in (best_at.get(load), overall) if a):
            base = runs.get((ref, load))
            for (name, x), (rs, ps) in runs.items():
                if not base or x != load or name == ref:
                    continue
                common = _pairs(rs, ps, *base)
                ratios = [a / b for a, b in common if np.isfinite(a) and np.isfinite(b) and b > 0]
                if ratios:
                    per.setdefault(name, {})[ref] = {"median": float(np.median(ratios)), "min": min(ratios),
                                                     "max": max(ratios), "runs": len(ratios)}  # fmt: skip
                elif not common:  # no pass in common (a run that is no finite number pairs with nothing)
                    per.setdefault(name, {})[ref] = {"median": None, "min": None, "max": None, "runs": 0}
        if per:
            out[load] = per
    return out


def format_table(res: dict[str, Any]) -> str:
    rows, s = res["rows"], res.get("settings", {})
    loads = list(dict.fromkeys(r["load"] for r in rows))
    names = list(dict.fromkeys(r["policy"] for r in rows))
    cell = {(r["policy"], r["load"]): r for r in rows}
    head = f"{'policy':<22}{'kind':<10}" + "".join(f"{x:>16}" for x in loads)
    lines = [f"goodput, tok/s: replay / live   [{s.get('batch_cost', '')}]", head, "-" * len(head)]
    for n in names:
        kind = next(r["kind"] for r in rows if r["policy"] == n)
        vals = []
        for x in loads:
            r = cell.get((n, x))
            if r is None:
                vals.append(f"{'':>16}")
                continue
            lv = "-" if r["live_goodput"] is None else f"{r['live_goodput']:.1f}"
            vals.append(f"{r['replay_goodput']:>9.1f}/{lv:<6}")
        lines.append(f"{n:<22}{kind:<10}" + "".join(vals))
    lines.append(
        f"best static per load: {res['best_static_per_load']}; best single static (best mean over the load "
        f"levels): {res['best_static_overall']} — both picked on these evaluation streams; oracle: the myopic "
        "per-step one (each step's best arm for the whole batch), a reference, not a bound"
    )
    priced = res.get("policy_priced") or {}
    acts = {r["policy"]: r["act_s"] for r in rows if r.get("act_s") is not None}
    if priced.get("on") and acts:
        lines.append(
            "replay charges each policy that observes its live overhead a step: its act ("
            + ", ".join(f"{n} {1e3 * a:.3f} ms" for n, a in acts.items())
            + "), the match drafter's proposals and "
            + (
                "the observation's bookkeeping (cost model)"
                if priced.get("book")
                else "no bookkeeping (the cost model has no policy_book: calibrated before it, or a roofline)"
            )
        )
    elif priced and not priced.get("on"):
        lines.append("replay charges the policies nothing for their own decisions (--no-policy-cost)")
    n_test = len(s.get("test_prompts") or [])
    for name, n in (res.get("trained_on_evaluated") or {}).items():
        lines.append(
            f"note: {name} was trained on {n} of the {n_test} prompts evaluated here (not held out)!"
        )
    for name, label in (res.get("built_under_other_cost") or {}).items():
        lines.append(
            f"note: {name} was built under the cost model {label}, evaluated under {s.get('batch_cost')}"
        )
    other = res.get("trained_with_other_drafter_options") or {}
    for name, opts in (other.get("policies") or {}).items():
        lines.append(
            f"note: {name} was trained with the drafter options {json.dumps(opts, sort_keys=True)}; this trace's "
            f"drafters, served live, have {json.dumps(other.get('trace') or {}, sort_keys=True)}"
        )
    timed = res.get("cost_timed_other_drafter_options") or {}
    if timed:
        lines.append(
            f"note: the cost model timed the drafters with the options {json.dumps(timed['cost'], sort_keys=True)};"
            f" the trace recorded {json.dumps(timed['trace'], sort_keys=True)} (calibrate --drafter-option)"
        )
    fid = res.get("fidelity") or {}
    if fid:
        lines.append(
            "replay fidelity, median |replay / live - 1| over the live policies (the served stream):"
        )
        for x, f in fid.items():
            line = f"  load {x:<8} {100 * f['median_abs_error']:5.1f}%  ({f['policies']} policies)"
            if f.get("speed_factor") is not None:
                line += (f"; machine {f['speed_factor']:.2f}x the calibration's step time (probe), "
                         f"{100 * f['median_abs_error_at_probe']:.1f}% with replay rescaled by it")  # fmt: skip
            lines.append(line)
    for x, per in (res.get("paired") or {}).items():
        lines.append(
            f"live at load {x}, against a static arm run by run (median ratio of the interleaved runs [range]):"
        )
        for name, refs in per.items():
            lines.append(f"  {name:<20} " + "; ".join(
                f"{q['median']:.3f}x {ref} [{q['min']:.3f}, {q['max']:.3f}]" if q["runs"]
                else f"{ref}: no pass in common (served in another session)" for ref, q in refs.items()))  # fmt: skip
    return "\n".join(lines)


__all__ = ["LEGACY", "fidelity", "format_table", "kept_passes", "kept_runs", "paired"]
