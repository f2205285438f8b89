"""The drafter seam: what a drafter sees, what it returns, and the registry it plugs into.

A draft tree for one sequence is ``tokens[N]``, ``parents[N]`` (int64), optional ``scores[N]`` (log-probability of
the path, drafter's own) and optional ``draft_probs[N, V]``. Node 0 is the root: the last committed token, whose
target logits predict the depth-1 children. ``parents[0] == -1`` and ``parents[i] < i`` (see DESIGN.md, "Trees").
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch


class DrafterError(ValueError):
    """A drafter name or setting that cannot be used; the message is meant for the user."""


# ---- option checks: every drafter's constructor refuses a value of the wrong type or out of range in one line ----


def reason(err: BaseException, width: int = 200, kind: bool = False) -> str:
    """An error's message as a one-line message quotes it: on one line, cut to ``width`` characters (``kind``: after
    the error's type, for errors whose message alone says little, e.g. a ``KeyError``'s)."""
    text = " ".join(str(err).split())
    return (f"{type(err).__name__}: {text}" if kind else text)[:width]


def shown(value: Any, width: int = 60) -> str:
    """A value as a message quotes it: its repr, on one line, cut to ``width`` characters (a mapping by its kind:
    a file's whole JSON object would not fit)."""
    if isinstance(value, dict):
        return "a JSON object"
    text = " ".join(repr(value).split())
    return text if len(text) <= width else text[: width - 3] + "..."


def int_option(owner: str, name: str, value: Any, low: int, high: int) -> int:
    """``value`` as an integer in ``[low, high]`` (not a bool, not a float), else a ``DrafterError`` naming
    ``owner``'s option ``name``."""
    if isinstance(value, bool) or not isinstance(value, Integral) or not low <= value <= high:
        raise DrafterError(f"{owner} option {name} must be an integer in [{low}, {high}], got {shown(value)}")
    return int(value)


def float_option(
    owner: str,
    name: str,
    value: Any,
    low: float,
    high: float,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """``value`` as a finite number in the interval given (``low_open``/``high_open``: the bound excluded), else a
    ``DrafterError`` naming ``owner``'s option ``name``."""
    try:  # (an integer too large for a float is no finite number here)
        ok = not isinstance(value, bool) and isinstance(value, Real) and math.isfinite(value)
    except OverflowError:
        ok = False
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise DrafterError(f"{owner} option {name} must be a number in {interval}, got {shown(value)}")
    return float(value)


def choice_option(owner: str, name: str, value: Any, choices: Sequence[str]) -> str:
    """``value`` as one of the strings ``choices``, else a ``DrafterError`` listing them."""
    if not isinstance(value, str) or value not in choices:
        raise DrafterError(f"{owner} option {name} must be one of {', '.join(choices)}, got {shown(value)}")
    return value


def path_option(owner: str, name: str, value: Any) -> str | None:
    """``value`` as a file path (a string) or None, else a ``DrafterError``."""
    if value is not None and (not isinstance(value, str) or "\x00" in value):
        raise DrafterError(f"{owner} option {name} must be a file path (a string), got {shown(value)}")
    return value


# bounds of an arm's tree shape (``arm_shape``): far above what pays (the sweeps search depth <= 16, topk <= 4), low
# enough that a model drafter's buffers (depth x topk candidates a level) stay small. A drafter's own largest
# proposal (``max_shape``, e.g. every n-gram continuation) is not an arm and may be larger.
MAX_DEPTH = 256
MAX_TOPK = 64
MAX_BUDGET = 4096


@dataclass(frozen=True)
class TreeShape:
    """How large a tree a drafter may propose: ``depth`` levels below the root, ``topk`` children per expanded
    node, and at most ``budget`` draft nodes in all (the root not counted). ``depth == 0`` means no draft."""

    depth: int
    topk: int = 1
    budget: int = 0  # 0: depth * topk for a chain-of-branches, i.e. no extra limit

    def __post_init__(self) -> None:
        for name in ("depth", "topk", "budget"):  # (NaN, 2.5 or True compared as numbers and passed)
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, Integral):
                raise DrafterError(f"tree {name} must be an integer, got {value!r}")
            object.__setattr__(self, name, int(value))  # a numpy integer as Python's: names and hashes agree
        if self.depth < 0:
            raise DrafterError(f"tree depth must be >= 0, got {self.depth}")
        if self.topk < 1:
            raise DrafterError(f"tree topk must be >= 1, got {self.topk}")
        if self.budget < 0:
            raise DrafterError(f"tree budget must be >= 0, got {self.budget}")

    def arm_shape(self, owner: str = "an arm") -> TreeShape:
        """This shape, checked within the bounds of an arm's: depth, topk, budget and draft nodes (the budget, or
        depth x topk without one) at most ``MAX_DEPTH``, ``MAX_TOPK``, ``MAX_BUDGET`` (a k-ary tree's drafter sizes
        its buffers by the budget)."""
        for name, value, most in (("depth", self.depth, MAX_DEPTH), ("topk", self.topk, MAX_TOPK),
                                  ("budget", self.budget, MAX_BUDGET),
                                  ("nodes", self.max_nodes, MAX_BUDGET)):  # fmt: skip
            if value > most:
                raise DrafterError(f"{owner}: tree {name} must be <= {most}, got {value}")
        return self

    @property
    def max_nodes(self) -> int:
        """Draft nodes at most, root excluded."""
        full = self.depth * self.topk if self.topk > 1 else self.depth
        return min(self.budget, full) if self.budget else full

    def fits(self, within: TreeShape) -> bool:
        """Whether a tree of this shape can be cut from one of ``within`` (depth, width and nodes no larger)."""
        return self.depth <= within.depth and self.topk <= within.topk and self.max_nodes <= within.max_nodes


@dataclass(frozen=True)
class DraftTree:
    tokens: torch.Tensor  # [N] int64, tokens[0] = root (last committed token)
    parents: torch.Tensor  # [N] int64, parents[0] = -1, parents[i] < i
    scores: torch.Tensor | None = None  # [N] float32, drafter log-prob of the root-to-node path
    draft_probs: torch.Tensor | None = (
        None  # [N, V] distribution each node was drawn from (None: deterministic)
    )

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_draft(self) -> int:
        return self.num_nodes - 1

    @staticmethod
    def root_only(token: int) -> DraftTree:
        return DraftTree(
            tokens=torch.tensor([token], dtype=torch.long), parents=torch.tensor([-1], dtype=torch.long)
        )


def tree_problem(
    off: Sequence[int] | np.ndarray,
    tokens: Sequence[int] | np.ndarray,
    parents: Sequence[int] | np.ndarray,
    vocab_size: int | None = None,
) -> str | None:
    """What is wrong with packed trees (tree ``i`` is nodes ``off[i]:off[i+1]`` of ``tokens``/``parents``, parents
    local to each tree), or None when every tree is valid (DESIGN.md "Trees"): at least one node each, node 0 the
    root with parent -1, every other node's parent an earlier node of its tree, tokens in ``[0, vocab_size)``."""
    off, tok, par = (np.asarray(a) for a in (off, tokens, parents))
    if off.ndim != 1 or tok.ndim != 1 or par.ndim != 1:
        return "offsets, tokens and parents must be 1-D"
    if tok.shape != par.shape:
        return f"{tok.shape[0]} tokens but {par.shape[0]} parents"
    if off.size < 1 or off[0] != 0 or off[-1] != tok.size or (off[1:] <= off[:-1]).any():
        return "the offsets do not split the nodes into non-empty trees"
    for name, a in (("tokens", tok), ("parents", par)):
        if a.size and not np.issubdtype(a.dtype, np.integer):
            return f"{name} must be integers, got {a.dtype}"
    tree = np.repeat(np.arange(off.size - 1), np.diff(off))
    local = np.arange(tok.size) - off[:-1][tree]  # index of each node within its tree
    bad = np.where(local == 0, par != -1, (par < 0) | (par >= local))
    if bad.any():
        i = int(np.argmax(bad))
        return f"node {int(local[i])} of tree {int(tree[i])} has parent {int(par[i])} (needs -1 for the root, else 0..{max(int(local[i]) - 1, 0)})"
    if tok.size and (tok.min() < 0 or (vocab_size is not None and tok.max() >= vocab_size)):
        return f"a token id falls outside the vocabulary [0, {vocab_size})"
    return None


def check_tree(tokens: Any, parents: Any, vocab_size: int | None = None) -> None:
    """Raise a ``DrafterError`` naming the problem when ``(tokens, parents)`` is not a valid draft tree."""
    tok = np.asarray(tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens)
    par = np.asarray(parents.tolist() if isinstance(parents, torch.Tensor) else parents)
    problem = tree_problem([0, tok.size] if tok.ndim == 1 else [0], tok, par, vocab_size)
    if problem:
        raise DrafterError(f"not a valid draft tree: {problem}")


@runtime_checkable
class KVView(Protocol):
    """One sequence's committed keys and values in the target's cache, per layer: ``[1, kv_heads, >= past, dim]``
    (positions ``0 .. past - 1`` hold the committed tokens but the root; later ones are scratch)."""

    def keys(self, layer: int) -> torch.Tensor: ...

    def values(self, layer: int) -> torch.Tensor: ...


@runtime_checkable
class TargetModel(Protocol):
    """What a drafter may read of the target (``env.batch.BatchTarget`` is one): the Hugging Face causal LM whose
    embeddings, LM head and first layers trained heads reuse, its id (heads are trained for one model), the dtype
    and device it runs in, and its vocabulary size."""

    model: Any  # a transformers causal LM (``model.model.layers``, ``model.lm_head``, ``model.config``)
    model_id: str
    dtype: torch.dtype
    device: torch.device

    @property
    def vocab_size(self) -> int: ...


MAX_VOCAB = (
    1 << 31
)  # token ids without a target to bound them (no vocabulary is larger; ids are int32 on GPU)


@dataclass
class DraftContext:
    """What the engine hands a drafter each step. ``tokens`` is every committed token, prompt included; its last
    entry is the root of the next tree. ``target`` is the target (for drafters that reuse its layers or features);
    ``last_hidden`` the target's final hidden state at the last verified node ([H], may be None);
    ``prompt_hidden`` the final hidden states of the prompt ([P, H], EAGLE's first features; None when not kept);
    ``target_kv`` this sequence's entries in the target's KV cache (early exit reads them; None when not shared);
    ``aux_layers`` the layer counts n whose residual streams (after n target layers) the engine keeps, side by side
    in ``last_aux`` ([len(aux_layers) * H]) and ``prompt_aux`` ([P, ...]): EAGLE-3's low, middle and high features."""

    tokens: list[int]
    prompt_len: int
    target: TargetModel | None = None
    last_hidden: torch.Tensor | None = None
    prompt_hidden: torch.Tensor | None = None
    target_kv: KVView | None = None
    last_aux: torch.Tensor | None = None
    prompt_aux: torch.Tensor | None = None
    aux_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        """The history a drafter reads, checked once where a sequence starts (the engine then appends the ids it
        commits to the same list): a non-empty list of token ids, within the target's vocabulary when there is a
        target; numpy integers become ints in place. A tensor or array is refused (it was read as no match)."""
        toks = self.tokens
        if not isinstance(toks, list):
            raise DrafterError(f"DraftContext.tokens must be a list of token ids, got {type(toks).__name__}")
        if not toks:
            raise DrafterError("DraftContext.tokens is empty: a drafter needs at least the root token")
        if not all(type(t) is int for t in toks):
            bad = next((t for t in toks if isinstance(t, bool) or not isinstance(t, Integral)), None)
            if bad is not None:
                raise DrafterError(f"DraftContext.tokens must be integer token ids, got {bad!r:.40}")
            toks[:] = [int(t) for t in toks]
        vocab = self.target.vocab_size if self.target is not None else MAX_VOCAB
        lo, hi = min(toks), max(toks)
        if lo < 0 or hi >= vocab:
            raise DrafterError(
                f"DraftContext.tokens holds id {lo if lo < 0 else hi}, outside the vocabulary (0..{vocab - 1})"
            )
        pl = self.prompt_len
        if isinstance(pl, bool) or not isinstance(pl, Integral) or not 0 <= pl <= len(toks):
            raise DrafterError(
                f"DraftContext.prompt_len must be an integer in 0..{len(toks)}, got {pl!r:.40}"
            )


@dataclass(frozen=True)
class Feedback:
    """What verification told the drafters after a step: the tokens committed (accepted drafts + bonus) and the
    target logits of the verified tree's nodes on the accepted path ([S, V]; None when not kept). When the engine
    has them, also the accepted path's node indices, the target logits of every tree node (Token Recycling
    updates from all of them) and the final-norm hidden states of the path (EAGLE-style heads need the feature of
    every committed token, not only the last)."""

    committed: Sequence[int]
    tree: DraftTree
    path_logits: torch.Tensor | None = None
    path: torch.Tensor | None = None  # [S] int64 node indices of the accepted path, root first
    tree_logits: torch.Tensor | None = None  # [N, V] target logits of every verified node
    path_hidden: torch.Tensor | None = None  # [S, H] target final-norm hidden states along the path
    path_aux: torch.Tensor | None = None  # [S, len(aux_layers) * H] the residual streams at the aux layers


@runtime_checkable
class Drafter(Protocol):
    name: str
    exact_replay: bool  # True when the proposal depends only on the committed tokens (replays exactly)

    def reset(self, ctx: DraftContext) -> None:
        """Start a new sequence (the prompt is ``ctx.tokens``)."""

    def propose(self, ctx: DraftContext, shape: TreeShape) -> DraftTree:
        """A draft tree rooted at ``ctx.tokens[-1]`` that fits ``shape``."""

    def observe(self, ctx: DraftContext, feedback: Feedback) -> None:
        """Learn from the verified step (optional state update)."""

    # Optional: ``finish(ctx)``, called once when the sequence ends (the engine retires its row); a drafter that
    # learns across requests (the suffix drafter's global cache) takes the finished answer then.


@runtime_checkable
class BatchProposer(Protocol):
    """A drafter that drafts for several sequences in one go (the rows of a batch that chose it):
    ``propose_batch([(drafter, ctx, shape), ...])``, one drafter instance per sequence, returns their trees — the
    same trees ``propose`` gives one at a time."""

    def propose_batch(self, items: list[tuple[Any, DraftContext, TreeShape]]) -> list[DraftTree]: ...


@runtime_checkable
class Forkable(Protocol):
    """A drafter whose loaded weights another sequence can share: ``fork()`` is a fresh drafter over the same
    read-only weights, with its own state — but for what a drafter shares across requests by design (the suffix
    drafter's answer cache, the recycling drafter's table)."""

    def fork(self) -> Any: ...


@runtime_checkable
class Carries(Protocol):
    """A drafter with state that outlives a sequence (the suffix drafter's answer cache, the recycling drafter's
    table): ``carried()`` is that state as named arrays, ``restore(arrays)`` takes it back, checked (the arrays come
    from a file, which may be corrupted or hostile: a ``DrafterError`` names the problem) — so that a recording
    resumed after a kill goes on with the probes as they were, not empty. Such a drafter says with
    ``cross_request`` whether its proposals may read other requests' tokens as configured (a suffix cache of 0
    requests does not). ``vocab``: the target's vocabulary size, where known — state that could not have come
    from that target (a token id outside it, a table of another size) is refused then, not at the first proposal
    (or dropped)."""

    def carried(self) -> dict[str, np.ndarray]: ...

    def restore(self, arrays: dict[str, np.ndarray], vocab: int | None = None) -> None: ...


def prepare_drafter(drafter: Any, target: Any) -> None:
    """Load now what a drafter reads from files for ``target`` (a trained head: its ``prepare``; a hybrid's parts'),
    so that a bad file is refused before a run starts; a drafter without files has nothing to load. Drafting loads
    it all the same (once per target)."""
    prepare = getattr(drafter, "prepare", None)
    if prepare is not None:
        prepare(target)


def carried_state(drafters: dict[str, Any]) -> dict[str, np.ndarray]:
    """The carried state of every drafter of ``drafters`` that has one, as one set of arrays: each drafter's under
    its name (``NAME/KEY``) — what a recording, a run or a hybrid drafter saves for all its drafters at once."""
    return {
        f"{n}/{k}": v for n, d in drafters.items() if isinstance(d, Carries) for k, v in d.carried().items()
    }


def restore_state(drafters: dict[str, Any], arrays: dict[str, np.ndarray], vocab: int | None = None) -> None:
    """``carried_state``'s arrays back into the drafters that carry state (each checks its own: ``DrafterError``;
    ``vocab``: the target's vocabulary size, as ``Carries.restore`` takes it)."""
    for n, d in drafters.items():
        if isinstance(d, Carries):
            d.restore({k.removeprefix(f"{n}/"): v for k, v in arrays.items() if k.startswith(f"{n}/")}, vocab)


def int_array(owner: str, name: str, arrays: dict[str, np.ndarray], ndim: int) -> np.ndarray:
    """``arrays[name]``: an integer array of ``ndim`` dimensions, as int64 (a ``DrafterError`` otherwise)."""
    a = arrays.get(name)
    if not isinstance(a, np.ndarray) or a.ndim != ndim or a.dtype.kind not in "iu":
        raise DrafterError(f"{owner} state: {name} must be an integer array of {ndim} dimensions")
    return a.astype(np.int64, copy=False)


def keyword_options(cls: Any) -> list[str]:
    """Keyword arguments a class accepts, following ``**kwargs`` up the base classes."""
    names: list[str] = []
    for klass in getattr(cls, "__mro__", (cls,)):
        init = getattr(klass, "__init__", None)
        if init is None or init is object.__init__:
            break
        params = inspect.signature(init).parameters.values()
        names += [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return [n for n in dict.fromkeys(names) if n != "self"]
