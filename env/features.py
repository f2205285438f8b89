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
| ``last_tokens``      | tokens committed by the previous step / (deepest arm's depth + 1)                | [0, 1]  |
| ``accept_rate_recent`` | moving average (weight ``1 - decay`` on the newest) of accepted / drafted over   | [0, 1]  |
|                      | the steps that drafted                                                           |         |
| ``accept/<arm>``     | one per drafting arm of the menu: moving average of accepted / depth over the     | [0, 1]  |
|                      | steps that used it                                                               |         |

The first group (``entropy`` .. ``hidden_*``, the *position features*) depends only on the committed text and
the target, so a trace stores it per position. The last group (the *history*) depends on the episode's own steps
and is kept as an array ``[..., 2 + K]`` (``last_tokens``, ``accept_rate_recent``, one moving average per arm)
updated by ``history_update``, which works on one episode or a batch, in numpy or torch, unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

POSITION_HEAD = ("entropy", "top1_prob", "top1_margin", "match_len")
HISTORY_HEAD = ("last_tokens", "accept_rate_recent")


@dataclass(frozen=True)
class FeatureSpec:
    proj_dim: int = 8  # P: size of the hidden-state projection
    proj_seed: int = 0  # seed of the projection matrix (fixed: a trace and a policy depend on it)
    match_max: int = 16  # suffix matches are counted up to this length
    decay: float = 0.5  # moving averages: new = decay * old + (1 - decay) * x

    def __post_init__(self) -> None:
        if self.proj_dim < 0 or self.match_max < 1 or not 0.0 <= self.decay < 1.0:
            raise ValueError(f"bad feature spec {self}: need proj_dim >= 0, match_max >= 1, 0 <= decay < 1")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> FeatureSpec:
        return cls(**(d or {}))


def position_feature_names(spec: FeatureSpec) -> list[str]:
    return [*POSITION_HEAD, *(f"hidden_{i}" for i in range(spec.proj_dim))]


def feature_names(spec: FeatureSpec, arm_names: Sequence[str], arm_depths: Sequence[int]) -> list[str]:
    drafting = [f"accept/{n}" for n, d in zip(arm_names, arm_depths) if d > 0]
    return ["position", *position_feature_names(spec), *HISTORY_HEAD, *drafting]


def history_columns(arm_depths: Sequence[int]) -> np.ndarray:
    """Columns of the history array that enter the observation (the "none" arm has no acceptance to show)."""
    return np.array([0, 1, *(2 + a for a, d in enumerate(arm_depths) if d > 0)], dtype=np.int64)


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
    ent = -(p * logp).sum(-1) / math.log(logits.shape[-1])
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
    """Zeros [batch, 2 + K]: float32 numpy, or a torch tensor on ``like``'s device when ``like`` is a tensor."""
    if isinstance(like, torch.Tensor):
        return torch.zeros(batch, 2 + num_arms, dtype=torch.float32, device=like.device)
    return np.zeros((batch, 2 + num_arms), dtype=np.float32)


def history_update(
    hist, rows, arm, accepted, drafted, tokens, arm_depth, max_tokens: int, decay: float
) -> None:
    """In place, after a step. hist: [B, 2 + K]; rows: row index (int) or indices [B]; arm, accepted, drafted,
    tokens: scalars or [B] (same kind as rows); arm_depth: [K] depth of each arm (0 for "none")."""
    w = 1.0 - decay
    hist[rows, 0] = tokens / max_tokens  # tokens <= deepest arm + 1 = max_tokens
    cur = hist[rows, 1]
    hist[rows, 1] = cur + (drafted > 0) * w * (accepted / (drafted + (drafted == 0)) - cur)
    depth = arm_depth[arm]
    col = 2 + arm
    cur = hist[rows, col]
    hist[rows, col] = cur + (depth > 0) * w * (accepted / (depth + (depth == 0)) - cur)


def assemble(position_frac, pos_feat, hist_rows, cols, out) -> Any:
    """Write the observation(s) into ``out`` ([F] or [B, F]): position, position features, history columns."""
    k = pos_feat.shape[-1]
    out[..., 0] = position_frac
    out[..., 1 : 1 + k] = pos_feat
    out[..., 1 + k :] = hist_rows[..., cols]
    return out


class ObservationBuilder:
    """Observations of one live sequence (the live env and the decoder): position features from the target's
    output, history from the episode's steps, assembled by the same functions replay uses."""

    def __init__(
        self, spec: FeatureSpec, arm_names: Sequence[str], arm_depths: Sequence[int], hidden_size: int
    ):
        self.spec = spec
        self.names = feature_names(spec, arm_names, arm_depths)
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
    ) -> np.ndarray:
        pos_feat = position_features(logits, hidden, tokens, self.spec, self.proj)
        frac = min(generated / max_new_tokens, 1.0)
        return assemble(frac, pos_feat, self.hist[0], self.cols, np.empty(self.size, dtype=np.float32))

    def record(self, arm: int, accepted: int, drafted: int, tokens: int) -> None:
        history_update(
            self.hist,
            0,
            arm,
            np.int64(accepted),
            np.int64(drafted),
            np.int64(tokens),
            self.arm_depth,
            self.max_tokens,
            self.spec.decay,
        )
