"""Batch cost models: seconds of one batch step of the engine over ``rows`` sequences, each verifying a tree padded
to ``nodes`` nodes (1: a plain autoregressive step) at a past length of ``context`` tokens (``step_context``: the
longest row's on our engine, the mean on a paged one), plus the drafters' proposals for the rows that draft and the
prefill of an entering request. The serving env (``env.serve_env``) prices every step with one; ``draftgym
calibrate --batch`` fits one on this machine (``env.batch_calibrate``).

Two kinds, one interface (``BatchCost``):

- ``FittedBatchCost``: measured on this machine through ``env.batch.BatchEngine.step`` (propose, one target
  forward, verification, commit) on a grid of rows x nodes at two contexts; bilinear in (rows, nodes), extended
  linearly past the grid, linear in context (a slope per grid cell); prefill a curve over prompt length; each
  drafter's propose time per row, or for a drafter that drafts a batch's rows together (a model head) its time
  per batch, fixed plus per tree level, over rows (``BatchedDraft``). Saved as JSON with provenance (machine,
  model, weight format, times).
- ``RooflineCost`` (``env.roofline``): an analytic model of a named accelerator running a named model size
  (``roofline:h200/llama-3.1-8b``): a forward costs a fixed overhead plus the larger of (bytes of weights and KV
  read) / bandwidth and FLOPs / peak, each at an achievable fraction. Simulated: every figure made with one says
  so (``label``).

Both are plain numbers: a file is read as JSON and checked, never run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from drafters.base import shown
from env.cost import CostModelError, Curve
from env.file_checks import MAX_SECONDS, not_a_file, one_line

FORMAT = "draftgym-batch-cost-model"
ROOFLINE_FORMAT = "draftgym-roofline-cost-model"


class BatchCost(Protocol):
    label: str  # what the figures name: the machine measured, or "roofline:ACC/MODEL (simulated)"
    simulated: bool
    # the context a step is priced at: the longest row's (True: the engine pads every row's attention to it, as
    # ours does) or the rows' mean (False: a paged-attention engine reads each row's own keys); see step_context
    padded_context: bool

    def forward_s(self, rows: Any, nodes: Any, context: Any) -> Any: ...

    def draft_s(self, drafter: str | None, rows: Any, depth: Any = 1) -> Any: ...

    def prefill_s(self, tokens: Any) -> Any: ...

    # (optional: ``policy_book_s(rows)``, the serving policy's own bookkeeping a step costs; ``catch_up_s(drafter,
    # rows, tokens)``, a model head's catch-up on ``tokens`` tokens past the last step's commits; absent: not priced)


def step_s(cost: BatchCost, rows: Any, nodes: Any, context: Any, draft_rows: Mapping[str, Any],
           depths: Mapping[str, Any] | None = None) -> Any:  # fmt: skip
    """A batch step: the forward of ``rows`` x ``nodes`` plus each drafter's proposals (``draft_rows``: drafter ->
    rows that drafted with it; ``depths``: drafter -> the deepest of their drafts, default 1)."""
    out = np.asarray(cost.forward_s(rows, nodes, context), dtype=np.float64)
    for name, n in draft_rows.items():
        out = out + cost.draft_s(name, n, (depths or {}).get(name, 1))
    return out


@dataclass(frozen=True)
class BatchedDraft:
    """A drafter that drafts every row of a batch in one pass per tree level (a model head, ``drafters.
    BatchProposer``): ``rows`` rows drafting trees up to ``depth`` levels deep cost ``fixed(rows) + depth *
    level(rows)`` -- measured at the grid ``rows``, linear between its points and extended linearly past the last
    two (the fixed part: the head catching up on the tokens the last step committed). ``catch_s``: seconds per
    token of the batch's catch-up past that, at the grid ``rows`` (a head catches up on every token since its row's
    last proposal with it: the prompt at a row's first, the plain steps' tokens after them); None in files from
    before it: not priced."""

    rows: tuple[int, ...]
    fixed_s: tuple[float, ...]
    level_s: tuple[float, ...]
    catch_s: tuple[float, ...] | None = None

    def __call__(self, rows: Any, depth: Any) -> Any:
        r = np.asarray(rows, np.float64)
        gx = np.asarray(self.rows, np.float64)
        cost = _line(gx, np.asarray(self.fixed_s), r) + np.asarray(depth, np.float64) * _line(
            gx, np.asarray(self.level_s), r
        )
        return np.where(r > 0, cost, 0.0)

    def catch_up(self, rows: Any, tokens: Any) -> Any:
        """Seconds of catching ``rows`` rows up on ``tokens`` tokens (their sum) past the last step's commits."""
        r = np.asarray(rows, np.float64)
        if self.catch_s is None:
            return np.zeros_like(r)
        per = _line(np.asarray(self.rows, np.float64), np.asarray(self.catch_s), r)
        return np.where(r > 0, np.maximum(per, 0.0) * np.asarray(tokens, np.float64), 0.0)

    def to_json(self) -> dict[str, Any]:
        out = {"rows": list(self.rows), "fixed_s": list(self.fixed_s), "level_s": list(self.level_s)}
        # (absent in a file made before it: it keeps its digest)
        return out if self.catch_s is None else out | {"catch_s_per_token": list(self.catch_s)}

    @classmethod
    def from_json(cls, d: Any, source: str) -> BatchedDraft:
        try:
            rows, fixed, level = d["rows"], d["fixed_s"], d["level_s"]
            if not all(isinstance(x, list) for x in (rows, fixed, level)):
                raise TypeError("rows, fixed_s and level_s must be lists")
            if not all(isinstance(r, int) and not isinstance(r, bool) and 1 <= r <= 1 << 20 for r in rows):
                raise ValueError("rows must be whole numbers in [1, 1048576]")
            catch = d.get("catch_s_per_token")
            if catch is not None and not isinstance(catch, list):
                raise TypeError("catch_s_per_token must be a list")
            out = cls(tuple(rows), tuple(float(x) for x in fixed), tuple(float(x) for x in level),
                      None if catch is None else tuple(float(x) for x in catch))  # fmt: skip
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as err:
            raise CostModelError(f"{source} is malformed ({repr(err)[:120]})") from None
        n = len(out.rows)
        if n < 1 or len(out.fixed_s) != n or len(out.level_s) != n or sorted(set(out.rows)) != list(out.rows):
            raise CostModelError(f"{source}: rows must be increasing, with one fixed_s and one level_s each")
        values = np.asarray(out.fixed_s + out.level_s)
        if not np.isfinite(values).all() or (values < 0).any() or (values > 10.0).any():
            raise CostModelError(f"{source}: fixed_s and level_s must be finite seconds in [0, 10]")
        if (np.diff(out.fixed_s) < 0).any() or (np.diff(out.level_s) < 0).any():
            raise CostModelError(f"{source}: fixed_s and level_s must not fall with more rows")
        if out.catch_s is not None:
            c = np.asarray(out.catch_s)
            if len(c) != n or not np.isfinite(c).all() or (c < 0).any() or (c > 1.0).any():
                raise CostModelError(
                    f"{source}: catch_s_per_token must be finite seconds in [0, 1], one per row count"
                )
        return out


def _line(gx: np.ndarray, gy: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Linear interpolation, extended linearly past the last point (flat below the first)."""
    out = np.interp(x, gx, gy)
    if len(gx) > 1:
        out = out + max((gy[-1] - gy[-2]) / (gx[-1] - gx[-2]), 0.0) * np.maximum(x - gx[-1], 0.0)
    return out


def step_context(cost: BatchCost, context: np.ndarray, active: np.ndarray) -> np.ndarray:
    """The context ``[E]`` a batch step of rows ``[E, M]`` (``context`` per row, ``active`` mask) is priced at:
    the longest active row's where ``cost.padded_context`` (our engine attends every row over the longest row's
    span: ragged rows cost as if all were that long), else the active rows' mean; 0 for a batch without rows."""
    if getattr(cost, "padded_context", False):
        return np.where(active, context, 0).max(1)
    return (context * active).sum(1) / np.maximum(active.sum(1), 1)


# the integer (rows, nodes) whose base and slope a fitted model keeps in a table
GRID_ROWS, GRID_NODES = 65, 513


def _axis(grid: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Lower grid index and weight of ``x`` (weights past [0, 1] extend the end segments linearly)."""
    if len(grid) == 1:
        return np.zeros(x.shape, np.int64), np.zeros(x.shape)
    i = np.clip(np.searchsorted(grid, x, side="right") - 1, 0, len(grid) - 2)
    return i, (x - grid[i]) / (grid[i + 1] - grid[i])


def bilinear(gx: np.ndarray, gy: np.ndarray, values: np.ndarray, x: Any, y: Any) -> np.ndarray:
    """``values[i, j]`` at (gx[i], gy[j]), interpolated at (x, y) (broadcast) within the grid; past its last row
    (node), plus the last row (node) segment's slope times the distance — that slope taken at the point's node
    (row), as a running maximum over nodes (rows). On a grid that never falls (``calibrate --batch`` fits it so)
    the result never falls along either axis anywhere: extending each cell's own segments (bilinear weights past
    [0, 1]) made 2 rows cheaper than 1 at 25 nodes, where the row segment is steeper at 6 nodes than at 9."""
    x, y = np.broadcast_arrays(np.asarray(x, np.float64), np.asarray(y, np.float64))
    cx, cy = np.minimum(x, gx[-1]), np.minimum(y, gy[-1])
    i, wx = _axis(gx, cx)
    j, wy = _axis(gy, cy)
    i1, j1 = np.minimum(i + 1, len(gx) - 1), np.minimum(j + 1, len(gy) - 1)  # a one-point axis: weight 0
    v00, v10 = values[i, j], values[i1, j]
    v01, v11 = values[i, j1], values[i1, j1]
    out = (v00 * (1 - wx) + v10 * wx) * (1 - wy) + (v01 * (1 - wx) + v11 * wx) * wy
    if len(gx) > 1:  # per node column, the last row segment's slope, never falling with more nodes
        rs = np.maximum.accumulate((values[-1, :] - values[-2, :]) / (gx[-1] - gx[-2]))
        out = out + np.interp(cy, gy, rs) * np.maximum(x - gx[-1], 0.0)
    if len(gy) > 1:  # per row, the last node segment's slope, never falling with more rows
        ns = np.maximum.accumulate((values[:, -1] - values[:, -2]) / (gy[-1] - gy[-2]))
        out = out + np.interp(cx, gx, ns) * np.maximum(y - gy[-1], 0.0)
    return out


@dataclass(frozen=True)
class FittedBatchCost:
    model_id: str
    dtype: str
    weights: str
    rows: tuple[int, ...]
    nodes: tuple[int, ...]
    context_ref: int
    base: np.ndarray  # [R, N] seconds of a step at context_ref
    slope: np.ndarray  # [R, N] seconds per token of mean context
    prefill: Curve  # seconds of a prefill over prompt tokens
    drafters: dict[str, float] = field(default_factory=dict)  # name -> propose seconds per row
    meta: dict[str, Any] = field(default_factory=dict)
    # name -> its batched proposal (a model head drafts a batch's rows together)
    batched: dict[str, BatchedDraft] = field(default_factory=dict)
    simulated: bool = False
    padded_context: bool = True  # measured on our engine: ragged rows attend over the longest row's span
    # seconds over rows of a serving policy's bookkeeping a live step pays (``env.serve_obs.LiveObserver``: the
    # observation, but for the match drafter's proposals, priced as its own; the action read; the record); None
    # in files from before it: not priced
    policy_book: Curve | None = None
    # base and slope at every integer (rows, nodes) of GRID_ROWS x GRID_NODES, made at the first call that asks
    # (``_base_slope``)
    _grid: list[np.ndarray] = field(default_factory=list, init=False, repr=False, compare=False)

    @property
    def label(self) -> str:
        m = self.meta.get("machine", {})
        return f"measured: {m.get('cpu_label') or m.get('cpu', 'this machine')}, {self.dtype}/{self.weights}"

    def _base_slope(self, rows: Any, nodes: Any) -> tuple[np.ndarray, np.ndarray]:
        """``base`` and ``slope`` at (rows, nodes). Integer arrays of one shape within the table (a replay step's:
        rows 0..GRID_ROWS - 1, nodes 0..GRID_NODES - 1) are read from it: ``bilinear`` computes each point on its
        own, so the table holds the numbers it would compute there, bit for bit, at a tenth of the time."""
        r, n = np.asarray(rows), np.asarray(nodes)
        if r.size and r.ndim and r.shape == n.shape and r.dtype.kind in "iu" and n.dtype.kind in "iu":
            if not self._grid:
                ri, ni = np.arange(GRID_ROWS)[:, None], np.arange(GRID_NODES)[None, :]
                self._grid[:] = self._bilinear(ri, ni)  # whole at once (two threads may both build it)
            tb, ts = self._grid
            if r.min() >= 0 and n.min() >= 0 and r.max() < GRID_ROWS and n.max() < GRID_NODES:
                return tb[r, n], ts[r, n]
        return self._bilinear(rows, nodes)

    def _bilinear(self, rows: Any, nodes: Any) -> tuple[np.ndarray, np.ndarray]:
        gx, gy = np.asarray(self.rows, np.float64), np.asarray(self.nodes, np.float64)
        return bilinear(gx, gy, self.base, rows, nodes), bilinear(gx, gy, self.slope, rows, nodes)

    def forward_s(self, rows: Any, nodes: Any, context: Any) -> Any:
        base, slope = self._base_slope(rows, nodes)
        # not extrapolated below the shortest context measured: base and slope are each fitted monotone in nodes,
        # but base - slope * (context_ref - context) is not, and priced a larger tree below a smaller one there
        context = np.maximum(np.asarray(context, np.float64), self.context_ref)
        out = base + slope * (context - self.context_ref)
        return np.maximum(out, 0.25 * np.maximum(base, 1e-6))

    def draft_s(self, drafter: str | None, rows: Any, depth: Any = 1) -> Any:
        """Seconds of ``drafter``'s proposals for ``rows`` rows whose deepest tree has ``depth`` levels: per row
        for a drafter that proposes one row at a time, per level of the batch for a batched one."""
        if drafter is None:
            return np.zeros_like(np.asarray(rows, np.float64))
        if drafter in self.batched:
            return self.batched[drafter](rows, depth)
        if drafter not in self.drafters:
            known = ", ".join(sorted(self.drafters)) or "none"
            raise CostModelError(
                f"the batch cost model has no calibration for drafter {drafter!r} (it has: {known}); "
                f"run: draftgym calibrate --batch --drafters {drafter}"
            )
        return self.drafters[drafter] * np.asarray(rows, np.float64)

    def catch_up_s(self, drafter: str | None, rows: Any, tokens: Any) -> Any:
        """Seconds a batched drafter's proposal for ``rows`` rows adds for catching up on ``tokens`` tokens (their
        sum) committed before the last step since each row's last proposal with it (0 for another drafter, or
        where the file has no measurement of it)."""
        b = self.batched.get(drafter) if drafter is not None else None
        return np.zeros_like(np.asarray(rows, np.float64)) if b is None else b.catch_up(rows, tokens)

    def prefill_s(self, tokens: Any) -> Any:
        return np.maximum(self.prefill(tokens), 1e-6)

    def policy_book_s(self, rows: Any) -> Any:
        """Seconds a serving policy's bookkeeping adds to a live step of ``rows`` rows (0 without rows, or where the
        file has no measurement of it): what replay charges a policy that observes (``ServeSim.price_policy``)."""
        r = np.asarray(rows, np.float64)
        if self.policy_book is None:
            return np.zeros_like(r)
        return np.where(r > 0, np.maximum(self.policy_book(r), 0.0), 0.0)

    def to_json(self) -> dict[str, Any]:
        return (
            {
                "format": FORMAT,
                "version": 1,
                "model_id": self.model_id,
                "dtype": self.dtype,
                "weights": self.weights,
                "rows": list(self.rows),
                "nodes": list(self.nodes),
                "context_ref": self.context_ref,
                "base_s": self.base.tolist(),
                "slope_s_per_token": self.slope.tolist(),
                "prefill": {"tokens": list(self.prefill.nodes), "seconds": list(self.prefill.seconds)},
                "drafters_s_per_row": self.drafters,
                "padded_context": self.padded_context,
                "meta": self.meta,
            }
            | (  # (absent where no drafter batches: a model without keeps its digest)
                {"drafters_batched": {k: v.to_json() for k, v in self.batched.items()}}
                if self.batched
                else {}
            )
            | (  # (absent in a model made before it: it keeps its digest)
                {}
                if self.policy_book is None
                else {
                    "policy_book": {
                        "rows": list(self.policy_book.nodes),
                        "seconds": list(self.policy_book.seconds),
                    }
                }
            )
        )

    @classmethod
    def from_json(cls, d: dict[str, Any], source: str = "batch cost model") -> FittedBatchCost:
        try:
            if d.get("version", 1) != 1 or isinstance(d.get("version"), bool):
                raise CostModelError(
                    f"{source}: version {shown(d.get('version'))} is not one this draftgym reads (1)"
                )
            rows = _counts(d["rows"], "rows")
            nodes = _counts(d["nodes"], "nodes")
            ref = d["context_ref"]
            if not _is_count(ref):
                raise ValueError(f"context_ref must be a positive integer, got {str(ref)[:40]}")
            for key, valid in (("dtype", DTYPES), ("weights", WEIGHTS)):
                if key in d and d[key] not in valid:
                    raise ValueError(f"{key} must be one of {', '.join(valid)}, got {str(d[key])[:40]!r}")
            base = np.asarray(_numbers(d["base_s"], "base_s", 2), dtype=np.float64)
            slope = np.asarray(_numbers(d["slope_s_per_token"], "slope_s_per_token", 2), dtype=np.float64)
            pf = d["prefill"]
            prefill = Curve(_counts(pf["tokens"], "prefill.tokens"),
                            tuple(float(s) for s in _numbers(pf["seconds"], "prefill.seconds", 1)))  # fmt: skip
            drafters = {str(k): float(_numbers(v, f"drafters_s_per_row.{str(k)[:40]}", 0))
                        for k, v in dict(d.get("drafters_s_per_row", {})).items()}  # fmt: skip
            batched = {  # files before it: every drafter priced per row
                str(k): BatchedDraft.from_json(v, f"{source}: drafters_batched.{str(k)[:60]}")
                for k, v in dict(d.get("drafters_batched", {})).items()
            }
            padded = d.get("padded_context", True)  # files before it: measured on our engine, which pads
            if not isinstance(padded, bool):
                raise TypeError("padded_context must be true or false")
            book = _policy_book(d.get("policy_book"), f"{source}: policy_book")  # files before it: none
            out = cls(str(d["model_id"]), str(d["dtype"]), str(d.get("weights", "dense")), rows, nodes,
                      int(ref), base, slope, prefill, drafters, _meta(d.get("meta", {}), source),
                      batched=batched, padded_context=padded, policy_book=book)  # fmt: skip
        except CostModelError:
            raise  # (a batched drafter's entry, named there)
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as err:
            raise CostModelError(f"{source} is malformed ({err!r})") from err
        shape = (len(rows), len(nodes))
        if base.shape != shape or slope.shape != shape:
            raise CostModelError(f"{source}: base_s and slope_s_per_token must be {shape} grids")
        if (
            not rows
            or not nodes
            or sorted(set(rows)) != list(rows)
            or sorted(set(nodes)) != list(nodes)
            or rows[0] < 1
            or nodes[0] < 1
        ):
            raise CostModelError(f"{source}: rows and nodes must be increasing positive integers")
        values = [base, slope, np.asarray(prefill.seconds), np.asarray(list(drafters.values()) or [0.0])]
        if (
            not all(np.isfinite(v).all() for v in values)
            or (base <= 0).any()
            or (np.asarray(prefill.seconds) <= 0).any()
            or any((v < 0).any() for v in values)
            or any((v > MAX_SECONDS).any() for v in values)
        ):
            raise CostModelError(
                f"{source}: costs must be finite and positive seconds, at most {MAX_SECONDS:g}"
            )
        # calibrate --batch fits them monotone: more rows, more nodes or a longer prompt never cost less (a
        # falling grid extrapolates past its last point to a step that costs nothing)
        if (
            any((np.diff(g, axis=a) < 0).any() for g in (base, slope) for a in (0, 1))
            or (np.diff(np.asarray(prefill.seconds)) < 0).any()
        ):
            raise CostModelError(f"{source}: costs must not fall with more rows, nodes or prompt tokens")
        if (
            len(prefill.nodes) < 1
            or len(prefill.nodes) != len(prefill.seconds)
            or sorted(set(prefill.nodes)) != list(prefill.nodes)
        ):
            raise CostModelError(f"{source}: prefill tokens must be increasing, one time for each")
        return out

    def save(self, path: str | Path) -> Path:
        from env.files import atomic_write_text

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(self.to_json(), indent=1) + "\n")
        return path


DTYPES = ("float32", "bfloat16", "float16")  # a fitted model's target dtype, as calibrate --batch writes it
WEIGHTS = ("dense", "int8", "int4")
MAX_GRID = 1 << 20  # rows or nodes per row a grid may name


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= MAX_GRID


def _numbers(v: Any, name: str, depth: int) -> Any:
    """``v`` when it is a JSON number (``depth`` 0), a list of them (1) or a list of such lists (2): a string "0.1"
    was read as a number, and a boolean as 0 or 1."""
    ok = (
        isinstance(v, (int, float)) and not isinstance(v, bool)
        if depth == 0
        else isinstance(v, list) and all(_numbers(x, name, depth - 1) is x for x in v)
    )
    if not ok:
        raise ValueError(f"{name} must be {('a number', 'a list of numbers', 'a grid of numbers')[depth]}")
    return v


def _counts(xs: Any, name: str) -> tuple[int, ...]:
    """A grid axis: a list of positive integers (not floats, not booleans, at most ``MAX_GRID``)."""
    if not isinstance(xs, list) or not all(_is_count(x) for x in xs):
        raise ValueError(f"{name} must be a list of integers from 1 to {MAX_GRID}")
    return tuple(xs)


def _meta(meta: Any, source: str) -> dict[str, Any]:
    """A fitted model's provenance: an object; the parts read back -- ``machine`` (an object of its CPU's names)
    and ``drafter_options`` (drafter -> the options it was timed with) -- of their types; the rest is kept as is
    (``probe`` is read defensively, ``env.batch_calibrate.probe_reference``)."""
    if not isinstance(meta, dict):
        raise CostModelError(f"{source}: meta must be an object")
    machine = meta.get("machine", {})
    if not isinstance(machine, dict) or not all(
        isinstance(machine.get(k), (str, type(None))) for k in ("cpu_label", "cpu")
    ):
        raise CostModelError(f"{source}: meta.machine must be an object whose cpu_label and cpu are strings")
    opts = meta.get("drafter_options")
    if opts is not None and (
        not isinstance(opts, dict) or not all(isinstance(v, dict) for v in opts.values())
    ):
        raise CostModelError(f"{source}: meta.drafter_options must map each drafter to an object of options")
    return dict(meta)


def _policy_book(d: Any, source: str) -> Curve | None:
    """The ``policy_book`` entry of a fitted file: ``{"rows": [...], "seconds": [...]}``, rows increasing whole
    numbers, seconds finite in [0, 1] and not falling with more rows; None where absent."""
    if d is None:
        return None
    if not isinstance(d, dict) or set(d) != {"rows", "seconds"}:
        raise CostModelError(f"{source} must be an object with rows and seconds")
    rows, secs = d["rows"], d["seconds"]
    if not isinstance(rows, list) or not isinstance(secs, list) or not rows or len(rows) != len(secs):
        raise CostModelError(f"{source}: rows and seconds must be lists of one length")
    if not all(isinstance(r, int) and not isinstance(r, bool) and 1 <= r <= 1 << 20 for r in rows) or sorted(
        set(rows)
    ) != list(rows):
        raise CostModelError(f"{source}: rows must be increasing whole numbers in [1, 1048576]")
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in secs):
        raise CostModelError(f"{source}: seconds must be numbers")
    values = np.asarray(secs, np.float64)
    if not np.isfinite(values).all() or (values < 0).any() or (values > 1.0).any():
        raise CostModelError(f"{source}: seconds must be finite, in [0, 1]")
    if (np.diff(values) < 0).any():
        raise CostModelError(f"{source}: seconds must not fall with more rows")
    return Curve(tuple(rows), tuple(float(x) for x in secs))


def cost_digest(cost: BatchCost) -> str:
    """sha256 of a batch cost model's JSON (canonical: sorted keys): which model, where two calibrations of one
    machine share their ``label``."""
    import hashlib

    text = json.dumps(cost.to_json(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def default_batch_cost_path() -> Path:
    from importlib import resources

    return Path(str(resources.files("env") / "data" / "batch_cost.json"))


def load_batch_cost(source: str | Path | BatchCost | None = None) -> BatchCost:
    """``None``: the shipped fitted model (embedded SmolLM2-135M, calibrated on the machine its meta names);
    ``roofline:ACC/MODEL``: a named roofline model (simulated); else a JSON file of either kind."""
    from env.roofline import ACCELERATORS, MODELS, RooflineCost, roofline

    if source is not None and not isinstance(source, (str, os.PathLike)):
        if not all(callable(getattr(source, m, None)) for m in ("forward_s", "draft_s", "prefill_s")):
            raise CostModelError(
                f"a batch cost model is a path, 'roofline:ACC/MODEL' or a model with forward_s, draft_s and "
                f"prefill_s, got {type(source).__name__} {source!r:.60}"
            )
        return source
    if isinstance(source, str) and source.startswith("roofline:"):
        acc, slash, model = source.removeprefix("roofline:").partition("/")
        if (
            slash and not model
        ):  # "roofline:h200/": a model meant, none named (not the default taken silently)
            raise CostModelError(f"{source} names no model after '/'; valid: {', '.join(MODELS)}")
        return roofline(acc, model or "llama-3.1-8b")
    path = default_batch_cost_path() if source is None else Path(source)
    if not path.is_file():
        raise CostModelError(
            f"batch cost model {path} {not_a_file(path)} (make one with: draftgym calibrate --batch --out FILE, "
            f"or name a roofline model: roofline:{'|'.join(ACCELERATORS)}/{'|'.join(MODELS)})"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError, OSError) as err:  # JSON's and UTF-8's errors are ValueErrors
        raise CostModelError(one_line(f"batch cost model {path} is not JSON ({err})")) from None
    if not isinstance(data, dict):
        raise CostModelError(f"batch cost model {path} is not a draftgym batch cost model")
    if data.get("format") == FORMAT:
        return FittedBatchCost.from_json(data, str(path))
    if data.get("format") == ROOFLINE_FORMAT:
        return RooflineCost.from_json(data, str(path))
    raise CostModelError(f"{path} is not a draftgym batch cost model (format {data.get('format')!r})")


__all__ = ["FORMAT", "ROOFLINE_FORMAT", "BatchCost", "BatchedDraft", "FittedBatchCost", "cost_digest", "load_batch_cost",
           "step_context", "step_s"]  # fmt: skip
