"""One speculation step, as data flows in DESIGN.md: propose -> tree forward -> verify -> commit -> observe.

The decoder loop, the live Gymnasium env and the trace recorder all call ``Engine.step``; nothing else runs the
target during decoding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

import kernels
from drafters import DraftContext, Drafter, DraftTree, Feedback, TreeShape, make_drafter
from env.target import Target, TargetState


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
    """Greedy when ``temperature == 0``; else temperature, then top-k, then top-p (Hugging Face order)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class StepResult:
    arm: Arm
    committed: list[int]  # accepted draft tokens + the bonus token
    accepted: int  # accepted draft tokens (bonus excluded)
    drafted: int  # draft nodes in the verified tree (root excluded)
    draft_s: float
    verify_s: float
    parents: torch.Tensor | None = None  # [N] the verified tree's parents (its shape: chain or branching)

    @property
    def tokens(self) -> int:
        return len(self.committed)

    @property
    def wall_s(self) -> float:
        return self.draft_s + self.verify_s


@dataclass
class Decoding:
    """A sequence in flight: the target state plus what the drafters see."""

    state: TargetState
    ctx: DraftContext


class Engine:
    """Holds the target, the drafters and the sampling settings; runs prefill and speculation steps."""

    def __init__(
        self,
        target: Target,
        drafters: dict[str, Drafter] | None = None,
        sampling: Sampling = Sampling(),
        generator: torch.Generator | None = None,
    ) -> None:
        self.target = target
        self.drafters = dict(drafters or {})
        self.sampling = sampling
        self.generator = generator

    @classmethod
    def build(
        cls, target: Target, names: list[str], sampling: Sampling = Sampling(), seed: int = 0
    ) -> Engine:
        drafters = {n: make_drafter(n) for n in names if n != "none"}
        return cls(target, drafters, sampling, torch.Generator().manual_seed(seed))

    def _verify(self, tree: DraftTree, logits: torch.Tensor) -> kernels.Verdict:
        s = self.sampling
        draft_probs = None if tree.draft_probs is None else tree.draft_probs[None].to(logits.device)
        return kernels.verify(
            tree.tokens[None].to(logits.device),
            tree.parents[None].to(logits.device),
            logits[None],
            temperature=s.temperature,
            top_k=s.top_k,
            top_p=s.top_p,
            draft_probs=draft_probs,
            generator=self.generator,
        )

    def start(self, prompt_ids: list[int]) -> tuple[Decoding, StepResult]:
        """Prefill and pick the first new token (a step of the "no draft" arm)."""
        t0 = time.perf_counter()
        state, logits = self.target.prefill(prompt_ids)
        root = DraftTree.root_only(prompt_ids[-1])
        verdict = self._verify(root, logits[None])
        first = int(verdict.next_token[0])
        self.target.append_root(state, first)
        ctx = DraftContext(tokens=state.tokens, prompt_len=state.prompt_len, target=self.target)
        ctx.last_hidden = state.last_hidden
        # for drafters that read the target: the prompt's features (EAGLE) and its KV cache (early exit)
        ctx.extras.update(prompt_hidden=state.prompt_hidden, target_cache=state.cache)
        for d in self.drafters.values():
            d.reset(ctx)
        result = StepResult(NO_DRAFT, [first], 0, 0, 0.0, time.perf_counter() - t0)
        seq = Decoding(state=state, ctx=ctx)
        return seq, result

    def step(self, seq: Decoding, arm: Arm) -> StepResult:
        """Draft with ``arm``, verify in one target pass, commit the accepted path and the bonus token."""
        t0 = time.perf_counter()
        root = seq.state.tokens[-1]
        if arm.drafter is None or arm.shape.depth == 0:
            tree = DraftTree.root_only(root)
        else:
            drafter = self.drafters.get(arm.drafter)
            if drafter is None:
                known = ", ".join(sorted(self.drafters)) or "(none loaded)"
                raise KeyError(f"arm {arm.name} needs drafter {arm.drafter!r}; loaded drafters: {known}")
            tree = drafter.propose(seq.ctx, arm.shape)
            if tree.num_nodes > self.target.room(seq.state):
                tree = DraftTree.root_only(root)  # the context is nearly full: no room to draft
        t1 = time.perf_counter()
        out = self.target.forward_tree(seq.state, tree)
        verdict = self._verify(tree, out.logits)
        path = verdict.path[0]
        path = path[path >= 0]
        committed = self.target.commit(seq.state, tree, path, int(verdict.next_token[0]))
        seq.state.last_hidden = out.hidden[int(path[-1])]
        seq.state.last_logits = out.logits[int(path[-1])].clone()  # a copy: frees the tree's [N, V] logits
        seq.ctx.last_hidden = seq.state.last_hidden
        if self.drafters:
            feedback = Feedback(
                committed=committed,
                tree=tree,
                path_logits=out.logits[path],
                path=path,
                tree_logits=out.logits,
                path_hidden=out.hidden[path],
            )
            for d in self.drafters.values():
                d.observe(seq.ctx, feedback)
        t2 = time.perf_counter()
        result = StepResult(
            arm=arm,
            committed=committed,
            accepted=int(verdict.accept_len[0]),
            drafted=tree.num_draft,
            draft_s=t1 - t0,
            verify_s=t2 - t1,
            parents=tree.parents,
        )
        return result


def parse_arm(name: str) -> Arm:
    """Inverse of ``Arm.name``: ``none`` | ``{drafter}-d{depth}[-k{topk}][-b{budget}]`` (e.g. ``ngram-d8-k3-b16``)."""
    from drafters import DRAFTERS, DrafterError

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
    return Arm(drafter, TreeShape(depth=vals["d"], topk=vals["k"], budget=vals["b"]))
