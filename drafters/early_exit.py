"""Early-exit self-speculation: draft with the target's own first ``l`` layers plus a trained exit adapter.

References: Kangaroo (Liu et al., arXiv 2404.18911) — a shallow sub-network of the target plus a one-layer adapter,
the target's LM head, and a confidence stop; LayerSkip (arXiv 2404.16710) and Draft & Verify (arXiv 2309.08168)
for self-speculation with the target's layers.

The draft for a token runs the target's layers 0..l-1 on it, reading those layers' keys/values of the committed
prefix straight from the target's KV cache (shared, read-only: no second prefill, no copy), then the adapter — one
Llama decoder layer initialised as target layer ``l`` and trained by self-distillation (``drafters.train``) —
attends over the adapter states of the committed tokens and of the draft ancestors, and the frozen LM head cut to
the draft vocabulary gives the next-token distribution. Tree nodes keep temporary keys/values for the l layers and
the adapter; nothing is written into the target's cache.

Each step starts by catching up: the tokens committed since the last proposal (in the target's cache now) and the
root (not yet in it) go through the l layers in one batched pass, which gives the adapter their states; the rows
of a batch catch up together, in one pass of the l layers' and the adapter's products (``_catch_up_many``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from drafters.base import (
    DraftContext,
    DrafterError,
    DraftTree,
    Feedback,
    TargetModel,
    TreeShape,
    float_option,
    path_option,
)
from drafters.head_cache import KVBuffer, TreeSlots
from drafters.heads import (
    DraftLayer,
    HeadConfig,
    RMSNorm,
    attend,
    find_head,
    head_dtype,
    load_head,
    load_state,
)
from drafters.lockstep import Growing, propose_lockstep
from drafters.trees import tree_option, tree_steps
from kernels.packed import Reordered, reorder_linears


class ExitAdapter(nn.Module):
    """The residual stream after ``exit_layer`` target layers -> one decoder layer -> norm: a guess of the target's
    final feature (decoded by the target's LM head)."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer = DraftLayer(cfg)
        self.norm = RMSNorm(cfg.hidden, cfg.rms_eps)

    def forward_train(self, h: torch.Tensor) -> torch.Tensor:
        """Teacher-forced: h [B, T, H] states after ``exit_layer`` layers -> [B, T, H], causal attention."""
        t = h.shape[1]
        pos = torch.arange(t, device=h.device)
        q, k, v = self.layer.project(h, pos)
        causal = torch.ones(t, t, dtype=torch.bool, device=h.device).tril()
        return self.norm(self.layer.finish(h, attend(q, k, v, causal[None, None])))


class EarlyExitDrafter:
    """Options: ``weights`` (an adapter file; default: the user's trained one, else the shipped one), ``tree``
    (``dynamic`` | ``kary`` | ``chain``), ``min_prob`` (confidence stop on the path probability; Kangaroo uses a
    per-token 0.6 on chains)."""

    name = "early_exit"
    exact_replay = False

    def __init__(self, weights: str | None = None, tree: str = "dynamic", min_prob: float = 0.0) -> None:
        self.weights = path_option(self.name, "weights", weights)
        self.tree = tree_option(self.name, tree)
        self.min_prob = float_option(self.name, "min_prob", min_prob, 0.0, 1.0)
        self.adapter: ExitAdapter | None = None
        self._target_key = None

    def _load(self, target: TargetModel) -> None:
        if self._target_key == (id(target.model), target.dtype):
            return
        model_id = target.model_id
        path = find_head("early_exit", model_id, self.weights)
        cfg, tensors, self.meta = load_head(path, "early_exit", target.model, model_id)
        if not 1 <= cfg.exit_layer < target.model.config.num_hidden_layers:
            raise DrafterError(f"{path}: exit layer {cfg.exit_layer} does not fit this target")
        adapter = ExitAdapter(cfg)
        self.dtype = target.dtype  # the target's layers run in its dtype; the adapter follows head_dtype
        self.adapter_dtype = head_dtype(target)
        load_state(adapter, tensors, str(path), dtype=self.adapter_dtype)  # finite in the dtype it runs in
        self.device = torch.device(target.device)
        self.adapter = reorder_linears(
            adapter.to(self.device, self.adapter_dtype).eval().requires_grad_(False)
        )
        self.d2t = tensors["d2t"].to(self.device)
        self.w_draft = target.model.lm_head.weight.detach()[self.d2t].to(self.adapter_dtype)
        self.draft_pk = Reordered()  # its fp32 CPU products (drafters.lockstep)
        self.cfg = cfg
        inner = target.model.model
        self.layers = list(inner.layers[: cfg.exit_layer])
        self.embed, self.rotary = inner.embed_tokens, inner.rotary_emb
        self._target_key = (id(target.model), target.dtype)

    def fork(self) -> EarlyExitDrafter:
        """A drafter for another sequence over the same loaded adapter (read once, shared read-only)."""
        other = EarlyExitDrafter(self.weights, self.tree, self.min_prob)
        if self.adapter is not None:
            for name in ("meta", "dtype", "adapter_dtype", "device", "adapter", "d2t", "w_draft", "draft_pk",
                         "cfg", "layers", "embed", "rotary", "_target_key"):  # fmt: skip
                setattr(other, name, getattr(self, name))
        return other

    def prepare(self, target: TargetModel) -> None:
        """Load the adapter for ``target`` now (``drafters.base.prepare_drafter``)."""
        self._load(target)

    # ---- Drafter protocol ----
    def reset(self, ctx: DraftContext) -> None:
        if ctx.target is None:
            raise DrafterError("the early_exit drafter needs the target (DraftContext.target)")
        self._load(ctx.target)
        self.target = ctx.target
        self.kv = KVBuffer(self.cfg.kv_heads, self.cfg.head_dim, self.adapter_dtype, self.device)

    def observe(self, ctx: DraftContext, feedback: Feedback) -> None:
        pass  # the target's cache already holds what the next proposal needs

    def propose(self, ctx: DraftContext, shape: TreeShape) -> DraftTree:
        return self.propose_batch([(self, ctx, shape)])[0]

    def propose_batch(self, items: list[tuple[EarlyExitDrafter, DraftContext, TreeShape]]) -> list[DraftTree]:
        """Trees for several sequences (one drafter each), grown in lockstep (``drafters.lockstep``): per round,
        the target's first layers and the adapter run once over every sequence's frontier (each attending to its
        own cache rows). The same trees as one at a time."""
        grows: list[Growing | DraftTree] = []
        with torch.inference_mode():
            drafting = [(d, ctx) for d, ctx, shape in items if shape.depth > 0 and d.adapter is not None]
            if len({id(d) for d, _ in drafting}) != len(drafting):
                raise DrafterError(
                    "one early_exit drafter drafts one sequence: fork() it for each row of a batch"
                )
            for _, ctx in drafting:
                if ctx.target_kv is None:
                    raise DrafterError(
                        "the early_exit drafter needs the target's KV cache (DraftContext.target_kv)"
                    )
            # per drafter, per layer: [K, V] of the root (temporary), every row caught up in one pass
            extras = dict(zip(map(id, (d for d, _ in drafting)), _catch_up_many(drafting)))
            for d, ctx, shape in items:
                if shape.depth == 0 or d.adapter is None:
                    grows.append(DraftTree.root_only(ctx.tokens[-1]))
                    continue
                past = len(ctx.tokens) - 1  # tokens in the target's cache
                steps = tree_steps(d.tree, ctx.tokens[-1], shape, d.min_prob)
                grows.append(Growing(d, shape, steps, cache=ctx.target_kv, past=past, extra=extras[id(d)],
                                     slots=TreeSlots(d.kv.n)))  # fmt: skip
            return propose_lockstep(grows, _exit_pass)

    # ---- internals ----
    def _layers(self, x, pos, seqs):
        """Target layers 0..l-1 on x [1, T, H] at positions pos [T], T the nodes of ``seqs`` in turn: per sequence
        ``(n, cache, past, extra, allowed)``, its ``n`` nodes attend to keys cache[:past] ++ extra[l] ++ its own
        (``allowed`` [1, 1, n, keys]). Returns (hidden [1, T, H], per sequence its own keys/values per layer)."""
        cos, sin = self.rotary(x, pos[None])
        sizes = [n for n, *_ in seqs]
        own: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in seqs]
        hd = self.cfg.head_dim
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            b, t, _ = h.shape
            q = attn.q_proj(h).view(b, t, -1, hd).transpose(1, 2)
            k = attn.k_proj(h).view(b, t, -1, hd).transpose(1, 2)
            v = attn.v_proj(h).view(b, t, -1, hd).transpose(1, 2)
            q, k = _apply_rope(q, k, cos, sin)
            parts = []
            for s, (qs, ks, vs) in enumerate(zip(*(torch.split(z, sizes, dim=2) for z in (q, k, v)))):
                _, cache, past, extra, allowed = seqs[s]
                keys = [cache.keys(i)[:, :, :past]] + ([extra[i][0]] if extra else []) + [ks]
                vals = [cache.values(i)[:, :, :past]] + ([extra[i][1]] if extra else []) + [vs]
                parts.append(attend(qs, torch.cat(keys, 2), torch.cat(vals, 2), allowed))
                own[s].append((ks, vs))
            a = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
            x = x + attn.o_proj(a.transpose(1, 2).reshape(b, t, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x, own

    def _catch_up(self, tokens: list[int], cache, past: int):
        """Committed tokens the adapter has not seen (in the target cache: they attend to it, adding nothing) and
        the root (not in it: its own keys/values are returned as the tree's temporary prefix)."""
        start = self.kv.n
        ids = torch.tensor(tokens[start:], device=self.device)
        q_len = ids.shape[0]
        pos = torch.arange(start, start + q_len, device=self.device)
        allowed = torch.ones(q_len, past + q_len, dtype=torch.bool, device=self.device)
        allowed[:, past:] = False
        allowed[:, :past] &= torch.arange(past, device=self.device)[None, :] <= pos[:, None]
        allowed[-1, -1] = True  # the root sees itself (its keys are the last column)
        x = self.embed(ids)[None].to(self.dtype)
        # the catch-up rows' own keys are already in the cache: keep only the root's
        h, (own,) = self._layers(x, pos, [(q_len, cache, past, None, allowed[None, None])])
        extra = [(k[:, :, -1:], v[:, :, -1:]) for k, v in own]
        h = h.to(self.adapter_dtype)
        q, k, v = self.adapter.layer.project(h, pos)
        self.kv.write(self.kv.n, k, v)
        self.kv.n += q_len
        a = attend(q[:, :, -1:], self.kv.k[:, :, : self.kv.n], self.kv.v[:, :, : self.kv.n], None)
        self.root_out = self.adapter.norm(self.adapter.layer.finish(h[:, -1:], a))[0, 0]
        self.kv.n -= 1  # the root's adapter entry is recomputed with the tokens of the next step
        self._root_slot = (k[:, :, -1:], v[:, :, -1:])
        return extra


def _catch_up_many(
    pairs: list[tuple[EarlyExitDrafter, Any]],
) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``_catch_up`` of several sequences (``(drafter, DraftContext)``) in one pass of the target's first layers
    and the adapter per loaded head: their products read the weights once for every row's pending tokens, not once
    per row; attention stays per row, over its own cache. The same adapter caches, root outputs and root keys
    as one at a time. Returns each drafter's ``extra`` (per layer, the root's keys and values)."""
    out: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    groups: dict[int, list[tuple[EarlyExitDrafter, Any]]] = {}
    for d, ctx in pairs:
        groups.setdefault(id(d.adapter), []).append((d, ctx))
    for grp in groups.values():
        if len(grp) == 1:
            d, ctx = grp[0]
            out[id(d)] = d._catch_up(ctx.tokens, ctx.target_kv, len(ctx.tokens) - 1)
            continue
        d0 = grp[0][0]
        dev = d0.device
        ids, pos, seqs = [], [], []
        for d, ctx in grp:
            start, past = d.kv.n, len(ctx.tokens) - 1
            q_len = len(ctx.tokens) - start
            p = torch.arange(start, start + q_len, device=dev)
            allowed = torch.ones(q_len, past + q_len, dtype=torch.bool, device=dev)
            allowed[:, past:] = False
            allowed[:, :past] &= torch.arange(past, device=dev)[None, :] <= p[:, None]
            allowed[-1, -1] = True  # the root sees itself (its keys are the last column)
            ids += ctx.tokens[start:]
            pos.append(p)
            seqs.append((q_len, ctx.target_kv, past, None, allowed[None, None]))
        pos_t = torch.cat(pos)
        x = d0.embed(torch.tensor(ids, device=dev))[None].to(d0.dtype)
        h, own = d0._layers(x, pos_t, seqs)
        h = h.to(d0.adapter_dtype)
        q, k, v = d0.adapter.layer.project(h, pos_t)
        ends = [int(e) for e in torch.tensor([n for n, *_ in seqs]).cumsum(0)]
        parts = []
        for (d, _), end, (n, *_), layers in zip(grp, ends, seqs, own):
            at = end - n
            out[id(d)] = [(lk[:, :, -1:], lv[:, :, -1:]) for lk, lv in layers]
            d.kv.write(d.kv.n, k[:, :, at:end], v[:, :, at:end])
            d.kv.n += n
            parts.append(attend(q[:, :, end - 1 : end], d.kv.k[:, :, : d.kv.n], d.kv.v[:, :, : d.kv.n], None))
            d.kv.n -= 1  # the root's adapter entry is recomputed with the tokens of the next step
            d._root_slot = (k[:, :, end - 1 : end], v[:, :, end - 1 : end])
        last = [e - 1 for e in ends]
        roots = d0.adapter.norm(d0.adapter.layer.finish(h[:, last], torch.cat(parts, dim=2)))[0]  # [R, H]
        for (d, _), r in zip(grp, roots):
            d.root_out = r
    return [out[id(d)] for d, _ in pairs]


def _exit_pass(grows: list[Growing]) -> list[torch.Tensor]:
    """One pass of the target's first layers and the adapter over every sequence's frontier (the root's output
    came with the catch-up). Per sequence, the target layers see its cache prefix, the root, its drafted
    ancestors and itself (``extra[l]`` holds the root's keys, then the tree nodes' in slot order); the adapter
    sees its committed entries, the root's, then the same slots. Returns each sequence's [F, H]."""
    outs: list[torch.Tensor | None] = [None] * len(grows)
    todo = [j for j, gr in enumerate(grows) if gr.request[0] != [0]]
    for j, gr in enumerate(grows):
        if j not in todo:
            outs[j] = gr.d.root_out[None]
    if not todo:
        return outs  # type: ignore[return-value]
    d0 = grows[0].d
    dev = d0.device
    ids, pos, seqs, masks = [], [], [], []
    for j in todo:
        gr = grows[j]
        d, (frontier, g), st = gr.d, gr.request, gr.state
        slots, past = st["slots"], st["past"]
        if not slots.slot:  # the root's adapter entry counts as committed during this proposal
            d.kv.write(d.kv.n, *d._root_slot)
            slots.committed = d.kv.n + 1
        n_tree, f = len(slots.slot), len(frontier)
        at = slots.committed + n_tree
        slots.place(frontier, at, g)
        mask = slots.mask(frontier, g, dev)  # [1, 1, F, at + F]: committed + ancestors + self
        allowed = torch.ones(f, past + 1 + n_tree + f, dtype=torch.bool, device=dev)
        allowed[:, past + 1 :] = mask[0, 0, :, slots.committed :]
        ids += [g.tokens[u] for u in frontier]
        pos += [past + g.depths[u] for u in frontier]
        seqs.append((f, st["cache"], past, st["extra"], allowed[None, None]))
        masks.append((mask, at, f))
    pos_t = torch.tensor(pos, device=dev)
    x = d0.embed(torch.tensor(ids, device=dev))[None].to(d0.dtype)
    h, own = d0._layers(x, pos_t, seqs)
    h = h.to(d0.adapter_dtype)
    q, k, v = d0.adapter.layer.project(h, pos_t)
    sizes = [f for *_, f in masks]
    parts = []
    for j, (mask, at, f), kv_own, qs, ks, vs in zip(
        todo, masks, own, *(torch.split(z, sizes, dim=2) for z in (q, k, v))
    ):
        gr = grows[j]
        extra = gr.state["extra"]
        for i, (lk, lv) in enumerate(kv_own):
            extra[i] = (torch.cat([extra[i][0], lk], 2), torch.cat([extra[i][1], lv], 2))
        kv = gr.d.kv
        kv.write(at, ks, vs)
        parts.append(attend(qs, kv.k[:, :, : at + f], kv.v[:, :, : at + f], mask))
    a = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    out = d0.adapter.norm(d0.adapter.layer.finish(h, a))[0]
    for j, o in zip(todo, torch.split(out, sizes, dim=0)):
        outs[j] = o
    return outs  # type: ignore[return-value]


def _apply_rope(q, k, cos, sin):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    return apply_rotary_pos_emb(q, k, cos, sin)
