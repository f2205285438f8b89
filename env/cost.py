"""The cost model: seconds of one speculation step, as the env's reward needs them (DESIGN.md "Arms, observations,
rewards"), calibrated by measurement on this machine (``draftgym calibrate``) and saved as JSON.

A step costs ``draft(arm) + verify(N, context, chain)``:

- ``verify``: the engine's verification phase (tree forward over N nodes, verification, KV commit) measured
  through ``env.batch.BatchEngine.step`` (a batch of one) on a grid of N, for chains (causal attention) and branching trees
  (explicit tree mask), at two context lengths. Model: a piecewise-linear curve in N at ``context_ref`` (linear
  extrapolation past the grid) plus ``(per_context + per_node_context * N) * (context - context_ref)``;
- ``draft``: each drafter's ``propose`` time per arm shape (median over real contexts), with a linear fit in the
  shape's node count for shapes not measured.

Not priced: the drafters' feedback after a step (``observe``; the calibration's stand-in drafter has none), which
live steps pay for every drafter of the menu. Measured on the embedded model in bf16 (2-core Intel Xeon, family 6
model 167, ``amx_bf16``): at most 0.03 ms a step for n-gram, suffix, eagle, eagle3, early_exit and hybrid (0.1% of
a step), 0.5 ms for ``recycling-d4-k4-b8`` (1.6%; its update reads every verified node's logits, so it grows with
the tree).

One autoregressive token costs ``verify(1, context, chain=True)``; the reward of a step is
``tokens * ar_cost / step_cost`` (``env.metrics.step_reward``). The measurement itself is ``env.calibrate``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

import numpy as np

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
    not_a_file,
    shown,
    text,
)

FORMAT = "draftgym-cost-model"
VERSION = 1


_FLAG = {"float32": "fp32", "bfloat16": "bf16"}  # a torch dtype's name -> the --dtype option's spelling


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
    """Piecewise-linear seconds over node counts: held at the first value below the first node, extended along
    the last segment past the last node."""

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

    def check_model(self, model_id: str, dtype: str, weights: str | None = None) -> None:
        """``CostModelError`` unless calibrated for ``model_id`` in ``dtype`` and, when given, the target's weight
        format ``weights`` (``meta["weights"]``, dense when the file does not say): each format has its own curve."""
        if (self.model_id, self.dtype) != (model_id, dtype):
            raise CostModelError(
                f"the cost model was calibrated for {self.model_id} ({self.dtype}), not {model_id} ({dtype}); "
                f"run: draftgym calibrate --model ... --dtype {_FLAG.get(dtype, dtype)} --out FILE and pass it as "
                "cost_model"
            )
        built = self.meta.get("weights", "dense") if isinstance(self.meta, dict) else "dense"
        if weights is not None and built != weights:
            raise CostModelError(
                f"the cost model was calibrated for {built} weights, not {weights}; run: draftgym calibrate "
                f"--weights {weights} --out FILE and pass it as cost_model"
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
        from env.files import atomic_write_text  # (a temporary name of its own: two savers share none)

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(self.to_json(), indent=1) + "\n")
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
    if source is not None and not isinstance(source, (str, os.PathLike)):
        raise CostModelError(
            f"a cost model is a file's path, a FittedCostModel or None, not a {type(source).__name__}"
        )
    path = default_cost_model_path() if source is None else Path(source)
    if not path.is_file():
        raise CostModelError(
            f"cost model file {path} {not_a_file(path)} (make one with: draftgym calibrate --out FILE)"
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
