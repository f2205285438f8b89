"""Observation features: one definition, used by the live env, the decoder (``policy.act(obs)``) and trace replay.

The observation is a float32 vector, every entry normalized into the bounds below, in this order:

| name                 | what                                                                             | range   |
|----------------------|----------------------------------------------------------------------------------|---------|
| ``position``         | generated tokens / ``max_new_tokens``                                            | [0, 1]  |
| ``entropy``          | entropy of the target distribution that produced the root (softmax of the raw      | [0, 1]  |
|                      | logits, T = 1), divided by log V                                                 |         |
| ``top1_prob``        | its largest probability                                                          | [0, 1]  |
| ``top1_margin``      | largest minus second-largest probability                                         | [0, 1]  |
| ``match_len``        | longest suffix of the committed tokens (prompt included) that also ends earlier   | [0, 1]  |
|                      | in them, up to ``match_max`` tokens, divided by ``match_max`` (what the n-gram     |         |
|                      | drafter can find)                                                                |         |
| ``hidden_0..P-1``    | tanh of a fixed Gaussian projection (seed ``proj_seed``) of the unit-normalized    | [-1, 1] |
|                      | final hidden state that produced the root                                        |         |
| ``draft/<d>/width``  | only with ``FeatureSpec.draft_features``, per drafter ``d`` of the menu: children | [0, 1]  |
|                      | of the root in the drafter's largest proposal at the root (its recorded shape,    |         |
|                      | ``env.step.largest_shape``)    / 8 (how many different continuations it found)      |         |
| ``draft/<d>/depth``  | ... and that proposal's depth / 16 (how far its continuation reaches)             | [0, 1]  |
| ``accept/<arm>``     | one per drafting arm of the menu: moving average (weight ``1 - decay`` on the     | [0, 1]  |
|                      | newest) of accepted / depth over the steps that used it                          |         |
| ``last_tokens``      | tokens committed by the previous step / (deepest arm's depth + 1)                | [0, 1]  |
| ``accept_rate_recent`` | moving average of accepted / drafted over the steps that drafted               | [0, 1]  |

The first group (``entropy`` .. ``hidden_*``, the *position features*) depends only on the committed text and
the target, so a trace stores it per position. The last group (the *history*) depends on the episode's own steps
and is kept as an array ``[..., K + 2]`` (one moving average per arm, ``last_tokens``, ``accept_rate_recent``)
updated by ``history_update`` with a step's ``history_inputs``; both work on one episode or a batch, in numpy or
torch, unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from numbers import Integral, Real
from typing import Any

import numpy as np
import torch

from drafters.base import shown

POSITION_HEAD = ("entropy", "top1_prob", "top1_margin", "match_len")
DRAFT_HEAD = ("width", "depth")
DRAFT_WIDTH, DRAFT_DEPTH = 8, 16  # normalizers of the draft features
HISTORY_HEAD = ("last_tokens", "accept_rate_recent")


class FeatureSpecError(ValueError):
    """A feature spec that cannot be used (a policy's ``meta.feature_spec``, a trace header's, an env's argument);
    the message, one line, is meant for the user."""


# Upper bounds of the integer fields: the observation holds ``proj_dim`` projected features (8 by default; a
# projection matrix [hidden, proj_dim] is built from it) and the suffix matcher scans up to ``match_max`` tokens
# (16): past these a spec is damaged, not a choice, and would only exhaust memory or time.
PROJ_DIM_MAX = 1024
MATCH_MAX_MAX = 4096
SEED_MAX = 2**32 - 1


@dataclass(frozen=True)
class FeatureSpec:
    proj_dim: int = 8  # P: size of the hidden-state projection
    proj_seed: int = 0  # seed of the projection matrix (fixed: a trace and a policy depend on it)
    match_max: int = 16  # suffix matches are counted up to this length
    decay: float = 0.5  # moving averages: new = decay * old + (1 - decay) * x
    draft_features: bool = False  # add draft/<d>/width and depth: the drafters' largest proposal at the root

    def __post_init__(self) -> None:
        ints = {"proj_dim": (0, PROJ_DIM_MAX), "proj_seed": (0, SEED_MAX), "match_max": (1, MATCH_MAX_MAX)}
        for name, (lo, hi) in ints.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, Integral) or not lo <= v <= hi:
                raise FeatureSpecError(
                    f"feature spec: {name} must be an integer in {lo}..{hi}, got {shown(v)}"
                )
            object.__setattr__(self, name, int(v))
        d = self.decay
        if isinstance(d, bool) or not isinstance(d, Real) or not 0.0 <= _float(d) < 1.0:  # NaN fails too
            raise FeatureSpecError(f"feature spec: decay must be a number in [0, 1), got {shown(d)}")
        object.__setattr__(self, "decay", float(d))
        if not isinstance(self.draft_features, bool):
            raise FeatureSpecError(
                f"feature spec: draft_features must be true or false, got {shown(self.draft_features)}"
            )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, source: str = "feature spec") -> FeatureSpec:
        """A spec from its ``as_dict`` (missing keys take the defaults; ``None``: the default spec). Anything else
        (not a mapping, an unknown key, a value of the wrong type or out of range) raises ``FeatureSpecError``
        whose message starts with ``source``."""
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise FeatureSpecError(f"{source} must be a mapping of field to value, got a {type(d).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = [k for k in d if k not in known]
        if unknown:
            listed = ", ".join(shown(k) for k in unknown[:5])
            raise FeatureSpecError(f"{source} has unknown key(s) {listed} (known: {', '.join(known)})")
        try:
            return cls(**d)
        except FeatureSpecError as err:
            raise FeatureSpecError(str(err).replace("feature spec", source, 1)) from None


def _float(x: Real) -> float:
    try:
        return float(x)
    except OverflowError:  # an integer past the float range
        return math.inf


def position_feature_names(spec: FeatureSpec) -> list[str]:
    return [*POSITION_HEAD, *(f"hidden_{i}" for i in range(spec.proj_dim))]


def feature_names(spec: FeatureSpec, arm_names: Sequence[str], arm_depths: Sequence[int]) -> list[str]:
    drafting = [f"accept/{n}" for n, d in zip(arm_names, arm_depths) if d > 0]
    draft = [f"draft/{d}/{h}" for d in menu_drafters(spec, arm_names, arm_depths) for h in DRAFT_HEAD]
    return ["position", *position_feature_names(spec), *draft, *drafting, *HISTORY_HEAD]


def menu_drafters(spec: FeatureSpec, arm_names: Sequence[str], arm_depths: Sequence[int]) -> list[str]:
    """The drafters whose proposal shape enters the observation (none unless ``spec.draft_features``)."""
    if not spec.draft_features:
        return []
    return sorted({n.split("-")[0] for n, d in zip(arm_names, arm_depths) if d > 0})


def draft_features(parents: Any) -> np.ndarray:
    """``[width, depth]`` of one proposal tree (parents [N], -1 at the root), normalized as the table says."""
    par = np.asarray(parents.tolist() if hasattr(parents, "tolist") else parents, dtype=np.int64)
    depth = np.zeros(par.shape[0], dtype=np.int64)
    for i in range(1, par.shape[0]):  # parents precede children
        depth[i] = depth[par[i]] + 1
    width = int((par == 0).sum())
    return np.array([min(width / DRAFT_WIDTH, 1.0), min(depth.max(initial=0) / DRAFT_DEPTH, 1.0)], np.float32)


def history_columns(arm_depths: Sequence[int]) -> np.ndarray | slice:
    """Columns of the history array ``[arm 0 .. arm K-1, last_tokens, accept_rate_recent]`` that enter the
    observation: every drafting arm ("none" has no acceptance to show), then the last two. A slice when they are
    contiguous (the env's menus: "none" first), which is cheaper to read."""
    k = len(arm_depths)
    cols = [a for a, d in enumerate(arm_depths) if d > 0] + [k, k + 1]
    if cols == list(range(cols[0], k + 2)):
        return slice(cols[0], k + 2)
    return np.array(cols, dtype=np.int64)


def observation_bounds(spec: FeatureSpec, num_obs: int) -> tuple[np.ndarray, np.ndarray]:
    low = np.zeros(num_obs, dtype=np.float32)
    first = 1 + len(POSITION_HEAD)
    low[first : first + spec.proj_dim] = -1.0
    return low, np.ones(num_obs, dtype=np.float32)


# ---- position features ----------------------------------------------------------------------------------------


def projection(hidden_size: int, spec: FeatureSpec) -> np.ndarray:
    """The fixed projection matrix [H, P], N(0, 1) entries from ``spec.proj_seed``."""
    rng = np.random.default_rng(spec.proj_seed)
    return rng.standard_normal((hidden_size, spec.proj_dim)).astype(np.float32)


@torch.no_grad()
def target_features(logits: torch.Tensor, hidden: torch.Tensor, proj: np.ndarray) -> np.ndarray:
    """entropy / log V, top-1 prob, top-1 margin and the hidden projection of each row.
    logits: [S, V]; hidden: [S, H]; proj: [H, P] -> float32 [S, 3 + P]."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [S, V]
    p = logp.exp()
    # 0 * log 0 = 0: a masked (-inf) logit adds nothing, where p * logp would be NaN; elsewhere the same sum
    ent = -torch.where(p > 0, p * logp, 0.0).sum(-1) / math.log(logits.shape[-1])
    top2 = p.topk(2, dim=-1).values  # [S, 2]
    h = hidden.float().cpu().numpy()
    h = h / np.maximum(np.linalg.norm(h, axis=-1, keepdims=True), 1e-12)
    head = torch.stack([ent, top2[:, 0], top2[:, 0] - top2[:, 1]], dim=-1).cpu().numpy()
    out = np.concatenate([head.clip(0.0, 1.0), np.tanh(h @ proj)], axis=-1)
    return out.astype(np.float32)


def suffix_match_length(tokens: Sequence[int] | np.ndarray, max_len: int) -> int:
    """Length (<= max_len) of the longest suffix of ``tokens`` that also ends at an earlier position."""
    arr = np.asarray(tokens, dtype=np.int64)
    n = arr.shape[0]
    if n < 2:
        return 0
    cand = np.flatnonzero(arr[:-1] == arr[-1])  # earlier ends whose last token matches
    length = 0
    while cand.size and length < max_len:
        length += 1
        cand = cand[cand >= length]
        cand = cand[arr[cand - length] == arr[n - 1 - length]] if n - 1 - length >= 0 else cand[:0]
    return length


def position_features(
    logits: torch.Tensor, hidden: torch.Tensor, tokens: Sequence[int], spec: FeatureSpec, proj: np.ndarray
) -> np.ndarray:
    """The position features of the root ``tokens[-1]``: logits [V] and hidden [H] are the target's output that
    produced it. Returns float32 [4 + P] in ``position_feature_names`` order."""
    tf = target_features(logits.reshape(1, -1), hidden.reshape(1, -1), proj)[0]
    match = suffix_match_length(tokens, spec.match_max) / spec.match_max
    return np.concatenate([tf[:3], np.array([match], dtype=np.float32), tf[3:]]).astype(np.float32)


# ---- history features (numpy or torch, one episode or a batch) --------------------------------------------------


def history_init(batch: int, num_arms: int, like: Any = None) -> Any:
    """Zeros [batch, K + 2]: float32 numpy, or a torch tensor on ``like``'s device when ``like`` is a tensor."""
    if isinstance(like, torch.Tensor):
        return torch.zeros(batch, num_arms + 2, dtype=torch.float32, device=like.device)
    return np.zeros((batch, num_arms + 2), dtype=np.float32)


def history_inputs(accepted, drafted, tokens, depth, max_tokens: int, decay: float) -> tuple:
    """What one step adds to the history (scalars or arrays, numpy or torch): ``(last_tokens, accept rate, its
    weight, arm acceptance, its weight)``; a weight is 0 where there is nothing to average (no draft, "none")."""
    w = 1.0 - decay
    return (
        tokens / max_tokens,  # tokens <= deepest arm + 1 = max_tokens
        accepted / (drafted + (drafted == 0)),
        w * (drafted > 0),
        accepted / (depth + (depth == 0)),
        w * (depth > 0),
    )


def history_update(hist, rows, arm, inputs) -> None:
    """In place, after a step: ``hist[rows]`` ([B, K + 2]: one moving average per arm, then ``last_tokens`` and
    ``accept_rate_recent``; rows an int or indices [B]) takes the step of ``arm`` (int or [B]) whose
    ``history_inputs`` are ``inputs``."""
    last, rate, w_rate, frac, w_arm = inputs
    hist[rows, -2] = last
    cur = hist[rows, -1]
    hist[rows, -1] = cur + w_rate * (rate - cur)
    cur = hist[rows, arm]
    hist[rows, arm] = cur + w_arm * (frac - cur)


def assemble(position_frac, pos_feat, hist_rows, cols, out) -> Any:
    """Write the observation(s) into ``out`` ([F] or [B, F]): position, position features, history columns."""
    k = pos_feat.shape[-1]
    out[..., 0] = position_frac
    out[..., 1 : 1 + k] = pos_feat
    out[..., 1 + k :] = hist_rows[..., cols]
    return out


def position_horizon(horizon: Any) -> int | None:
    """``horizon`` checked: None, or an integer >= 1 (the ``max_new_tokens`` a ``position`` is a fraction of)."""
    if horizon is not None and (
        isinstance(horizon, bool) or not isinstance(horizon, Integral) or horizon < 1
    ):
        raise ValueError(f"the position horizon must be an integer >= 1 or None, got {shown(horizon)}")
    return None if horizon is None else int(horizon)


class ObservationBuilder:
    """Observations of one live sequence (the live env and the decoder): position features from the target's
    output, history from the episode's steps, assembled by the same functions replay uses.

    ``horizon``: the ``max_new_tokens`` that ``position`` is a fraction of, ``min(generated / horizon, 1)``; a
    policy learned it at its training env's ``max_new_tokens`` (its file's ``meta.max_new_tokens``), which a run
    of another length must keep to show it the positions it learned. None: each sequence's own ``max_new_tokens``.
    """

    def __init__(
        self,
        spec: FeatureSpec,
        arm_names: Sequence[str],
        arm_depths: Sequence[int],
        hidden_size: int,
        *,
        horizon: int | None = None,
    ):
        self.horizon = position_horizon(horizon)
        self.spec = spec
        self.names = feature_names(spec, arm_names, arm_depths)
        self.drafters = menu_drafters(spec, arm_names, arm_depths)  # whose proposal shape observe() needs
        self.arm_depth = np.asarray(arm_depths, dtype=np.int64)
        self.max_tokens = int(self.arm_depth.max(initial=0)) + 1
        self.cols = history_columns(arm_depths)
        self.proj = projection(hidden_size, spec)
        self.low, self.high = observation_bounds(spec, len(self.names))
        self.hist = history_init(1, len(arm_depths))

    @property
    def size(self) -> int:
        return len(self.names)

    def reset(self) -> None:
        self.hist[:] = 0.0

    def observe(
        self,
        logits: torch.Tensor,
        hidden: torch.Tensor,
        tokens: Sequence[int],
        generated: int,
        max_new_tokens: int,
        proposals: dict[str, Any] | None = None,
        hist: np.ndarray | None = None,
    ) -> np.ndarray:
        """``proposals``: with ``spec.draft_features``, each of ``self.drafters``' largest proposal tree; ``hist``:
        the sequence's history features ([1, K + 2], from ``history_init``; default: the builder's own);
        ``max_new_tokens``: the sequence's, the position's denominator unless the builder has a ``horizon``."""
        pos_feat = position_features(logits, hidden, tokens, self.spec, self.proj)
        if self.drafters:
            missing = [d for d in self.drafters if d not in (proposals or {})]
            if missing:
                raise ValueError(f"draft features need the proposals of {missing}")
            extra = [draft_features(proposals[d].parents) for d in self.drafters]
            pos_feat = np.concatenate([pos_feat, *extra])
        frac = min(generated / (self.horizon or max_new_tokens), 1.0)
        hist = self.hist if hist is None else hist
        return assemble(frac, pos_feat, hist[0], self.cols, np.empty(self.size, dtype=np.float32))

    def record(
        self, arm: int, accepted: int, drafted: int, tokens: int, hist: np.ndarray | None = None
    ) -> None:
        depth = int(self.arm_depth[arm])
        history_update(
            self.hist if hist is None else hist,
            0,
            arm,
            history_inputs(accepted, drafted, tokens, depth, self.max_tokens, self.spec.decay),
        )
