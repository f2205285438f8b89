"""The one step object: ``Stepper`` runs the batch engine's step (``env.batch.BatchEngine``) for every caller — the
decoder (a batch of one), the live Gymnasium env, the trace recorder, calibration and continuous batching — and
owns the bookkeeping they share:

- when a sequence ends: at its first end-of-sequence token (kept; tokens accepted after it are not counted), at
  ``max_new_tokens``, or when its context is full;
- the observation (``env.features``): the draft features read each menu drafter's largest proposal at the root;
  a drafter that replays exactly (``exact_replay``: n-gram) proposes once per root, and the step verifies that
  proposal cut down to the chosen arm's shape (``drafters.trees.prune``); any other drafter (a best-first tree of
  a node budget, one that learns as it goes) proposes again for the arm, so the tree verified may differ from the
  one observed. The step from that root pays every proposal its observation made, whichever arm it takes (a
  policy reading draft features makes them every step; replay prices them alike); a finished sequence's
  observation is at its last counted token, as replay's, even when its last step committed tokens past it;
- the reward and ``info`` of a step (``StepCosts``: from a cost model, or measured), the history features.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from drafters import Drafter, DraftTree, TreeShape
from drafters.trees import prune
from env.arms import arm_index
from env.batch import BatchEngine, Prefill, Row
from env.cost import CostModel
from env.engine import Arm, StepResult
from env.features import FeatureSpec, ObservationBuilder, history_init
from env.metrics import step_reward


def truncate(tokens: list[int], eos: frozenset[int], max_new_tokens: int) -> list[int]:
    """Cut at the first end-of-sequence token (kept) and at ``max_new_tokens``."""
    for i, t in enumerate(tokens[:max_new_tokens]):
        if t in eos:
            return tokens[: i + 1]
    return tokens[:max_new_tokens]


def largest_shape(d: Drafter) -> TreeShape:
    """The proposal shape a trace records for ``d`` and the draft features probe with."""
    return getattr(d, "max_shape", RECORD_SHAPE)


RECORD_SHAPE = TreeShape(depth=16, topk=8)  # for drafters that do not name their largest shape


class StepCosts:
    """``(cost_s, ar_cost_s)`` of a step, the two terms of its reward ``tokens * ar_cost_s / cost_s``:

    - a cost model: both from it (``step_cost`` of the arm and tree, ``ar_cost`` at the step's context);
    - a cost model and ``measured``: the step's wall time against the model's autoregressive cost;
    - no cost model: the step's wall time against the last measured plain autoregressive step's (no draft and no
      drafting time: a root-only step after a drafter's search costs that search too); until one was measured,
      against the step's own verification time (a drafted step's verify costs at least an autoregressive one:
      the reward errs low, never by the whole draft)."""

    def __init__(self, cost_model: CostModel | None, measured: bool = False) -> None:
        if measured and cost_model is None:
            raise ValueError("measured costs need a cost model for the autoregressive unit")
        self.cost_model, self.measured = cost_model, measured
        self.ar_wall: float | None = None

    def __call__(
        self,
        res: StepResult,
        context: int,
        observed: Sequence[Arm] = (),
        observe_s: float = 0.0,
        cut: bool = False,
    ) -> tuple[float, float]:
        """``observed``: the proposals (drafter, largest shape) the observation made at this root, which the step
        pays for whichever arm it takes (a policy reading draft features makes them every step), ``observe_s``
        their seconds; ``cut``: the arm's tree was cut from one of them (its drafting is theirs)."""
        cm = self.cost_model
        if cm is None:
            if res.drafted == 0 and res.draft_s == 0:
                self.ar_wall = res.wall_s
            return res.wall_s + observe_s, self.ar_wall if self.ar_wall is not None else res.verify_s
        ar = float(cm.ar_cost(context))
        if self.measured:
            return res.wall_s + observe_s, ar
        draft = (0.0 if cut else cm.draft_cost(res.arm)) + sum(cm.draft_cost(a) for a in observed)
        return float(draft + cm.verify_cost(res.drafted + 1, context, res.chain)), ar


@dataclass(eq=False)  # compared by identity: its fields hold tensors
class Seq:
    """A sequence under the step object: its row in the engine and what it has generated (cut as above)."""

    row: Row
    max_new_tokens: int
    tokens: list[int]  # the generated ids counted so far
    terminated: bool = False  # ended at an end-of-sequence token
    truncated: bool = False  # ended at max_new_tokens or a full context
    steps: int = 1  # verification steps (the prefill's first token counts as one)
    accepted: int = 0
    drafted: int = 0
    hist: np.ndarray = field(default_factory=lambda: np.zeros((1, 0), np.float32))
    _proposals: dict[str, DraftTree] = field(default_factory=dict)
    _propose_s: dict[str, float] = field(default_factory=dict)  # the seconds each of _proposals took
    _root_at: int = -1  # the root's position (``end``) when _proposals were made
    _observed: tuple[str, ...] = ()  # the drafters whose proposals the observation at this root read
    _end_hidden: torch.Tensor | None = None  # [H] of the last counted token, when the last step ran past it

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated

    @property
    def end(self) -> int:
        """The committed tokens counted (prompt included): ``len(row.tokens)`` unless the last step committed
        tokens past the end of sequence or ``max_new_tokens``, which the sequence does not count."""
        return self.row.prompt_len + len(self.tokens)

    @property
    def context(self) -> int:
        return self.row.past_len


@dataclass(frozen=True)
class Outcome:
    """What one step gave one sequence: the engine's result, the counted tokens, the reward and ``info``."""

    seq: Seq
    result: StepResult
    tokens: list[int]  # counted (cut at end of sequence / max_new_tokens)
    reward: float
    # tokens, accepted, drafted, cost_s, ar_cost_s, arm: deterministic (no wall time), except cost_s with measured
    # costs (``StepCosts``), the step's wall time
    info: dict[str, Any]
    observe_s: float = 0.0  # the seconds of the proposals the observation at its root made (draft features)

    @property
    def wall_s(self) -> float:
        """The step's wall time from its root: the observation's proposals, drafting, verification."""
        return self.observe_s + self.result.wall_s

    @property
    def terminated(self) -> bool:
        return self.seq.terminated

    @property
    def truncated(self) -> bool:
        return self.seq.truncated


class Stepper:
    """Sequences over one ``BatchEngine`` with an arm menu. ``start`` admits one, ``observe`` gives its
    observation, ``step`` runs one batch step with an arm index per live sequence (in slot order), ``retire``
    frees a finished one. ``features``: the observation the env and the policies see (None: no observations);
    ``horizon``: the ``max_new_tokens`` its ``position`` is a fraction of (``ObservationBuilder``; None: each
    sequence's own)."""

    def __init__(
        self,
        engine: BatchEngine,
        arms: Sequence[Arm],
        *,
        features: FeatureSpec | None = None,
        costs: StepCosts | None = None,
        horizon: int | None = None,
    ) -> None:
        self.engine = engine
        self.arms = list(arms)
        self.costs = costs or StepCosts(None)
        self.builder: ObservationBuilder | None = None
        if features is not None:
            depths = [0 if a.drafter is None else a.shape.depth for a in self.arms]
            hidden = int(engine.target.config.hidden_size)
            self.builder = ObservationBuilder(
                features, [a.name for a in self.arms], depths, hidden, horizon=horizon
            )
        self.seqs: list[Seq] = []  # in slot order: seqs[i].row is engine.target.rows[i]

    @property
    def eos(self) -> frozenset[int]:
        return self.engine.target.eos_ids

    def start(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        drafters: Mapping[str, Drafter],
        prefill: Prefill | None = None,
        seed: int | None = None,
    ) -> Seq:
        """Prefill a new sequence (or take ``prefill``, done chunk by chunk) and pick its first token; it may be
        done at once (``seq.done``). ``seed``: its own sampling seed (``BatchEngine.admit``)."""
        row, first = self.engine.admit(prompt_ids, drafters, prefill, seed=seed)
        k = len(self.arms)
        seq = Seq(row, max_new_tokens, [first], hist=history_init(1, k))
        self.seqs.append(seq)
        self._check_end(seq)
        return seq

    def retire(self, seq: Seq) -> None:
        # the drafters' view of the answer is what was emitted: a step that ran past the end of sequence or
        # max_new_tokens committed tokens the sequence did not count, which a cross-request cache must not learn
        del seq.row.tokens[seq.row.prompt_len + len(seq.tokens) :]
        self.engine.retire(seq.row)
        self.seqs.remove(seq)
        self.seqs.sort(key=lambda s: s.row.slot)

    def proposals(self, seq: Seq, names: Sequence[str] | None = None) -> dict[str, DraftTree]:
        """Each drafter's largest proposal at the sequence's root (``names``: default, those the draft features
        read), made once per root and timed (``seq._propose_s``): the step verifies those of exact drafters, pruned
        to its arm, and charges their seconds as its drafting time."""
        names = list(self.builder.drafters if names is None and self.builder else names or [])
        row, end = seq.row, seq.end
        if seq._root_at != end:
            seq._proposals, seq._propose_s, seq._root_at, seq._observed = {}, {}, end, ()
        # a finished sequence cut short proposes at its last counted token; a drafter that is not ``exact_replay``
        # keeps what it learnt of the tokens past it (replay records it as an approximation anyway)
        ctx = row.ctx if end == len(row.tokens) else replace(row.ctx, tokens=row.tokens[:end])
        for n in names:
            if n not in seq._proposals:
                d = row.drafters[n]
                cut = ctx if getattr(d, "exact_replay", False) else row.ctx
                t0 = time.perf_counter()
                seq._proposals[n] = d.propose(cut, largest_shape(d))
                seq._propose_s[n] = time.perf_counter() - t0
        return {n: seq._proposals[n] for n in names}

    def observe(self, seq: Seq) -> np.ndarray:
        """The observation at the sequence's root (``env.features``; replay computes the same): for a finished
        sequence whose last step committed past its end, at its last counted token (the terminal observation)."""
        if self.builder is None:
            raise ValueError("this stepper was built without features: it has no observations")
        row = seq.row
        logits, hidden, tokens = row.last_logits, row.last_hidden, row.tokens
        if seq._end_hidden is not None:  # the last step's path node that produced the last counted token
            hidden, tokens = seq._end_hidden, row.tokens[: seq.end]
            with torch.no_grad():
                logits = self.engine.target.head(hidden)
        props = self.proposals(seq) if self.builder.drafters else None
        if props:  # the step from this root pays for them, whichever arm it takes (``StepCosts``)
            seq._observed = tuple(props)
        obs = self.builder.observe(logits, hidden, tokens, len(seq.tokens), seq.max_new_tokens, props,
                                   hist=seq.hist)  # fmt: skip
        return obs.clip(self.builder.low, self.builder.high)

    def _cached(self, seq: Seq, arm: Arm) -> tuple[DraftTree | None, float]:
        """The tree for ``arm`` cut from this root's proposal and its drafting seconds (the proposal's and the
        cut's), when the drafter already proposed here and cutting its largest tree gives what it proposes for
        the arm (``exact_replay``: n-gram; a best-first tree of a node budget, suffix's or a dynamic one, may
        spend its budget elsewhere than the arm's own would); else ``(None, 0.0)``: the engine drafts it."""
        if arm.drafter is None or seq._root_at != seq.end or arm.drafter not in seq._proposals:
            return None, 0.0
        drafter = seq.row.drafters[arm.drafter]
        if not getattr(drafter, "exact_replay", False) or not arm.shape.fits(largest_shape(drafter)):
            return None, 0.0
        t0 = time.perf_counter()
        tree = prune(seq._proposals[arm.drafter], arm.shape)
        # a proposal the observation made is the step's already (``_observation``); another one is charged here
        made = 0.0 if arm.drafter in seq._observed else seq._propose_s.get(arm.drafter, 0.0)
        return tree, made + time.perf_counter() - t0

    def _observation(self, seq: Seq) -> tuple[list[Arm], float]:
        """The proposals the observation at the sequence's root made (as arms of their largest shapes) and their
        seconds: none unless it read draft features there."""
        if seq._root_at != seq.end or not seq._observed:
            return [], 0.0
        drafters = seq.row.drafters
        arms = [Arm(n, largest_shape(drafters[n])) for n in seq._observed]
        return arms, sum(seq._propose_s[n] for n in seq._observed)

    def step(self, choices: Sequence[int]) -> list[Outcome]:
        """One step of every live sequence (``choices[i]``: the arm index of ``seqs[i]``)."""
        if len(choices) != len(self.seqs):
            raise ValueError(f"{len(self.seqs)} sequences but {len(choices)} choices")
        if any(s.done for s in self.seqs):
            raise ValueError("a finished sequence is still in the batch: retire it before the next step")
        names = [a.name for a in self.arms]
        try:  # an arm index each (not a bool, a float or a negative one counted from the end)
            arms = [self.arms[arm_index(c, names)] for c in choices]
        except ValueError as err:
            raise ValueError(f"step choices {list(choices)!r}: {err}") from None
        cached = [self._cached(s, a) for s, a in zip(self.seqs, arms)]
        observations = [self._observation(s) for s in self.seqs]
        cut = [t is not None and a.drafter in s._observed for (t, _), a, s in zip(cached, arms, self.seqs)]
        trees, draft_s = self.engine.propose(arms, [t for t, _ in cached], [ds for _, ds in cached])
        contexts = [s.context for s in self.seqs]
        results = self.engine.verify(arms, trees, draft_s)
        out = []
        for seq, c, res, context, (observed, observe_s), was_cut in zip(
            self.seqs, choices, results, contexts, observations, cut
        ):
            counted = truncate(res.committed, self.eos, seq.max_new_tokens - len(seq.tokens))
            seq.tokens.extend(counted)
            if len(counted) < len(res.committed):  # cut: path node j produced committed[j]
                seq._end_hidden = seq.row.path_hidden[len(counted) - 1]
            seq.steps += 1
            accepted = min(res.accepted, len(counted))
            seq.accepted += accepted
            seq.drafted += res.drafted
            self._check_end(seq)
            if self.builder is not None:
                self.builder.record(int(c), accepted, res.drafted, len(counted), hist=seq.hist)
            cost_s, ar_s = self.costs(res, context, observed, observe_s, was_cut)
            info = {"tokens": len(counted), "accepted": accepted, "drafted": res.drafted, "cost_s": cost_s,
                    "ar_cost_s": ar_s, "arm": res.arm.name}  # fmt: skip
            out.append(Outcome(seq, res, counted, step_reward(len(counted), cost_s, ar_s), info, observe_s))
        return out

    def _check_end(self, seq: Seq) -> None:
        if seq.tokens[-1] in self.eos:
            seq.terminated = True
        elif len(seq.tokens) >= seq.max_new_tokens or self.engine.target.room(seq.row) < 1:
            seq.truncated = True


__all__ = ["Outcome", "Seq", "StepCosts", "Stepper", "largest_shape", "truncate"]
