"""The batch-native step: many sequences, each with its own arm and context length, verified in ONE target forward.

- ``RaggedCache``: a ``transformers`` ``Cache`` of our own. Preallocated slots ``[rows, kv_heads, capacity, dim]``
  per layer, grown in chunks; row ``r`` holds ``lens[r]`` committed tokens (every committed token of its sequence
  but the last, the root of its next tree), and a step writes row ``r``'s ``q`` nodes at positions
  ``lens[r] .. lens[r] + q - 1`` of that row — so rows of different lengths share one forward.
- ``BatchTarget``: the Hugging Face causal LM over that cache. A step's input is ``[B, N]`` (trees padded to a
  common node count), per-row positions (``lens[r] + depth``) and a per-row mask ``[B, 1, N, S]``: node ``i`` of row
  ``r`` sees the row's committed tokens and its own ancestors (itself included), nothing of other rows and no
  padding. The commit moves each row's accepted path into place (``kernels.compact_kv_``). Rows are kept packed in
  slots ``0 .. B-1``: a retired row's slot takes the last row, so the cache the model reads is a view, not a copy.
- ``BatchEngine``: drafts per row (each row has its own drafter instances and ``DraftContext``), verifies all trees
  with ``kernels.verify`` in one call, commits per row and gives each row's drafters their feedback.

Works for Llama-architecture models (``LlamaForCausalLM``: SmolLM2, Llama 2/3, any local folder of that
architecture); other architectures are refused with one line.
Invariants match ``env.target`` (the single-sequence path): greedy output equals greedy autoregressive output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache

import kernels
from drafters import DraftContext, Drafter, DraftTree, Feedback, make_drafter
from env.engine import Arm, Sampling
from env.model import LoadedModel, ModelError
from env.target import check_prompt, eos_ids

# config.model_type. Mistral and Qwen2 read the cache the same way but may use a sliding window, which the masks
# built here do not reproduce: refused until tested; Gemma's layers differ (norms, embedding scale).
SUPPORTED = ("llama",)
BATCH_DRAFTERS = ("ngram", "recycling", "eagle")  # early_exit runs the target's first layers on its own cache
CHUNK = 256  # cache growth, in positions


class RaggedCache(Cache):
    """Per-layer K/V ``[rows, kv_heads, capacity, dim]``; ``lens[r]`` committed positions of row ``r``."""

    def __init__(self, layers: int, rows: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: Any):
        super().__init__(layers=[])
        self.n_layers, self.rows, self.kv_heads, self.head_dim = layers, rows, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.capacity = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.lens = [0] * rows
        self._write: tuple[torch.Tensor, torch.Tensor, int, int] | None = (
            None  # set by BatchTarget per forward
        )
        self.grow(CHUNK)

    def grow(self, need: int) -> None:
        """Make room for ``need`` positions per row (in chunks); existing entries are kept."""
        if need <= self.capacity:
            return
        cap = -(-need // CHUNK) * CHUNK
        shape = (self.rows, self.kv_heads, cap, self.head_dim)
        for i in range(self.n_layers):
            for store in (self.k, self.v):
                new = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if i < len(store):
                    new[:, :, : self.capacity] = store[i]
                    store[i] = new
                else:
                    store.append(new)
        self.capacity = cap

    # ---- what the model calls ----
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Write this forward's ``[B, H, q, D]`` states at each row's positions; return ``[B, H, S, D]`` views."""
        rows_idx, pos_idx, batch, span = self._write  # pos_idx: [B, q] absolute slots of the nodes
        k, v = self.k[layer_idx], self.v[layer_idx]
        k[rows_idx, :, pos_idx] = key_states.transpose(1, 2)
        v[rows_idx, :, pos_idx] = value_states.transpose(1, 2)
        return k[:batch, :, :span], v[:batch, :, :span]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.lens) if self.lens else 0

    # ---- rows ----
    def move_row(self, src: int, dst: int) -> None:
        """Row ``src``'s entries into slot ``dst`` (packing the rows after one retires)."""
        n = self.lens[src]
        for store in (self.k, self.v):
            for t in store:
                t[dst, :, :n] = t[src, :, :n]
        self.lens[dst], self.lens[src] = n, 0


@dataclass
class Row:
    """A sequence in the batch: its committed tokens (prompt included; the last is the root of its next tree)."""

    tokens: list[int]
    prompt_len: int
    ctx: DraftContext
    drafters: dict[str, Drafter] = field(default_factory=dict)
    last_hidden: torch.Tensor | None = None
    last_logits: torch.Tensor | None = None
    slot: int = -1

    @property
    def past_len(self) -> int:
        return len(self.tokens) - 1


@dataclass(frozen=True)
class RowStep:
    """One row's outcome of a batch step (the per-row ``StepResult``)."""

    arm: Arm
    committed: list[int]  # accepted draft tokens + the bonus token
    accepted: int
    drafted: int
    nodes: int  # verified nodes of this row's tree, root included (its share of the forward)


def check_architecture(loaded: LoadedModel) -> None:
    kind = getattr(loaded.model.config, "model_type", "?")
    if kind not in SUPPORTED:
        raise ModelError(
            f"the batch engine runs {', '.join(SUPPORTED)} models; {loaded.model_id} is a {kind!r} model "
            "(use draftgym generate / bench, which decode one sequence at a time with any causal LM)"
        )


class BatchTarget:
    """The target over a ``RaggedCache`` of ``max_rows`` slots: prefill into a slot, batched tree forward, commit."""

    def __init__(self, loaded: LoadedModel, max_rows: int) -> None:
        check_architecture(loaded)
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.max_context = loaded.max_context
        c = loaded.model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.cache = RaggedCache(
            c.num_hidden_layers, max_rows, c.num_key_value_heads, head_dim, loaded.dtype, loaded.device
        )
        self.rows: list[Row] = []  # row i lives in slot i
        self.eos_ids: frozenset[int] = eos_ids(loaded)

    @property
    def max_rows(self) -> int:
        return self.cache.rows

    def room(self, row: Row) -> int:
        return self.max_context - row.past_len

    @torch.no_grad()
    def _forward(
        self, ids: torch.Tensor, pos: torch.Tensor, allowed: torch.Tensor, lens: list[int]
    ) -> torch.Tensor:
        """ids, pos: [B, q] (rows 0..B-1); allowed: bool [B, q, q] (node i may see node j); returns hidden [B, q, H]."""
        b, q = ids.shape
        span = max(lens) + q
        self.cache.grow(span)
        base = torch.tensor(lens, device=self.device)[:, None]
        slots = base + torch.arange(q, device=self.device)[None]  # [B, q] where the nodes go
        key_pos = torch.arange(span, device=self.device)
        see = key_pos[None, None, :] < base[:, :, None]  # [B, 1, S] committed positions
        see = see.expand(b, q, span).clone()
        rel = key_pos[None, :] - base  # [B, S] node index of each key position, for this step's slots
        in_step = (rel >= 0) & (rel < q)
        node_of = rel.clamp(0, q - 1)
        tree_see = torch.gather(allowed.to(self.device), 2, node_of[:, None, :].expand(b, q, span))
        see |= tree_see & in_step[:, None, :]
        mask = torch.zeros(b, 1, q, span, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~see[:, None], torch.finfo(self.dtype).min)
        rows_idx = torch.arange(b, device=self.device)[:, None].expand(b, q)
        self.cache._write = (rows_idx, slots, b, span)
        try:
            out = self.model.model(
                input_ids=ids.to(self.device), attention_mask=mask, position_ids=pos.to(self.device),
                cache=self.cache, use_cache=True,
            )  # fmt: skip
        finally:
            self.cache._write = None
        return out.last_hidden_state

    def admit(self, prompt_ids: list[int], ctx_factory) -> tuple[Row, torch.Tensor]:
        """Prefill ``prompt_ids`` into the next free slot (whole prompt, one forward); returns the row and the
        logits [V] that predict its first new token (the caller appends it: it becomes the root)."""
        check_prompt(prompt_ids, self.max_context)
        if len(self.rows) >= self.max_rows:
            raise RuntimeError("no free row slot")  # the scheduler admits only when a slot is free
        slot = len(self.rows)
        p = len(prompt_ids)
        hidden = self._prefill_one(slot, prompt_ids)  # the other rows take no part in a prefill
        self.cache.lens[slot] = p
        row = Row(tokens=list(prompt_ids), prompt_len=p, ctx=None, slot=slot)  # type: ignore[arg-type]
        row.last_hidden = hidden[-1]
        row.last_logits = self.model.lm_head(hidden[-1])
        row.ctx = ctx_factory(row, hidden)
        self.rows.append(row)
        return row, row.last_logits

    def _prefill_one(self, slot: int, prompt_ids: list[int]) -> torch.Tensor:
        """Prefill a single row into ``slot`` without touching the others: its states are computed on a one-row
        cache and copied into the slot."""
        p = len(prompt_ids)
        one = RaggedCache(
            self.cache.n_layers, 1, self.cache.kv_heads, self.cache.head_dim, self.dtype, self.device
        )
        saved, self.cache = self.cache, one
        try:
            allowed = torch.tril(torch.ones(p, p, dtype=torch.bool))[None]
            hidden = self._forward(torch.tensor([prompt_ids]), torch.arange(p)[None], allowed, [0])[0]
        finally:
            self.cache = saved
        self.cache.grow(p)
        for store, src in ((self.cache.k, one.k), (self.cache.v, one.v)):
            for t, s in zip(store, src):
                t[slot, :, :p] = s[0, :, :p]
        return hidden

    def retire(self, row: Row) -> None:
        """Free the row's slot; the last row moves into it (rows stay packed in slots 0..B-1)."""
        last = len(self.rows) - 1
        if row.slot != last:
            self.cache.move_row(last, row.slot)
            moved = self.rows[last]
            moved.slot = row.slot
            self.rows[row.slot] = moved
        else:
            self.cache.lens[last] = 0
        self.rows.pop()
        row.slot = -1

    def forward_trees(
        self, trees: list[DraftTree]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One forward over every row's tree (row i = ``self.rows[i]``), padded to a common node count.
        Returns logits [B, N, V], hidden [B, N, H], padded tokens and parents [B, N]."""
        b = len(trees)
        n = max(t.num_nodes for t in trees)
        tokens = torch.zeros(b, n, dtype=torch.long)
        parents = torch.full((b, n), -1, dtype=torch.long)
        num = torch.tensor([t.num_nodes for t in trees])
        for i, t in enumerate(trees):
            tokens[i, : t.num_nodes] = t.tokens
            parents[i, : t.num_nodes] = t.parents
        parents[:, 1:].clamp_(min=0)  # padding nodes hang off the root: masked by num_nodes in verify
        buf = kernels.tree_buffers(parents, num_nodes=num)
        allowed = buf.ancestor_mask.clone()  # [B, N, N] node i sees its ancestors and itself
        pad = torch.arange(n)[None, :] >= num[:, None]  # padding nodes see only themselves
        allowed[pad] = torch.eye(n, dtype=torch.bool)[None].expand(b, n, n)[pad]
        lens = [self.cache.lens[r] for r in range(b)]
        pos = torch.tensor(lens)[:, None] + buf.depth.cpu()
        hidden = self._forward(tokens, pos, allowed, lens)
        return self.model.lm_head(hidden), hidden, tokens, parents

    def commit(self, row: Row, tree: DraftTree, path: torch.Tensor, next_token: int) -> list[int]:
        """Keep the row's accepted path in its cache (moved into place), make ``next_token`` its new root."""
        s = int(path.shape[0])
        base = self.cache.lens[row.slot]
        if not torch.equal(path.cpu(), torch.arange(s)):
            idx = path.to(self.device)
            for store in (self.cache.k, self.cache.v):
                for t in store:
                    kernels.compact_kv_(t[row.slot : row.slot + 1], base, idx)
        self.cache.lens[row.slot] = base + s
        committed = [int(x) for x in tree.tokens[path.cpu()[1:]].tolist()] + [int(next_token)]
        row.tokens.extend(committed)
        return committed


class BatchEngine:
    """Rows with their own arms, one verification forward per step (``step``), prefill on ``admit``."""

    def __init__(self, loaded: LoadedModel, max_rows: int, sampling: Sampling = Sampling(), seed: int = 0,
                 drafter_options: dict[str, dict[str, Any]] | None = None) -> None:  # fmt: skip
        self.target = BatchTarget(loaded, max_rows)
        self.sampling = sampling
        self.generator = torch.Generator().manual_seed(seed)
        self.drafter_options = drafter_options or {}

    def _verify(self, tokens, parents, logits, num_nodes) -> kernels.Verdict:
        s = self.sampling
        return kernels.verify(
            tokens.to(logits.device), parents.to(logits.device), logits, num_nodes=num_nodes.to(logits.device),
            temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, generator=self.generator,
        )  # fmt: skip

    def admit(self, prompt_ids: list[int], drafter_names: list[str]) -> tuple[Row, int]:
        """Prefill a new row and pick its first token; ``drafter_names``: the drafters its arms use."""
        for name in drafter_names:
            if name not in BATCH_DRAFTERS:
                from drafters import DrafterError

                raise DrafterError(
                    f"drafter {name!r} does not run in the batch engine yet; batch drafters: {', '.join(BATCH_DRAFTERS)}"
                )

        def make_ctx(row: Row, hidden: torch.Tensor) -> DraftContext:
            ctx = DraftContext(tokens=row.tokens, prompt_len=row.prompt_len, target=self.target)
            ctx.extras["prompt_hidden"] = hidden
            return ctx

        row, logits = self.target.admit(prompt_ids, make_ctx)
        root = DraftTree.root_only(prompt_ids[-1])
        v = self._verify(root.tokens[None], root.parents[None], logits[None, None], torch.tensor([1]))
        first = int(v.next_token[0])
        row.tokens.append(first)
        row.ctx.last_hidden = row.last_hidden
        row.drafters = {
            n: make_drafter(n, **self.drafter_options.get(n, {})) for n in dict.fromkeys(drafter_names)
        }
        for d in row.drafters.values():
            d.reset(row.ctx)
        return row, first

    def retire(self, row: Row) -> None:
        self.target.retire(row)

    def step(self, arms: list[Arm]) -> tuple[list[RowStep], float, float]:
        """One step over every row (``arms[i]`` for ``target.rows[i]``): draft, one forward, verify, commit.
        Returns the per-row results, the drafting seconds and the verify (forward + verify + commit) seconds."""
        rows = self.target.rows
        assert len(arms) == len(rows)
        t0 = time.perf_counter()
        trees = []
        for row, arm in zip(rows, arms):
            root = row.tokens[-1]
            if arm.drafter is None or arm.shape.depth == 0:
                tree = DraftTree.root_only(root)
            else:
                tree = row.drafters[arm.drafter].propose(row.ctx, arm.shape)
                if tree.num_nodes > self.target.room(row):
                    tree = DraftTree.root_only(root)
            trees.append(tree)
        t1 = time.perf_counter()
        logits, hidden, tokens, parents = self.target.forward_trees(trees)
        num = torch.tensor([t.num_nodes for t in trees])
        verdict = self._verify(tokens, parents, logits, num)
        out = []
        for i, (row, arm, tree) in enumerate(zip(rows, arms, trees)):
            path = verdict.path[i]
            path = path[path >= 0]
            committed = self.target.commit(row, tree, path, int(verdict.next_token[i]))
            last = int(path[-1])
            row.last_hidden = hidden[i, last]
            row.last_logits = logits[i, last].clone()
            row.ctx.last_hidden = row.last_hidden
            if row.drafters:
                fb = Feedback(committed=committed, tree=tree, path_logits=logits[i, path], path=path,
                              tree_logits=logits[i, : tree.num_nodes], path_hidden=hidden[i, path])  # fmt: skip
                for d in row.drafters.values():
                    d.observe(row.ctx, fb)
            out.append(RowStep(arm, committed, int(verdict.accept_len[i]), tree.num_draft, tree.num_nodes))
        return out, t1 - t0, time.perf_counter() - t1
