"""PNG plots of runs, sweeps and comparisons (matplotlib, Agg backend, chosen when a plot is drawn).

Each function takes plain data (records, summary rows, trial lists), writes one PNG and returns its path. A run's
plots name the machine its timings were measured on in a footer (``note``: ``experiments.records.machine_label``).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display; set here, not at import
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path, note: str = "") -> Path:
    """Write ``fig`` to ``path`` (atomically), with ``note`` as a footer line (the machine) when given."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if note:
        fig.text(0.5, 0.01, note, ha="center", va="bottom", fontsize=7, color="0.3", wrap=True)
        fig.tight_layout(rect=(0, 0.06, 1, 1))
    else:
        fig.tight_layout()
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")  # the suffix tells matplotlib the format
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)
    _plt().close(fig)
    return path


def baseline_of(methods: Sequence[str]) -> str | None:
    """The baseline speedups are shown against: our AR loop when the run has it, else HF greedy."""
    return "ar" if "ar" in methods else "hf_greedy" if "hf_greedy" in methods else None


def speedup_per_category(
    rows: list[dict[str, Any]], methods: Sequence[str], path: Path, note: str = ""
) -> Path:
    """Grouped bars: x = category (and overall), one bar per method; speedup over the baseline, else tokens/s."""
    plt = _plt()
    base = baseline_of(methods)
    key = {"ar": "speedup_vs_ar", "hf_greedy": "speedup_vs_hf"}.get(base or "", "tokens_per_s")
    shown = [m for m in methods if m != base] or list(methods)
    cats = list(dict.fromkeys(r["category"] for r in rows))
    value = {(r["category"], r["method"]): r[key] for r in rows}
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(cats) * max(1, len(shown)) ** 0.5 + 2), 4))
    width = 0.8 / len(shown)
    for j, m in enumerate(shown):
        xs = [i + (j - (len(shown) - 1) / 2) * width for i in range(len(cats))]
        ys = [value.get((c, m)) for c in cats]
        xs, ys = [x for x, y in zip(xs, ys) if y is not None], [y for y in ys if y is not None]
        ax.bar(xs, ys, width=width, label=m)  # a ratio that is undefined (no common prompt) has no bar, not 0
    if key != "tokens_per_s":
        ax.axhline(1.0, color="k", ls="--", lw=0.8)
        ax.set_ylabel(f"speedup over {base}")
    else:
        ax.set_ylabel("tokens/s")
    ax.set_xticks(range(len(cats)), cats, rotation=20, ha="right")
    ax.set_title("Speedup per category")
    ax.legend(fontsize=8)
    return _save(fig, path, note)


def tau_distribution(records: Sequence[Any], methods: Sequence[str], path: Path, note: str = "") -> Path:
    """Per-prompt tau (committed tokens per verification step) of each method: box plot and the points."""
    plt = _plt()
    by: dict[str, list[float]] = defaultdict(list)
    for r in records:
        if r.tau is not None:
            by[r.method].append(r.tau)
    shown = [m for m in methods if by.get(m)]
    fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(shown) + 2), 4))
    if shown:
        ax.boxplot([by[m] for m in shown], showfliers=False)
        ax.set_xticks(range(1, len(shown) + 1), shown)  # (boxplot's own label keyword was renamed in 3.9)
        for i, m in enumerate(shown, 1):
            n = len(by[m])
            xs = [i + 0.15 * ((k % 5) - 2) / 2 for k in range(n)]
            ax.scatter(xs, by[m], s=10, alpha=0.6)
    ax.set_ylabel("tau per prompt (tokens / step)")
    ax.set_title("tau distribution over prompts")
    ax.tick_params(axis="x", rotation=20)
    return _save(fig, path, note)


def arm_choices(
    records: Sequence[Any], methods: Sequence[str], path: Path, max_panels: int = 6, note: str = ""
) -> Path:
    """Share of prompts choosing each arm at each step of the generation, one panel per method that drafts
    (policies first: static methods are flat bands)."""
    plt = _plt()
    by: dict[str, list[list[str]]] = defaultdict(list)
    for r in records:
        if getattr(r, "arms", None) and any(a != "none" for a in r.arms):  # ar never drafts: no panel
            by[r.method].append(list(r.arms))
    shown = sorted(
        (m for m in methods if by.get(m)), key=lambda m: (not m.startswith("policy:"), methods.index(m))
    )
    shown = shown[:max_panels]
    fig, axes = plt.subplots(len(shown) or 1, 1, figsize=(7, 1.9 * max(1, len(shown)) + 0.6), squeeze=False)
    for ax, m in zip(axes[:, 0], shown):
        seqs = by[m]
        arms = list(dict.fromkeys(a for s in seqs for a in s))
        steps = max(len(s) for s in seqs)
        shares = {a: [] for a in arms}
        for t in range(steps):
            c = Counter(s[t] for s in seqs if t < len(s))
            total = sum(c.values())
            for a in arms:
                shares[a].append(c[a] / total)
        ax.stackplot(range(1, steps + 1), *[shares[a] for a in arms], labels=arms, step="post")
        ax.set_xlim(1, max(2, steps))
        ax.set_ylim(0, 1)
        ax.set_ylabel("share")
        ax.set_title(m, fontsize=9)
        ax.legend(fontsize=7, loc="upper right", ncol=min(4, len(arms)))
    if not shown:
        axes[0, 0].text(0.5, 0.5, "no method of ours in this run", ha="center", va="center")
    axes[-1, 0].set_xlabel("speculation step")
    fig.suptitle("Arm choices over the generation", fontsize=10)
    return _save(fig, path, note)


def run_plots(
    records: Sequence[Any],
    rows: list[dict[str, Any]],
    methods: Sequence[str],
    out: Path,
    machine: str = "",
) -> list[Path]:
    """A run's three plots; ``machine``: where it was measured (each plot's footer)."""
    methods = list(methods)
    note = f"measured on {machine}" if machine else ""
    return [
        speedup_per_category(rows, methods, out / "speedup_per_category.png", note),
        tau_distribution(records, methods, out / "tau_distribution.png", note),
        arm_choices(records, methods, out / "arm_choices.png", note=note),
    ]


def sweep_history(
    trials: list[dict[str, Any]], path: Path, direction: str = "maximize", note: str = ""
) -> Path:
    """Objective value per finished trial (pruned ones hollow) and the best so far; ``note``: a footer (the machine
    a live study's timings were measured on)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    done = sorted((t for t in trials if t.get("value") is not None), key=lambda t: t["number"])
    complete = [t for t in done if t["state"] == "COMPLETE"]
    pruned = [t for t in done if t["state"] == "PRUNED"]
    ax.scatter([t["number"] for t in complete], [t["value"] for t in complete], label="complete", s=18)
    if pruned:
        ax.scatter([t["number"] for t in pruned], [t["value"] for t in pruned], label="pruned", s=18,
                   facecolors="none", edgecolors="gray")  # fmt: skip
    best, xs, ys = None, [], []
    pick = max if direction == "maximize" else min
    for t in complete:
        best = t["value"] if best is None else pick(best, t["value"])
        xs.append(t["number"])
        ys.append(best)
    if xs:
        ax.step(xs, ys, where="post", color="C3", label="best so far")
    ax.set_xlabel("trial")
    ax.set_ylabel("objective")
    ax.set_title("Sweep history")
    ax.legend(fontsize=8)
    return _save(fig, path, note)


def compare_runs(runs: list[tuple[str, list[dict[str, Any]], list[str]]], path: Path, note: str = "") -> Path:
    """Overall speedup, method by method, one bar group per run: over a baseline every run has (our AR loop, else
    HF greedy), else over each run's own, named under it; ``note``: a footer (the machines the runs were measured
    on)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(runs) + 3), 4))
    keys = {"ar": "speedup_vs_ar", "hf_greedy": "speedup_vs_hf"}
    common = next((b for b in keys if all(b in ms for _, _, ms in runs)), None)
    bases = [common or baseline_of(ms) for _, _, ms in runs]
    all_methods = list(dict.fromkeys(m for (_, _, ms), b in zip(runs, bases) for m in ms if m != b))
    width = 0.8 / max(1, len(all_methods))
    for j, m in enumerate(all_methods):
        xs, ys = [], []
        for i, ((_, rows, _), b) in enumerate(zip(runs, bases)):
            key = keys.get(b or "")
            val = next((r.get(key) for r in rows if r["category"] == "overall" and r["method"] == m), None)
            if key and val is not None:
                xs.append(i + (j - (len(all_methods) - 1) / 2) * width)
                ys.append(val)
        ax.bar(xs, ys, width=width, label=m)
    ax.axhline(1.0, color="k", ls="--", lw=0.8)
    names = [name if common else f"{name}\n(x {b or 'none'})" for (name, _, _), b in zip(runs, bases)]
    ax.set_xticks(range(len(runs)), names, rotation=15, ha="right")
    ax.set_ylabel(f"overall speedup over {common}" if common else "overall speedup over the run's baseline")
    ax.set_title("Runs side by side")
    ax.legend(fontsize=8)
    return _save(fig, path, note)


def goodput_vs_concurrency(rows: list[dict[str, Any]], path: Path, title: str = "", note: str = "",
                           xlabel: str = "concurrency (requests in flight)") -> Path:  # fmt: skip
    """One line per method: goodput (committed tokens/s over all requests) against the load level (``xlabel``
    says what it is: an open-loop run's level is the batch cap); ``note``: a footer (the machine it was measured
    on)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for m in dict.fromkeys(r["method"] for r in rows):
        pts = sorted((r["concurrency"], r["goodput_tok_s"]) for r in rows if r["method"] == m)
        ax.plot([c for c, _ in pts], [g for _, g in pts], marker="o", label=m)
    ax.set_xscale("log", base=2)
    levels = sorted({r["concurrency"] for r in rows})
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel(xlabel)
    ax.set_ylabel("goodput (tokens/s, all requests)")
    ax.set_title(title or "Goodput against load")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path, note)
