"""The cost model: seconds of one speculation step, as the env's reward needs them (DESIGN.md "Arms, observations,
rewards"), calibrated by measurement on this machine (``draftgym calibrate``) and saved as JSON.

A step costs ``draft(arm) + verify(N, context, chain)``:

- ``verify``: the engine's verification phase (tree forward over N nodes, verification, KV commit, drafter
  feedback) measured through ``env.batch.BatchEngine.step`` (a batch of one) on a grid of N, for chains (causal attention) and branching trees
  (explicit tree mask), at two context lengths. Model: a piecewise-linear curve in N at ``context_ref`` (linear
  extrapolation past the grid) plus ``(per_context + per_node_context * N) * (context - context_ref)``;
- ``draft``: each drafter's ``propose`` time per arm shape (median over real contexts), with a linear fit in the
  shape's node count for shapes not measured.

One autoregressive token costs ``verify(1, context, chain=True)``; the reward of a step is
``tokens * ar_cost / step_cost`` (``env.metrics.step_reward``).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from drafters import DraftContext, DraftTree, TreeShape, make_drafter
from env.engine import Arm
from env.file_checks import (
    MAX_COUNT,
    Bad,
    curve_points,
    drafter_entry,
    drafter_name,
    finite_seconds,
    get,
    integer,
    shown,
    text,
)
from env.model import LoadedModel

FORMAT = "draftgym-cost-model"
VERSION = 1
CHAIN_NODES = (1, 2, 3, 5, 9, 13, 17, 25)
TREE_NODES = (3, 5, 9, 17, 25, 33, 49, 65, 129)
LARGE = 40  # trees above this many nodes are rarer and slower: measured half as often
CONTEXTS = (128, 768)
DRAFT_SHAPES = tuple(TreeShape(d, k) for d in (1, 2, 4, 8, 16) for k in (1, 2, 4, 8))


class CostModelError(ValueError):
    """A cost model file that cannot be used; the message is meant for the user."""


class CostModel(Protocol):
    def draft_cost(self, arm: Arm) -> float: ...

    def verify_cost(self, nodes: Any, context: Any, chain: Any = True) -> Any: ...

    def step_cost(self, arm: Arm, nodes: Any, context: Any, chain: Any = True) -> Any: ...

    def ar_cost(self, context: Any) -> Any: ...

    def covers(self, arms: Sequence[Arm]) -> bool: ...


@dataclass(frozen=True)
class Curve:
    """Piecewise-linear seconds over node counts, extended linearly past both ends."""

    nodes: tuple[int, ...]
    seconds: tuple[float, ...]

    def __call__(self, n: Any) -> Any:
        x, y = np.asarray(self.nodes, dtype=np.float64), np.asarray(self.seconds, dtype=np.float64)
        n = np.asarray(n, dtype=np.float64)
        out = np.interp(n, x, y)
        if len(x) > 1:
            hi = (y[-1] - y[-2]) / (x[-1] - x[-2])
            out = np.where(n > x[-1], y[-1] + hi * (n - x[-1]), out)
        return out


@dataclass(frozen=True)
class FittedCostModel:
    model_id: str
    dtype: str
    device: str
    chain: Curve  # verify seconds at context_ref for chains
    tree: Curve  # ... and for branching trees
    context_ref: int
    per_context: float  # seconds per context token
    per_node_context: float  # seconds per node per context token
    drafters: dict[str, dict[str, Any]] = field(
        default_factory=dict
    )  # name -> {"shapes": {arm: s}, "base_s", "per_node_s"}
    meta: dict[str, Any] = field(default_factory=dict)  # machine, time, command, versions

    def verify_cost(self, nodes: Any, context: Any, chain: Any = True) -> Any:
        n = np.asarray(nodes, dtype=np.float64)
        base = np.where(chain, self.chain(n), self.tree(n))
        extra = (self.per_context + self.per_node_context * n) * (
            np.asarray(context, dtype=np.float64) - self.context_ref
        )
        return np.maximum(base + extra, 0.25 * base)

    def draft_cost(self, arm: Arm) -> float:
        if arm.drafter is None or arm.shape.depth == 0:
            return 0.0
        d = self.drafters.get(arm.drafter)
        if d is None:
            known = ", ".join(sorted(self.drafters)) or "none"
            raise CostModelError(
                f"the cost model has no calibration for drafter {arm.drafter!r} (it has: {known}); "
                f"run: draftgym calibrate --drafters {arm.drafter}"
            )
        if arm.name in d["shapes"]:
            return float(d["shapes"][arm.name])
        return float(d["base_s"] + d["per_node_s"] * arm.shape.max_nodes)

    def step_cost(self, arm: Arm, nodes: Any, context: Any, chain: Any = True) -> Any:
        return self.draft_cost(arm) + self.verify_cost(nodes, context, chain)

    def covers(self, arms: Sequence[Arm]) -> bool:
        """Whether every drafter of ``arms`` was calibrated (so ``step_cost`` prices each of them)."""
        return all(a.drafter is None or a.shape.depth == 0 or a.drafter in self.drafters for a in arms)

    def ar_cost(self, context: Any) -> Any:
        return self.verify_cost(1, context, True)

    def check_model(self, model_id: str, dtype: str) -> None:
        if (self.model_id, self.dtype) != (model_id, dtype):
            raise CostModelError(
                f"the cost model was calibrated for {self.model_id} ({self.dtype}), not {model_id} ({dtype}); "
                f"run: draftgym calibrate --model ... --dtype {dtype} --out FILE and pass it as cost_model"
            )

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "model_id": self.model_id,
            "dtype": self.dtype,
            "device": self.device,
            "verify": {
                "chain": {"nodes": list(self.chain.nodes), "seconds": list(self.chain.seconds)},
                "tree": {"nodes": list(self.tree.nodes), "seconds": list(self.tree.seconds)},
                "context_ref": self.context_ref,
                "per_context": self.per_context,
                "per_node_context": self.per_node_context,
            },
            "drafters": self.drafters,
            "meta": self.meta,
        }

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        tmp.replace(path)
        return path

    @classmethod
    def from_json(cls, d: dict[str, Any], source: str = "cost model") -> FittedCostModel:
        """A model from its ``to_json``, every field checked (a hand-edited or damaged file fails here in one line
        that names ``source`` and the field, not later in a reward): a ``CostModelError``."""
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            got = d.get("format") if isinstance(d, dict) else f"a JSON {type(d).__name__}"
            raise CostModelError(f"{source} is not a draftgym cost model (format {got!r})")
        try:
            if d.get("version", VERSION) != VERSION:
                raise Bad(
                    "version", f"must be {VERSION} (what this draftgym reads), got {shown(d['version'])}"
                )
            drafters = d.get("drafters", {})
            if not isinstance(drafters, dict):
                raise Bad(
                    "drafters", f"must be a JSON object of drafter name to calibration, got {shown(drafters)}"
                )
            meta = d.get("meta", {})
            if not isinstance(meta, dict):
                raise Bad("meta", f"must be a JSON object, got {shown(meta)}")
            return cls(
                model_id=text(d, "model_id"),
                dtype=text(d, "dtype"),
                device=text(d, "device"),
                chain=Curve(*curve_points(d, "verify.chain")),
                tree=Curve(*curve_points(d, "verify.tree")),
                context_ref=integer(get(d, "verify.context_ref"), "verify.context_ref", 0, MAX_COUNT),
                per_context=finite_seconds(get(d, "verify.per_context"), "verify.per_context"),
                per_node_context=finite_seconds(get(d, "verify.per_node_context"), "verify.per_node_context"),
                drafters={drafter_name(n): drafter_entry(e, f"drafters.{n}") for n, e in drafters.items()},
                meta=dict(meta),
            )
        except Bad as bad:
            field_name, problem = bad.args  # a key of the file may hold a line break: one line still
            raise CostModelError(" ".join(f"{source}: {field_name} {problem}".split())) from None


def default_cost_model_path() -> Path:
    return Path(str(resources.files("env") / "data" / "cost_model.json"))


def load_cost_model(source: str | Path | FittedCostModel | None = None) -> FittedCostModel:
    """``None``: the shipped model (embedded SmolLM2-135M, fp32, calibrated on the machine named in its meta)."""
    if isinstance(source, FittedCostModel):
        return source
    path = default_cost_model_path() if source is None else Path(source)
    if not path.is_file():
        raise CostModelError(
            f"cost model file {path} does not exist (make one with: draftgym calibrate --out FILE)"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as err:  # not JSON, not UTF-8, an integer too long, nested too deep
        raise CostModelError(f"cost model file {path} is not JSON ({type(err).__name__}: {err})") from err
    if not isinstance(data, dict):
        raise CostModelError(
            f"cost model file {path} is not a draftgym cost model (a JSON {type(data).__name__})"
        )
    return FittedCostModel.from_json(data, str(path))


# ---- calibration -------------------------------------------------------------------------------------------------


class _FixedTree:
    """A stand-in drafter proposing a tree of a given structure (random tokens): times the verify phase."""

    name = "_fixed"
    exact_replay = True

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.vocab = vocab
        self.gen = torch.Generator().manual_seed(seed)
        self.parents: list[int] = [-1]

    def reset(self, ctx: DraftContext) -> None:
        pass

    def propose(self, ctx: DraftContext, shape: TreeShape) -> DraftTree:
        n = len(self.parents)
        toks = torch.randint(0, self.vocab, (n,), generator=self.gen)
        toks[0] = ctx.tokens[-1]
        return DraftTree(tokens=toks, parents=torch.tensor(self.parents, dtype=torch.long))

    def observe(self, ctx: DraftContext, feedback: Any) -> None:
        pass


def tree_parents(nodes: int, chain: bool) -> list[int]:
    """A chain of ``nodes`` nodes, or a branching tree: two children under the root, then each level's nodes
    get two children (breadth first), the root's first branch extended until ``nodes``."""
    if chain or nodes < 3:
        return list(range(-1, nodes - 1))
    parents = [-1]
    frontier = [0]
    while len(parents) < nodes:
        nxt = []
        for p in frontier:
            for _ in range(2):
                if len(parents) < nodes:
                    parents.append(p)
                    nxt.append(len(parents) - 1)
        frontier = nxt
    return parents


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from env.machine import cpu_label

    info: dict[str, Any] = {
        "cpu_label": cpu_label(),
        "host": platform.node(),
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _context_ids(tokenizer: Any, length: int) -> list[int]:
    from env.workloads import load_workload

    text = " ".join(p.text for p in load_workload())
    ids = [int(i) for i in tokenizer(text)["input_ids"]]
    while len(ids) < length:
        ids = ids + ids
    return ids[:length]


def _time_verify(
    loaded: LoadedModel,
    fixed: _FixedTree,
    prompts: Sequence[list[int]],
    grid: Sequence[tuple[int, bool]],
    reps: int,
    seed: int = 0,
    tick: Callable[[], object] = lambda: None,
) -> list[tuple[int, bool, float, float]]:
    """Median verify seconds per (nodes, chain, context): one sequence per context, every (context, cell)
    measured once per pass in a shuffled order, so that a drift in machine load spreads over all cells instead
    of biasing some. Returns [(nodes, chain, mean context, median s)]."""
    from env.batch import BatchEngine

    arm = Arm("_fixed", TreeShape(depth=1))
    engines = [BatchEngine(loaded, max_rows=1) for _ in prompts]  # one sequence each: single-row steps
    seqs = [e.admit(p, {"_fixed": fixed})[0] for e, p in zip(engines, prompts)]
    fixed.parents = [-1, 0]
    for e in engines:  # warm-up
        for _ in range(2):
            e.step([arm])
    cells = [(i, n, c) for i in range(len(seqs)) for n, c in grid]
    samples: dict[tuple[int, int, bool], list[tuple[int, float]]] = {cell: [] for cell in cells}
    rng = random.Random(seed)
    for r in range(reps):
        rng.shuffle(cells)
        for i, n, c in cells:
            if n > LARGE and r % 2:
                continue
            fixed.parents = tree_parents(n, c)
            ctx = seqs[i].past_len
            samples[(i, n, c)].append((ctx, engines[i].step([arm])[0].verify_s))
            tick()
    return [
        (n, c, statistics.mean(x for x, _ in v), statistics.median(s for _, s in v))
        for (i, n, c), v in sorted(samples.items())
    ]


def isotonic(values: Sequence[float]) -> list[float]:
    """Least-squares non-decreasing fit (pool adjacent violators): more nodes never cost less."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [b[0] / b[1] for b in blocks for _ in range(int(b[1]))]


def _fit_verify(rows: list[tuple[int, bool, float, float]], context_ref: int):
    """Least squares: s = base[nodes, chain] + (a + b * nodes) * (context - ref); one base per grid cell."""
    cells = sorted({(n, c) for n, c, _, _ in rows})
    index = {cell: i for i, cell in enumerate(cells)}
    x = np.zeros((len(rows), len(cells) + 2))
    y = np.zeros(len(rows))
    for r, (n, c, ctx, s) in enumerate(rows):
        x[r, index[(n, c)]] = 1.0
        x[r, -2] = ctx - context_ref
        x[r, -1] = n * (ctx - context_ref)
        y[r] = s
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    a, b = max(float(coef[-2]), 0.0), max(float(coef[-1]), 0.0)
    base = {cell: float(coef[i]) for cell, i in index.items()}

    def curve(chain: bool) -> Curve:
        pts = sorted((n, s) for (n, c), s in base.items() if c == chain)
        ns, ss = [p[0] for p in pts], isotonic([max(p[1], 1e-6) for p in pts])
        return Curve(tuple(ns), tuple(float(s) for s in ss))

    chain_curve = curve(True)
    tree_pts = dict(zip(curve(False).nodes, curve(False).seconds))
    tree_pts.setdefault(1, chain_curve.seconds[0])  # a one-node "tree" is the root alone
    tree_curve = Curve(tuple(sorted(tree_pts)), tuple(tree_pts[k] for k in sorted(tree_pts)))
    return chain_curve, tree_curve, a, b


def _time_drafters(
    loaded: LoadedModel,
    names: Sequence[str],
    options: dict[str, dict[str, Any]],
    prompts,
    shapes,
    positions: int,
    tick: Callable[[], object] = lambda: None,
) -> dict[str, dict[str, Any]]:
    from env.batch import BatchEngine

    out: dict[str, dict[str, Any]] = {}
    for name in names:
        drafter = make_drafter(name, **options.get(name, {}))
        samples: dict[str, list[float]] = {}
        for prompt in prompts:
            engine = BatchEngine(loaded, max_rows=1)
            row, _ = engine.admit(prompt, {name: drafter})
            for _ in range(positions):
                for shape in shapes:
                    arm = Arm(name, shape)
                    t0 = time.perf_counter()
                    drafter.propose(row.ctx, shape)
                    samples.setdefault(arm.name, []).append(time.perf_counter() - t0)
                engine.step([Arm(None)])
                tick()
        med = {k: statistics.median(v) for k, v in samples.items()}
        sizes = {Arm(name, s).name: s.max_nodes for s in shapes}
        xs = np.array([sizes[k] for k in med], dtype=np.float64)
        ys = np.array(list(med.values()))
        slope, icpt = np.polyfit(xs, ys, 1) if len(set(xs.tolist())) > 1 else (0.0, float(ys.mean()))
        out[name] = {
            "shapes": {k: float(v) for k, v in med.items()},
            "base_s": float(max(icpt, 0.0)),
            "per_node_s": float(max(slope, 0.0)),
            "options": options.get(name, {}),
        }
    return out


def calibrate(
    loaded: LoadedModel,
    drafter_names: Sequence[str] = ("ngram",),
    *,
    drafter_options: dict[str, dict[str, Any]] | None = None,
    extra_shapes: Sequence[TreeShape] = (),
    reps: int = 4,
    contexts: Sequence[int] = CONTEXTS,
    chain_nodes: Sequence[int] = CHAIN_NODES,
    tree_nodes: Sequence[int] = TREE_NODES,
    draft_shapes: Sequence[TreeShape] = DRAFT_SHAPES,
    draft_prompts: int = 3,
    draft_positions: int = 4,
    progress: bool = False,
) -> FittedCostModel:
    """Measure the verify phase on a grid of tree sizes at two contexts and each drafter's propose time, then fit.
    About a minute for the embedded model on a 2-core CPU. ``progress``: a bar over the measurements on stderr (on
    a terminal)."""
    import sys

    from env.cli import progress_bar
    from env.decoder import chat_prompt
    from env.workloads import load_workload

    t_start = time.perf_counter()
    vocab = int(loaded.config.vocab_size)
    fixed = _FixedTree(vocab)
    grid = [(n, True) for n in chain_nodes] + [(n, False) for n in tree_nodes]
    names = [n for n in drafter_names if n != "none"]
    prompts = [chat_prompt(loaded.tokenizer, p.text) for p in load_workload()[:draft_prompts]]
    shapes = list(dict.fromkeys([*draft_shapes, *extra_shapes]))
    # the measurement grid: every (context, cell) once per pass (large trees every other pass), then each
    # drafter's proposals at each position of each prompt
    verify = sum(len(contexts) * sum(not (n > LARGE and r % 2) for n, _ in grid) for r in range(reps))
    bar = progress_bar(verify + len(names) * len(prompts) * draft_positions, "calibrate", progress)
    if progress:  # through the bar (which it would break otherwise)
        bar.write(f"calibrate: verify phase, {len(grid)} tree sizes x contexts {list(contexts)} x {reps}",
                  file=sys.stdout)  # fmt: skip
    ids = [_context_ids(loaded.tokenizer, c) for c in contexts]
    rows = _time_verify(loaded, fixed, ids, grid, reps, tick=lambda: bar.update(1))
    context_ref = int(contexts[0])
    chain, tree, a, b = _fit_verify(rows, context_ref)
    if progress:
        bar.write(f"calibrate: drafters {', '.join(drafter_names) or '(none)'}", file=sys.stdout)
    drafters = _time_drafters(
        loaded, names, drafter_options or {}, prompts, shapes, draft_positions, tick=lambda: bar.update(1)
    )
    bar.close()
    meta = {
        "machine": machine_info(),
        "weights": getattr(loaded, "weights", "dense"),  # the target's format (env.lean): its own curve
        "forward": getattr(loaded, "forward", "hf"),
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "calibration_s": round(time.perf_counter() - t_start, 1),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "reps": reps,
        "contexts": list(contexts),
        "measurements": [[n, bool(c), round(ctx, 1), s] for n, c, ctx, s in rows],
    }
    return FittedCostModel(
        model_id=loaded.model_id,
        dtype=str(loaded.dtype).removeprefix("torch."),
        device=str(loaded.device),
        chain=chain,
        tree=tree,
        context_ref=context_ref,
        per_context=a,
        per_node_context=b,
        drafters=drafters,
        meta=meta,
    )
