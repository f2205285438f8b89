"""The data of a speculation step: the arm a policy picks (drafter x tree shape), the sampling settings and what a
step gives back. The step itself (propose -> tree forward -> verify -> commit -> observe, DESIGN.md) is
``env.batch.BatchEngine``; ``env.step.Stepper`` owns the bookkeeping around it for every caller.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from drafters import TreeShape
from kernels.common import MIN_TEMPERATURE, check_sampling_settings


@dataclass(frozen=True)
class Arm:
    """A choice the policy makes each step: a drafter and a tree shape, or no draft (``drafter is None``)."""

    drafter: str | None
    shape: TreeShape = TreeShape(depth=0)

    @property
    def name(self) -> str:
        if self.drafter is None or self.shape.depth == 0:
            return "none"
        s = self.shape
        tail = f"-k{s.topk}" if s.topk > 1 else ""
        tail += f"-b{s.budget}" if s.budget and s.budget < s.depth * max(s.topk, 1) else ""
        return f"{self.drafter}-d{s.depth}{tail}"


NO_DRAFT = Arm(drafter=None)


@dataclass(frozen=True)
class Sampling:
    """Greedy when ``temperature == 0`` (0 < T < 2**-100 is refused); else temperature, then top-k, then top-p
    (Hugging Face order)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        """The kernels' settings check (``kernels.common.check_sampling_settings``: types, finite, ranges; a wrong
        type is a ``ValueError`` here too, as a setting read from a config is), and a rule of the engine's own."""
        try:
            check_sampling_settings(self.temperature, self.top_k, self.top_p, top_p_zero=False)
        except TypeError as err:
            raise ValueError(str(err)) from None
        if 0 < self.temperature < MIN_TEMPERATURE:  # the kernels verify greedily there: one rule, not two
            raise ValueError(
                f"temperature {self.temperature!r} is below 2**-100, where logits / T leaves float32: use 0 (greedy)"
            )


@dataclass(frozen=True)
class StepResult:
    arm: Arm
    committed: list[int]  # accepted draft tokens + the bonus token
    accepted: int  # accepted draft tokens (bonus excluded)
    drafted: int  # draft nodes in the verified tree (root excluded)
    draft_s: float  # this row's drafting
    verify_s: float  # the step's forward, verification and commit (shared by the rows of a batch)
    parents: torch.Tensor | None = None  # [N] the verified tree's parents (its shape: chain or branching)
    rejected: bool = (
        False  # a draft was rejected: the accepted path ends at a node with children (not a leaf)
    )

    @property
    def chain(self) -> bool:
        """The verified tree was a chain (the root alone included)."""
        p = self.parents
        return p is None or bool(torch.equal(p, torch.arange(-1, p.shape[0] - 1)))

    @property
    def tokens(self) -> int:
        return len(self.committed)

    @property
    def wall_s(self) -> float:
        return self.draft_s + self.verify_s


def split_weights(method: str) -> tuple[str, str | None]:
    """A benchmark method ``ARM@VARIANT``: the arm, decoded by the target in that variant for the whole run
    (``env.model.with_weights``). The variant is a weight format (``ar@int4``, ``ngram-d8@int8``), optionally with
    the compiled forward (``ar@int4+compiled``; ``ar@compiled``: the loaded format, compiled); no ``@``: the target
    as loaded (None)."""
    from drafters import DrafterError
    from env.model import ModelError, parse_variant

    if "@" not in method:
        return method, None
    base, variant = method.rsplit("@", 1)
    try:
        parse_variant(variant)
    except ModelError as err:
        raise DrafterError(f"method {method!r}: {err}") from None
    return base, variant


def as_arm(entry: Any) -> Arm:
    """An arm given as an ``Arm`` or its name (``parse_arm``): an ``Arm`` built by hand gets the checks a name gets
    (a registered drafter, the shape within an arm's bounds: ``TreeShape(999)`` drafted 600 nodes a step)."""
    from drafters import DRAFTERS, DrafterError

    if isinstance(entry, str):
        return parse_arm(entry)
    if not isinstance(entry, Arm):
        raise DrafterError(
            f"an arm is an Arm or its name (e.g. 'ngram-d4'), got {type(entry).__name__} {entry!r:.60}"
        )
    if entry.drafter is not None and (not isinstance(entry.drafter, str) or entry.drafter not in DRAFTERS):
        raise DrafterError(
            f"arm {entry!r:.80} names an unknown drafter; known drafters: {', '.join(sorted(DRAFTERS))}"
        )
    if not isinstance(entry.shape, TreeShape):
        raise DrafterError(f"arm of {entry.drafter}: its shape is not a TreeShape, got {entry.shape!r:.60}")
    entry.shape.arm_shape(f"arm {entry.name}")
    return entry


def parse_arm(name: str) -> Arm:
    """Inverse of ``Arm.name``: ``none`` | ``{drafter}-d{depth}[-k{topk}][-b{budget}]`` (e.g. ``ngram-d8-k3-b16``)."""
    from drafters import DRAFTERS, DrafterError

    if not isinstance(name, str):
        raise DrafterError(
            f"an arm name is a string (e.g. 'ngram-d4'), got {type(name).__name__} {name!r:.60}"
        )
    if name in ("none", "ar"):
        return NO_DRAFT
    drafter, *parts = name.split("-")
    if drafter not in DRAFTERS:
        known = ", ".join(sorted(DRAFTERS))
        raise DrafterError(
            f"arm {name!r} names an unknown drafter {drafter!r}; known drafters: {known}, or none"
        )
    vals = {"d": None, "k": 1, "b": 0}
    seen = set()
    for part in parts:
        key, num = part[:1], part[1:]
        if key not in vals or not num.isascii() or not num.lstrip("-").isdigit() or key in seen:
            raise DrafterError(f"cannot read arm {name!r}; expected none or DRAFTER-dDEPTH[-kTOPK][-bBUDGET]")
        seen.add(key)
        vals[key] = int(num)
    if vals["d"] is None:
        raise DrafterError(f"arm {name!r} has no depth; expected DRAFTER-dDEPTH[-kTOPK][-bBUDGET]")
    if vals["d"] <= 0:
        raise DrafterError(f"arm {name!r}: depth must be >= 1 (use 'none' for no draft)")
    return Arm(
        drafter, TreeShape(depth=vals["d"], topk=vals["k"], budget=vals["b"]).arm_shape(f"arm {name!r}")
    )
