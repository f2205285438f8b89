"""The batch-native step: many sequences, each with its own arm and context length, verified in ONE target forward.

- ``env.ragged_cache.RaggedCache`` holds the rows' keys and values (per-row lengths, one forward over rows of
  different lengths).
- ``BatchTarget``: the Hugging Face causal LM over that cache. A step's input is ``[B, N]`` (trees padded to a
  common node count), per-row positions (``lens[r] + depth``) and a per-row mask ``[B, 1, N, S]``: node ``i`` of row
  ``r`` sees the row's committed tokens and its own ancestors (itself included), nothing of other rows and no
  padding. The commit moves each row's accepted path into place (``kernels.compact_kv_``). Rows are kept packed in
  slots ``0 .. B-1``: a retired row's slot takes the last row, so the cache the model reads is a view, not a copy.
- ``BatchEngine``: drafts per row (each row has its own drafter instances and ``DraftContext``), verifies all trees
  with ``kernels.verify`` in one call, commits per row and gives each row's drafters their feedback. A single
  sequence is a batch of one: the decoder, the live env, the trace recorder and calibration all run this step
  (through ``env.step.Stepper``, which owns the bookkeeping around it).

Architectures: see ``SUPPORTED``; others are refused with one line.
Invariant: greedy output equals greedy autoregressive output (Hugging Face ``generate``), token for token in fp32.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

import kernels
from drafters import BatchProposer, DraftContext, Drafter, DraftTree, Feedback
from drafters.heads import aux_layers
from env.engine import Arm, Sampling, StepResult
from env.lean import lean_of
from env.model import LoadedModel, ModelError
from env.ragged_cache import RaggedCache, RowKV, Write, hf_ragged_cache
from env.target import check_prompt, eos_ids


def row_seed(seed: int, number: int) -> int:
    """The seed of the ``number``-th row admitted under ``seed`` (mixed: neighbouring rows' streams unrelated)."""
    import numpy as np

    return int(np.random.SeedSequence([int(seed), int(number)]).generate_state(1, np.uint64)[0] >> 1)


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
    last_aux: torch.Tensor | None = None  # the target's residual streams at ``aux_layers`` at the last node
    path_hidden: torch.Tensor | None = None  # [S, H] final hidden states of the last step's accepted path
    prompt_aux: torch.Tensor | None = None  # the prompt's, between prefill and the drafters' reset
    generator: torch.Generator | None = (
        None  # the row's own coins (sampling): its text does not depend on the batch
    )

    @property
    def past_len(self) -> int:
        return len(self.tokens) - 1


@dataclass
class Prefill:
    """A prompt being prefilled into a cache of its own (``BatchTarget.begin_prefill``), ``done`` tokens so far."""

    prompt_ids: list[int]
    cache: RaggedCache
    done: int = 0
    hidden: list[torch.Tensor] = field(default_factory=list)  # final hidden states of each chunk
    aux: list[torch.Tensor] = field(default_factory=list)  # residual streams at the target's aux layers

    @property
    def finished(self) -> bool:
        return self.done == len(self.prompt_ids)


# config.model_type -> when the batch engine reproduces the model exactly (its masks are full causal attention over
# each row: no sliding window). Each was checked token for token against Hugging Face greedy ``generate`` on a
# small random model of that architecture (tests/env/test_architectures.py).
SUPPORTED = {
    "llama": "Llama 2/3, SmolLM2, any LlamaForCausalLM folder",
    "qwen2": "Qwen2 / Qwen2.5 without a sliding window",
    "mistral": "Mistral without a sliding window (or one longer than the context)",
}


def check_architecture(loaded: LoadedModel) -> None:
    c = loaded.config
    kind = getattr(c, "model_type", "?")
    if kind not in SUPPORTED:
        raise ModelError(
            f"{loaded.model_id} is a {kind!r} model; the engine runs {', '.join(SUPPORTED)} models "
            "(Gemma and others differ in their attention or logits and are not supported yet)"
        )
    window = getattr(c, "sliding_window", None)
    if kind == "qwen2" and not getattr(c, "use_sliding_window", False):
        window = None
    if window is not None and window < loaded.max_context:
        raise ModelError(
            f"{loaded.model_id} attends through a sliding window of {window} tokens, shorter than its context of "
            f"{loaded.max_context}; the engine's masks are full causal attention (not supported yet)"
        )


class BatchTarget:
    """The target over a ``RaggedCache`` of ``max_rows`` slots: prefill into a slot, batched tree forward, commit.
    It is the ``drafters.TargetModel`` the drafters see."""

    def __init__(self, loaded: LoadedModel, max_rows: int) -> None:
        check_architecture(loaded)
        self.loaded = loaded
        self.model_id = loaded.model_id
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.max_context = loaded.max_context
        c = self.config = loaded.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.net = lean_of(loaded)  # the lean forward (Llama family), else None: the transformers forward
        self._cache_cls = RaggedCache if self.net is not None else hf_ragged_cache
        self.cache = self._cache_cls(
            c.num_hidden_layers,
            max_rows,
            getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
            head_dim,
            loaded.dtype,
            loaded.device,
        )
        self.rows: list[Row] = []  # row i lives in slot i
        self.aux_layers = aux_layers(int(c.num_hidden_layers))
        self.last_aux: torch.Tensor | None = None  # [B, q, len(aux_layers) * H] of the last forward
        self.eos_ids: frozenset[int] = eos_ids(loaded)
        self.weights = loaded.weights if self.net is not None else "dense"

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of final hidden states (the target's LM head, in its weight format)."""
        return self.net.head(hidden) if self.net is not None else self.model.lm_head(hidden)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def model(self):
        """The transformers model (drafters with trained heads use its layers; built on first use)."""
        return self.loaded.model

    @property
    def max_rows(self) -> int:
        return self.cache.rows

    def room(self, row: Row) -> int:
        """How many tree nodes still fit in the row's context."""
        return self.max_context - row.past_len

    @torch.no_grad()
    def _forward(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        allowed: torch.Tensor | None,
        lens: list[int],
        first: int = 0,
        cache: RaggedCache | None = None,
    ) -> torch.Tensor:
        """Rows ``first .. first+B-1`` of ``cache`` (default: the batch's): ids, pos [B, q]; allowed: bool [B, q, q] (node i may see node j), None for
        causal over the new nodes; returns hidden [B, q, H].

        One row under causal attention (a plain token, a chain, a prefill) is what Hugging Face decodes itself:
        the model builds its own mask from the cache's sizes, as it would over a ``DynamicCache``, so a batch of
        one computes exactly what ``generate`` computes (bf16 included). Otherwise each row gets its own mask:
        its committed positions, and of this step's nodes its tree ancestors and itself."""
        cache = self.cache if cache is None else cache
        b, q = ids.shape
        span = max(lens) + q
        cache.grow(span)
        dev = self.device
        base = torch.tensor(lens, device=dev)[:, None]
        slots = base + torch.arange(q, device=dev)[None]  # [B, q] where the nodes go
        mask = see = None
        if b > 1 or allowed is not None:
            key_pos = torch.arange(span, device=dev)
            see = key_pos[None, None, :] < base[:, :, None]  # [B, 1, S] committed positions
            rel = key_pos[None, :] - base  # [B, S] node index of each key position, for this step's slots
            in_step = ((rel >= 0) & (rel < q))[:, None, :]
            if allowed is None:  # causal over the new nodes
                see = see | (in_step & (rel[:, None, :] <= torch.arange(q, device=dev)[None, :, None]))
            else:
                node_of = rel.clamp(0, q - 1)
                tree_see = torch.gather(allowed.to(dev), 2, node_of[:, None, :].expand(b, q, span))
                see = see | (tree_see & in_step)
            if self.net is None:
                mask = torch.zeros(b, 1, q, span, dtype=self.dtype, device=dev)
                mask.masked_fill_(~see[:, None], torch.finfo(self.dtype).min)
        rows_idx = torch.arange(first, first + b, device=dev)[:, None].expand(b, q)
        write = Write(rows_idx, slots, first, first + b, span, lens[0])
        if self.net is not None:
            hidden, self.last_aux = self.net.forward(
                ids.to(dev), pos.to(dev), cache, write, None if see is None else see[:, None], self.aux_layers
            )
            return hidden
        cache._write = write
        try:
            out = self.model.model(
                input_ids=ids.to(dev), attention_mask=mask, position_ids=pos.to(dev),
                cache=cache, use_cache=True, output_hidden_states=True,
            )  # fmt: skip
        finally:
            cache._write = None
        self.last_aux = torch.cat([out.hidden_states[n] for n in self.aux_layers], dim=-1)
        return out.last_hidden_state

    def begin_prefill(self, prompt_ids: list[int]) -> Prefill:
        """A prompt to prefill, chunk by chunk (``prefill_chunk``), into a one-row cache of its own: the rows of
        the batch take no part in it and may step in between."""
        check_prompt(prompt_ids, self.max_context, vocab_size=self.vocab_size)
        c = self.cache
        own = self._cache_cls(c.n_layers, 1, c.kv_heads, c.head_dim, self.dtype, self.device)
        return Prefill(list(prompt_ids), own)

    def prefill_chunk(self, pf: Prefill, chunk: int | None = None) -> bool:
        """Run the next ``chunk`` prompt tokens (None: all that are left); True when the prompt is done."""
        a = pf.done
        b = len(pf.prompt_ids) if chunk is None else min(len(pf.prompt_ids), a + chunk)
        ids = torch.tensor([pf.prompt_ids[a:b]], dtype=torch.long)
        pf.hidden.append(self._forward(ids, torch.arange(a, b)[None], None, [a], cache=pf.cache)[0])
        pf.aux.append(self.last_aux[0])
        pf.cache.lens[0] = pf.done = b
        return pf.finished

    def admit(self, pf: Prefill) -> tuple[Row, torch.Tensor]:
        """Move a finished prefill into the next free slot; returns the row and the prompt's final hidden states
        [P, H] (the last predicts its first new token: the caller appends it, it becomes the root)."""
        if not pf.finished:
            raise RuntimeError("the prompt is not prefilled yet")
        if len(self.rows) >= self.max_rows:
            raise RuntimeError("no free row slot")  # the scheduler admits only when a slot is free
        slot, p = len(self.rows), len(pf.prompt_ids)
        self.cache.grow(p)
        for store, own in ((self.cache.k, pf.cache.k), (self.cache.v, pf.cache.v)):
            for t, o in zip(store, own):
                t[slot, :, :p] = o[0, :, :p]
        self.cache.lens[slot] = p
        hidden = pf.hidden[0] if len(pf.hidden) == 1 else torch.cat(pf.hidden)
        row = Row(tokens=list(pf.prompt_ids), prompt_len=p, ctx=None, slot=slot)  # type: ignore[arg-type]
        row.last_hidden = hidden[-1]
        pf_aux = pf.aux[0] if len(pf.aux) == 1 else torch.cat(pf.aux)
        row.last_aux = pf_aux[-1]
        row.prompt_aux = pf_aux  # handed to the drafters with the context, then dropped
        with torch.no_grad():
            row.last_logits = self.head(hidden[-1])
        self.rows.append(row)
        pf.cache = None  # type: ignore[assignment]  # its entries live in the slot now
        return row, hidden

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
        lens = [self.cache.lens[r] for r in range(b)]
        chain = torch.arange(-1, n - 1)
        if all(t.num_nodes == n and torch.equal(t.parents, chain) for t in trees):  # chains of one length
            allowed, depth = None, torch.arange(n)[None].expand(b, n)
        else:  # the tree buffers where the model runs (on CUDA: the Triton tree kernel)
            dev = self.device
            num_d = num.to(dev)
            buf = kernels.tree_buffers(parents.to(dev), num_nodes=num_d)
            pad = (torch.arange(n, device=dev)[None, :] >= num_d[:, None])[:, :, None]  # padding: sees itself
            allowed = torch.where(pad, torch.eye(n, dtype=torch.bool, device=dev)[None], buf.ancestor_mask)
            depth = buf.depth  # [B, N]
        pos = torch.tensor(lens, device=depth.device)[:, None] + depth
        hidden = self._forward(tokens, pos, allowed, lens)
        with torch.no_grad():
            logits = self.head(hidden)
        return logits, hidden, tokens, parents

    def commit(self, row: Row, tree: DraftTree, path: torch.Tensor, next_token: int) -> list[int]:
        """Keep the row's accepted path in its cache (moved into place), make ``next_token`` its new root."""
        s = int(path.shape[0])
        base = self.cache.lens[row.slot]
        path_cpu = path.cpu()
        if not torch.equal(path_cpu, torch.arange(s)):
            idx = path.to(self.device)
            first = True  # the path and slot checked once: every layer's K and V has one shape
            for store in (self.cache.k, self.cache.v):
                for t in store:
                    kernels.compact_kv_(t[row.slot : row.slot + 1], base, idx, check=first)
                    first = False
        self.cache.lens[row.slot] = base + s
        committed = [int(x) for x in tree.tokens[path_cpu[1:]].tolist()] + [int(next_token)]
        row.tokens.extend(committed)
        return committed


class BatchEngine:
    """Rows with their own arms, one verification forward per step (``step``), prefill on ``admit``. The sampling
    settings and the seed may be set between steps (``configure``).

    Sampling draws each row's coins from the row's own generator, seeded by (seed, the row's admission number):
    exactly its tree's nodes and one final draw per step, so a row's coins depend on the seed and the order rows
    were admitted in, not on its slot, the other rows' trees or when they came and went. (Its trees may: drafters
    that share state across rows by design, the suffix cache and the recycling table, learn from its neighbours.)"""

    def __init__(
        self, loaded: LoadedModel, max_rows: int, sampling: Sampling = Sampling(), seed: int = 0
    ) -> None:
        self.target = BatchTarget(loaded, max_rows)
        self.sampling = sampling
        self.seed, self.admitted = seed, 0

    def configure(self, sampling: Sampling, seed: int) -> None:
        """Sampling settings and the seed of the rows admitted from now on (numbered from 0 again)."""
        self.sampling = sampling
        self.seed, self.admitted = seed, 0

    def _verify(self, tokens, parents, logits, num_nodes, gens: list[torch.Generator]) -> kernels.Verdict:
        s = self.sampling
        coins = final = None
        if (
            s.temperature > 0
        ):  # each row's own uniforms: its nodes' (the padding's are never read) and the final draw
            n = tokens.shape[1]
            coins = torch.zeros(len(gens), n)
            final = torch.empty(len(gens))
            for i, (g, k) in enumerate(zip(gens, num_nodes.tolist())):
                coins[i, :k] = torch.rand(k, generator=g)
                final[i] = torch.rand(1, generator=g)[0]
        return kernels.verify(
            tokens.to(logits.device), parents.to(logits.device), logits, num_nodes=num_nodes.to(logits.device),
            temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, coins=coins, final_coins=final,
        )  # fmt: skip

    def begin_prefill(self, prompt_ids: list[int]) -> Prefill:
        return self.target.begin_prefill(prompt_ids)

    def prefill_chunk(self, pf: Prefill, chunk: int | None = None) -> bool:
        return self.target.prefill_chunk(pf, chunk)

    def admit(self, prompt_ids: list[int], drafters: Mapping[str, Drafter], prefill: Prefill | None = None,
              seed: int | None = None) -> tuple[Row, int]:  # fmt: skip
        """Prefill a new row (whole, or ``prefill``: one already prefilled chunk by chunk) and pick its first
        token; ``drafters``: the row's drafter instances by name (reset here for this sequence: a drafter
        instance serves one row at a time). ``seed``: the row's own sampling seed (a request's): its stream is
        that of the first row admitted under it, whatever its order; the rows after it keep their numbers."""
        if prefill is None:
            prefill = self.begin_prefill(prompt_ids)
            self.prefill_chunk(prefill)
        elif prefill.prompt_ids != list(prompt_ids):
            raise ValueError("the prefill is of another prompt")
        row, hidden = self.target.admit(prefill)
        own = row_seed(self.seed, self.admitted) if seed is None else row_seed(seed, 0)
        row.generator = torch.Generator().manual_seed(own)
        self.admitted += 1
        prompt_aux, row.prompt_aux = row.prompt_aux, None
        logits = row.last_logits
        root = DraftTree.root_only(prompt_ids[-1])
        v = self._verify(
            root.tokens[None], root.parents[None], logits[None, None], torch.tensor([1]), [row.generator]
        )
        first = int(v.next_token[0])
        row.tokens.append(first)
        row.drafters = dict(drafters)
        try:
            row.ctx = DraftContext(
                tokens=row.tokens, prompt_len=row.prompt_len, target=self.target, last_hidden=row.last_hidden,
                prompt_hidden=hidden, target_kv=RowKV(self.target.cache, row), last_aux=row.last_aux,
                prompt_aux=prompt_aux, aux_layers=self.target.aux_layers,
            )  # fmt: skip
            for d in row.drafters.values():
                d.reset(row.ctx)
        except BaseException:
            self.target.retire(row)  # a drafter that cannot start (no trained head, ...) leaves no row behind
            raise
        return row, first

    def retire(self, row: Row) -> None:
        """The row's sequence ended: its drafters hear of it (``finish``, optional: the suffix drafter's
        cross-request cache takes the answer then), and its slot is freed."""
        for d in row.drafters.values():
            finish = getattr(d, "finish", None)
            if finish is not None:
                finish(row.ctx)
        self.target.retire(row)

    def _drafter(self, row: Row, arm: Arm) -> Drafter:
        drafter = row.drafters.get(arm.drafter)  # type: ignore[arg-type]
        if drafter is None:
            known = ", ".join(sorted(row.drafters)) or "(none)"
            raise KeyError(f"arm {arm.name} needs drafter {arm.drafter!r}; the row's drafters: {known}")
        return drafter

    def propose(
        self,
        arms: list[Arm],
        given: list[DraftTree | None] | None = None,
        given_s: list[float] | None = None,
    ) -> tuple[list[DraftTree], list[float]]:
        """Every row's tree for its arm (``given[i]``: a tree already made for row i, in ``given_s[i]`` seconds,
        which become its drafting time; default 0), and each row's drafting seconds. Rows whose drafter batches
        (``drafters.BatchProposer``) are drafted in one call per drafter kind; a row gets the root alone for no
        draft, or when its context is nearly full."""
        rows = self.target.rows
        trees: list[DraftTree | None] = list(given) if given is not None else [None] * len(rows)
        draft_s = [
            float(given_s[i]) if given_s is not None and trees[i] is not None else 0.0
            for i in range(len(rows))
        ]
        groups: dict[type, list[int]] = {}
        for i, (row, arm) in enumerate(zip(rows, arms)):
            if trees[i] is not None:
                continue
            if arm.drafter is None or arm.shape.depth == 0:
                trees[i] = DraftTree.root_only(row.tokens[-1])
                continue
            d = self._drafter(row, arm)
            if isinstance(d, BatchProposer):
                groups.setdefault(type(d), []).append(i)
                continue
            t0 = time.perf_counter()
            trees[i] = d.propose(row.ctx, arm.shape)
            draft_s[i] = time.perf_counter() - t0
        for idx in groups.values():
            t0 = time.perf_counter()
            items = [(rows[i].drafters[arms[i].drafter], rows[i].ctx, arms[i].shape) for i in idx]
            for i, tree in zip(idx, items[0][0].propose_batch(items)):
                trees[i] = tree
            share = (time.perf_counter() - t0) / len(idx)
            for i in idx:
                draft_s[i] = share
        for i, row in enumerate(rows):
            if trees[i].num_nodes > self.target.room(row):  # type: ignore[union-attr]
                trees[i] = DraftTree.root_only(row.tokens[-1])
        return trees, draft_s  # type: ignore[return-value]

    def verify(self, arms: list[Arm], trees: list[DraftTree], draft_s: list[float]) -> list[StepResult]:
        """One forward over every row's tree (``trees[i]`` for ``target.rows[i]``), verify, commit, feedback.
        ``draft_s``: each row's drafting seconds; every row's ``verify_s`` is this batch forward's."""
        rows = self.target.rows
        if not len(arms) == len(trees) == len(rows):
            raise ValueError(f"{len(rows)} rows but {len(arms)} arms and {len(trees)} trees")
        t1 = time.perf_counter()
        logits, hidden, tokens, parents = self.target.forward_trees(trees)
        aux = self.target.last_aux
        num = torch.tensor([t.num_nodes for t in trees])
        verdict = self._verify(tokens, parents, logits, num, [row.generator for row in rows])
        done = []
        for i, (row, tree) in enumerate(zip(rows, trees)):
            path = verdict.path[i]
            path = path[path >= 0]
            committed = self.target.commit(row, tree, path, int(verdict.next_token[i]))
            last = int(path[-1])
            row.last_hidden = hidden[i, last]
            row.path_hidden = hidden[i, path]  # node j produced committed[j] (env.step: a sequence cut short)
            row.last_logits = logits[i, last].clone()  # a copy: frees the step's [B, N, V] logits
            row.ctx.last_hidden = row.last_hidden
            row.last_aux = row.ctx.last_aux = aux[i, last]
            if row.drafters:
                fb = Feedback(committed=committed, tree=tree, path_logits=logits[i, path], path=path,
                              tree_logits=logits[i, : tree.num_nodes], path_hidden=row.path_hidden,
                              path_aux=aux[i, path])  # fmt: skip
                for d in row.drafters.values():
                    d.observe(row.ctx, fb)
            done.append((committed, int(verdict.accept_len[i]), bool((tree.parents == last).any())))
        verify_s = time.perf_counter() - t1
        return [
            StepResult(arm, committed, accepted, tree.num_draft, ds, verify_s, tree.parents, rejected)
            for arm, tree, ds, (committed, accepted, rejected) in zip(arms, trees, draft_s, done)
        ]

    def step(self, arms: list[Arm]) -> list[StepResult]:
        """Draft with ``arms[i]`` for ``target.rows[i]``, then ``verify``."""
        trees, draft_s = self.propose(list(arms))
        return self.verify(list(arms), trees, draft_s)
