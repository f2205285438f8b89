"""Roofline batch cost models (``RooflineCost``, ``roofline:ACC/MODEL``): a named accelerator running a named model
size, simulated. A forward costs a fixed overhead plus the larger of (bytes of weights and KV read) / bandwidth and
FLOPs / peak, each at an achievable fraction; a model head's drafting costs, per level, a share of that overhead plus
reading (or multiplying by) the head's weights; a host-side drafter's, seconds per row. Every figure made with one
says it is simulated (``label``). A file is read as JSON and checked (``ROOFLINE_RANGES``), never run."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from drafters.base import shown
from env.batch_cost import ROOFLINE_FORMAT
from env.cost import CostModelError

# Published peak figures (dense bf16 tensor FLOP/s, HBM bytes/s). ``overhead_s``: a graph-captured decode step's
# fixed cost (scheduling, sampling, kernel launches), an assumption of this model.
ACCELERATORS: dict[str, dict[str, float | str]] = {
    "h100-sxm": {"name": "NVIDIA H100 SXM", "bytes_s": 3.35e12, "flops": 989e12, "overhead_s": 6e-4},
    "h200": {"name": "NVIDIA H200", "bytes_s": 4.8e12, "flops": 989e12, "overhead_s": 6e-4},
    "a100-80gb": {"name": "NVIDIA A100 80GB", "bytes_s": 2.039e12, "flops": 312e12, "overhead_s": 8e-4},
    "l4": {"name": "NVIDIA L4", "bytes_s": 3.0e11, "flops": 121e12, "overhead_s": 8e-4},
}
# Llama-family shapes: parameters, vocabulary, layers, hidden size, query heads, KV heads, head size (bf16 weights and
# KV), and
# ``embed_params``: an input embedding table of its own (untied from the LM head: vocabulary x hidden), of which a
# step reads only the rows of its tokens — not counted as weights read or multiplied (tied: the LM head reads it).
MODELS: dict[str, dict[str, float]] = {
    "llama-3.1-8b": {
        "vocab": 128256,
        "params": 8.03e9,
        "embed_params": 128256 * 4096,
        "layers": 32,
        "hidden": 4096,
        "heads": 32,
        "kv_heads": 8,
        "head_dim": 128,
    },
    "llama-3.2-1b": {
        "vocab": 128256,
        "params": 1.24e9,
        "layers": 16,
        "hidden": 2048,
        "heads": 32,
        "kv_heads": 8,
        "head_dim": 64,
    },
    "qwen2.5-7b": {
        "vocab": 152064,
        "params": 7.62e9,
        "embed_params": 152064 * 3584,
        "layers": 28,
        "hidden": 3584,
        "heads": 28,
        "kv_heads": 4,
        "head_dim": 128,
    },
    "smollm2-135m": {
        "vocab": 49152,
        "params": 1.35e8,
        "layers": 30,
        "hidden": 576,
        "heads": 9,
        "kv_heads": 3,
        "head_dim": 64,
    },
}
# The range of each figure a roofline file may hold: generous around real accelerators and models (the presets above
# sit well inside), so that every step, prefill and unit rate it prices is finite and positive; each refused in one
# line naming it. ``draft_per_row_s``: each drafter's host-side proposal seconds per row.
ROOFLINE_RANGES: dict[str, tuple[float, float]] = {
    "acc.bytes_s": (1e6, 1e15),  # memory bandwidth, bytes/s (an H200: 4.8e12)
    "acc.flops": (1e6, 1e18),  # peak FLOP/s (an H100: 9.9e14)
    "acc.overhead_s": (0.0, 1.0),  # a step's fixed seconds
    "shape.params": (1e6, 1e13),  # parameters (Llama-3.1-405B: 4e11)
    "shape.layers": (1, 1024),
    "shape.heads": (1, 1024),
    "shape.kv_heads": (1, 1024),
    "shape.head_dim": (1, 4096),
    "shape.vocab": (1, 1e7),
    "shape.hidden": (1, 1e6),
    "draft_vocab": (1, 1e7),  # a model head's draft vocabulary (EAGLE-3's for Llama-3.1-8B: 32,000)
    "head_overhead_frac": (
        0.0,
        1.0,
    ),  # a head level's fixed seconds, as a fraction of a step's (``acc.overhead_s``)
    "bw_efficiency": (0.01, 1.0),  # achievable fractions of the peaks
    "flop_efficiency": (0.01, 1.0),
    "draft_per_row_s": (0.0, 1.0),
}
WHOLE_FIGURES = (
    "shape.layers",
    "shape.heads",
    "shape.kv_heads",
    "shape.head_dim",
    "shape.vocab",
    "shape.hidden",
    "draft_vocab",
)
BW_EFFICIENCY = 0.8  # achievable fraction of peak HBM bandwidth in decode kernels
FLOP_EFFICIENCY = 0.6  # achievable fraction of peak tensor FLOP/s
HOST_DRAFT_S = {"ngram": 3e-5, "suffix": 5e-5, "recycling": 4e-5}  # host-side proposal per row (assumed)
HOST_DEFAULT_S = 5e-5  # a drafter's host side per row where ``draft_per_row_s`` names no figure
# Model-head drafters: the target decoder layers one level of drafting runs, and the head's own input projections in
# hidden x hidden matrices. EAGLE's head is one decoder layer of the target's shape fed by fc(e ++ f) (2h x h); EAGLE-3's
# adds the fusion of three residual streams (3h x h, once a step); the hybrid drafts with the eagle3 head (and its
# suffix part on the host); the early-exit drafter runs
# the target's first layers on each drafted token (the shipped head: 4 of the embedded model's 30, scaled to the
# model's depth) and then its adapter layer. Each ends in an LM head over ``draft_vocab`` tokens.
EXIT_FRACTION = 4 / 30


def head_layers(drafter: str, layers: float) -> tuple[float, float] | None:
    """(decoder layers, hidden x hidden projections) of one level of ``drafter``'s drafting, or None for a drafter
    that is no model head (it drafts on the host: ``draft_per_row_s``). EAGLE-3's fusion (3h x h) runs once a
    step, on the committed tokens' streams, not at every level: ``RooflineCost.draft_s`` adds it once."""
    if drafter in ("eagle", "eagle3", "hybrid"):
        return 1.0, 2.0
    if drafter == "early_exit":
        return max(1.0, round(EXIT_FRACTION * layers)) + 1.0, 0.0
    return None


DRAFT_VOCAB = 32000
HEAD_OVERHEAD_FRAC = (
    0.25  # a head level launches one layer's kernels and a top-k, not a whole step's (assumed)
)


@dataclass(frozen=True)
class RooflineCost:
    accelerator: str
    model: str
    acc: dict[str, Any]
    shape: dict[str, float]
    bw_efficiency: float = BW_EFFICIENCY
    flop_efficiency: float = FLOP_EFFICIENCY
    draft_per_row_s: dict[str, float] = field(default_factory=lambda: dict(HOST_DRAFT_S))
    draft_vocab: int = DRAFT_VOCAB
    head_overhead_frac: float = HEAD_OVERHEAD_FRAC
    simulated: bool = True
    padded_context: bool = False  # a paged-attention engine: each row reads its own keys

    @property
    def label(self) -> str:
        return f"roofline:{self.accelerator}/{self.model} (simulated)"

    @property
    def kv_bytes_per_token(self) -> float:
        s = self.shape
        return 2 * s["layers"] * s["kv_heads"] * s["head_dim"] * 2  # K and V, bf16

    def _time(self, tokens: Any, kv_tokens: Any, attn_pairs: Any) -> Any:
        s, a = self.shape, self.acc
        dense = s["params"] - s.get("embed_params", 0.0)  # the weights every step reads and multiplies by
        read = 2 * dense + np.asarray(kv_tokens, np.float64) * self.kv_bytes_per_token
        flops = 2 * dense * np.asarray(tokens, np.float64) + 4 * s["layers"] * s["heads"] * s[
            "head_dim"
        ] * np.asarray(attn_pairs, np.float64)
        return a["overhead_s"] + np.maximum(
            read / (a["bytes_s"] * self.bw_efficiency), flops / (a["flops"] * self.flop_efficiency)
        )

    def forward_s(self, rows: Any, nodes: Any, context: Any) -> Any:
        rows, nodes, context = (np.asarray(x, np.float64) for x in (rows, nodes, context))
        return self._time(rows * nodes, rows * (context + nodes), rows * nodes * (context + nodes / 2))

    def head_params(self, drafter: str) -> float:
        """Parameters one level of a model head's drafting reads (0 for a host-side drafter): its decoder layers
        (a target layer's share of the dense weights less the LM head), its input projections and an LM head over
        the draft vocabulary."""
        s = self.shape
        spec = head_layers(drafter, s["layers"])
        if spec is None:
            return 0.0
        layers, projections = spec
        hidden = self._hidden()
        dense = s["params"] - s.get("embed_params", 0.0)
        per_layer = max(dense - s.get("vocab", 0.0) * hidden, 0.0) / s["layers"]
        vocab = min(float(self.draft_vocab), s.get("vocab", float(self.draft_vocab)))
        return layers * per_layer + projections * hidden**2 + vocab * hidden

    def draft_s(self, drafter: str | None, rows: Any, depth: Any = 1) -> Any:
        """Seconds of ``drafter``'s proposals for ``rows`` rows: its host side per row (``draft_per_row_s``), and for
        a model head ``depth`` passes over the batch on the accelerator, one per level of a chain (the first also
        reads the tokens the last step committed, as EAGLE's engines run it), each a fixed share of a step's
        overhead plus reading the head's weights (or, past the ridge, multiplying by them). The head's own KV cache
        is not counted (one layer's: a layer's share of what the target reads)."""
        r = np.asarray(rows, np.float64)
        if drafter is None:
            return np.zeros_like(r)
        p = self.head_params(drafter)
        if p <= 0:  # a host-side drafter
            return self.draft_per_row_s.get(drafter, HOST_DEFAULT_S) * r
        a = self.acc
        bw, fl = a["bytes_s"] * self.bw_efficiency, a["flops"] * self.flop_efficiency
        level = a["overhead_s"] * self.head_overhead_frac + np.maximum(2 * p / bw, 2 * p * r / fl)
        out = np.asarray(depth, np.float64) * level
        if drafter in ("eagle3", "hybrid"):  # the fusion of three streams, once a step
            f = 3 * self._hidden() ** 2
            out = out + np.maximum(2 * f / bw, 2 * f * r / fl)
        # the host side: none of its own for a head (the hybrid's suffix part: the suffix drafter's per row)
        host = self.draft_per_row_s.get(drafter, HOST_DRAFT_S["suffix"] if drafter == "hybrid" else 0.0)
        return np.where(r > 0, out + host * r, 0.0)

    def catch_up_s(self, drafter: str | None, rows: Any, tokens: Any) -> Any:
        """Seconds a model head's proposal adds for catching up on ``tokens`` tokens (their sum over the rows) past
        the last step's commits: the products those tokens go through, in the first level's pass (whose weights it
        reads anyway), so they cost only past the ridge. An EAGLE head runs them through its pair projection, its
        layer's q/k/v (the rest of the layer runs for the root alone) and EAGLE-3's fusion; an early exit through
        its layers. 0 for a host-side drafter."""
        r = np.asarray(rows, np.float64)
        if drafter is None or self.head_params(drafter) <= 0:
            return np.zeros_like(r)
        s, h = self.shape, self._hidden()
        if drafter in ("eagle", "eagle3", "hybrid"):
            p = 2 * h**2 + h * (s["heads"] + 2 * s["kv_heads"]) * s["head_dim"]
            p += 3 * h**2 if drafter != "eagle" else 0.0
        else:  # its layers and adapter, less the LM head over the draft vocabulary
            p = (
                self.head_params(drafter)
                - min(float(self.draft_vocab), s.get("vocab", float(self.draft_vocab))) * h
            )
        a = self.acc
        bw, fl = a["bytes_s"] * self.bw_efficiency, a["flops"] * self.flop_efficiency
        t = np.asarray(tokens, np.float64)
        extra = np.maximum(2 * p / bw, 2 * p * (r + t) / fl) - np.maximum(2 * p / bw, 2 * p * r / fl)
        return np.where(r > 0, extra, 0.0)

    def _hidden(self) -> float:
        s = self.shape
        return s.get("hidden", s["heads"] * s["head_dim"])  # (Llama-family: the query heads' width)

    def prefill_s(self, tokens: Any) -> Any:
        t = np.asarray(tokens, np.float64)
        return self._time(t, t, t * t / 2)

    def policy_book_s(self, rows: Any) -> Any:
        """A serving policy's bookkeeping on the host: not in the analytic model (0; replay still charges the
        policy's act, timed on this machine, and the match drafter's host proposals: ``ServeSim.price_policy``)."""
        return np.zeros_like(np.asarray(rows, np.float64))

    def to_json(self) -> dict[str, Any]:
        return {"format": ROOFLINE_FORMAT, "version": 1, "accelerator": self.accelerator, "model": self.model,
                "acc": self.acc, "shape": self.shape, "bw_efficiency": self.bw_efficiency,
                "flop_efficiency": self.flop_efficiency, "draft_per_row_s": self.draft_per_row_s,
                "draft_vocab": self.draft_vocab, "head_overhead_frac": self.head_overhead_frac}  # fmt: skip

    @classmethod
    def from_json(cls, d: dict[str, Any], source: str = "roofline cost model") -> RooflineCost:
        def number(
            v: Any, name: str
        ) -> float:  # a JSON number (not a bool, a string, a list or null), by name
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise CostModelError(f"{source}: {name} must be a number, got {shown(v)}")
            try:
                return float(v)
            except OverflowError:
                raise CostModelError(f"{source}: {name} must be a number in range, got {shown(v)}") from None

        if d.get("version", 1) != 1 or isinstance(d.get("version"), bool):  # (as the fitted model's)
            raise CostModelError(
                f"{source}: version {shown(d.get('version'))} is not one this draftgym reads (1)"
            )
        try:
            acc = {k: (str(v) if k == "name" else number(v, f"acc.{k}")) for k, v in dict(d["acc"]).items()}
            shape = {k: number(v, f"shape.{k}") for k, v in dict(d["shape"]).items()}
            host = dict(d.get("draft_per_row_s", HOST_DRAFT_S))
            out = cls(str(d["accelerator"]), str(d["model"]), acc, shape,
                      number(d.get("bw_efficiency", BW_EFFICIENCY), "bw_efficiency"),
                      number(d.get("flop_efficiency", FLOP_EFFICIENCY), "flop_efficiency"),
                      {str(k): number(v, f"draft_per_row_s.{k}") for k, v in host.items()},
                      number(d.get("draft_vocab", DRAFT_VOCAB), "draft_vocab"),
                      number(d.get("head_overhead_frac", HEAD_OVERHEAD_FRAC), "head_overhead_frac"))  # fmt: skip
        except CostModelError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise CostModelError(f"{source} is malformed ({err!r})") from err
        need_acc, need_shape = (
            ("bytes_s", "flops", "overhead_s"),
            ("params", "layers", "heads", "kv_heads", "head_dim"),
        )
        missing = [k for k in need_acc if k not in acc] + [k for k in need_shape if k not in shape]
        if missing:
            raise CostModelError(f"{source} lacks {', '.join(missing)}")
        figures = [(f"acc.{k}", acc[k]) for k in need_acc] + [(f"shape.{k}", shape[k]) for k in need_shape]
        figures += [("bw_efficiency", out.bw_efficiency), ("flop_efficiency", out.flop_efficiency)]
        figures += [(f"shape.{k}", shape[k]) for k in ("vocab", "hidden") if k in shape]
        figures += [("draft_vocab", out.draft_vocab), ("head_overhead_frac", out.head_overhead_frac)]
        figures += [(f"draft_per_row_s.{k}", v) for k, v in out.draft_per_row_s.items()]
        for name, v in figures:
            lo, hi = ROOFLINE_RANGES[name if name in ROOFLINE_RANGES else "draft_per_row_s"]
            whole = name in WHOLE_FIGURES
            if not lo <= v <= hi or (whole and v != int(v)):  # (a NaN is in no range)
                kind = "a whole number" if whole else "a number"
                raise CostModelError(f"{source}: {name} must be {kind} in [{lo:g}, {hi:g}], got {v!r}")
        # the dense weights a step reads and multiplies by: the parameters less an untied embedding table
        embed = shape.get("embed_params", 0.0)
        if not 0 <= embed < shape["params"]:
            raise CostModelError(
                f"{source}: shape.embed_params must be in [0, shape.params {shape['params']:g}), got {embed!r}"
            )
        hidden = out._hidden()
        lo, hi = ROOFLINE_RANGES["shape.hidden"]
        if not lo <= hidden <= hi:
            raise CostModelError(f"{source}: the hidden size (shape.hidden, else heads x head_dim) must be in "
                                 f"[{lo:g}, {hi:g}], got {hidden:g}")  # fmt: skip
        lm_head = shape.get("vocab", 0.0) * hidden
        if lm_head >= shape["params"] - embed:
            raise CostModelError(f"{source}: shape.vocab x the hidden size ({lm_head:g}, the LM head) must be below "
                                 f"the dense parameters ({shape['params'] - embed:g})")  # fmt: skip
        return replace(out, draft_vocab=int(out.draft_vocab))


def roofline(accelerator: str, model: str) -> RooflineCost:
    if accelerator not in ACCELERATORS:
        raise CostModelError(f"unknown accelerator {accelerator!r}; known: {', '.join(ACCELERATORS)}")
    if model not in MODELS:
        raise CostModelError(f"unknown model size {model!r}; known: {', '.join(MODELS)}")
    return RooflineCost(accelerator, model, dict(ACCELERATORS[accelerator]), dict(MODELS[model]))


__all__ = ["ACCELERATORS", "DRAFT_VOCAB", "HEAD_OVERHEAD_FRAC", "HOST_DRAFT_S", "MODELS", "ROOFLINE_RANGES",
           "RooflineCost", "head_layers", "roofline"]  # fmt: skip
