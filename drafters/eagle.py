"""EAGLE-style feature drafter: one decoder layer that reads the target's top-layer features.

References: EAGLE (Li et al., arXiv 2401.15077) for the head; EAGLE-2 (arXiv 2406.16858) for the dynamic tree;
EAGLE-3 (arXiv 2503.01840) for the reduced draft vocabulary and training-time test (HASS, arXiv 2408.15766, is the
same unrolling).

Symbols: x_t the committed tokens, f_t the target's final-norm hidden state at position t (it predicts x_{t+1}).
The head maps the pair (f_t, e(x_{t+1})) through ``fc`` (2H -> H), one Llama decoder layer (attending to the
earlier pairs) and a norm to f'_{t+1}, a guess of the target's next feature; the target's frozen LM head, cut to
the ``draft_vocab`` most frequent tokens (``d2t`` maps them back to target ids), turns f'_{t+1} into a distribution
over x_{t+2}. Drafting deeper feeds the head its own f' (the pair (f'_{t+1}, x_{t+2})).

Runtime state: the head's own KV cache over committed pairs, grown from the features the engine hands back after
each verification (``Feedback.path_hidden``) and, at the start, from the prompt's features
(``ctx.prompt_hidden``). Tree nodes get temporary cache slots, dropped after each proposal.

Batches: ``propose_batch`` drafts for many sequences at once (the rows of a batch that chose eagle): their trees
grow in lockstep, one head pass and one draft-vocabulary projection per depth over every row's frontier, each
row's attention over its own cache; before that, the pairs every row committed since its last proposal enter the
caches in one pass too (``_catch_up_many``). ``fork`` gives another sequence its own state over the same loaded head.
"""

from __future__ import annotations

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
    attend_few,
    find_head,
    head_dtype,
    load_head,
    load_state,
)
from drafters.lockstep import Growing, propose_lockstep
from drafters.trees import tree_option, tree_steps
from kernels.packed import Reordered, reorder_linears


class EagleHead(nn.Module):
    """fc(e(x_{t+1}) ++ f_t) -> decoder layer -> norm: f'_{t+1}. ~4.2M parameters at hidden 576.

    EAGLE-3 (``cfg.fuse_layers``): the first feature is not the target's final hidden state but a fusion of its
    low, middle and high residual streams, g_t = fuse(norm(l_t) ++ norm(m_t) ++ norm(h_t)) (a norm per stream: the
    residual streams of Llama-family models carry activations of 1e4 in a few channels); deeper drafts feed the
    head its own output as before. With no feature to regress to, it trains on the tokens alone."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(2 * cfg.hidden, cfg.hidden, bias=True)
        self.layer = DraftLayer(cfg)
        self.norm = RMSNorm(cfg.hidden, cfg.rms_eps)
        k = len(cfg.fuse_layers)
        if k:
            self.fuse_norms = nn.ModuleList(RMSNorm(cfg.hidden, cfg.rms_eps) for _ in range(k))
            self.fuse = nn.Linear(k * cfg.hidden, cfg.hidden, bias=False)

    def pair(self, emb: torch.Tensor, feat: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([emb, feat], dim=-1))

    def fused(self, aux: torch.Tensor) -> torch.Tensor:
        """[..., k * H] residual streams at ``cfg.fuse_layers`` -> [..., H] the head's first feature."""
        parts = aux.chunk(len(self.fuse_norms), dim=-1)
        return self.fuse(torch.cat([n(x) for n, x in zip(self.fuse_norms, parts)], dim=-1))

    def unrolled(
        self, feats: torch.Tensor, emb_next: torch.Tensor, levels: int, block: int = 64
    ) -> list[torch.Tensor]:
        """Training-time test (EAGLE-3): ``levels`` passes over a batch of sequences, pass s feeding the head its own
        outputs from pass s-1 as an s-deep draft would. feats, emb_next: [B, T, H] (pair j = (f_j, e(x_{j+1})));
        returns per level [B, T, H] guesses of f_{j+1}. Level s at pair j attends to level-1 (true-feature) keys at
        pairs <= j-s+1 and to the level-t key at pair j-s+t for t = 2..s (its draft ancestors), i.e. exactly what
        a depth-s tree node sees at inference. Outputs at j < s-1 have no valid input (mask them in the loss).

        Attention runs over query blocks of ``block`` pairs (any size gives the same result): a block reads the
        level-1 keys its last pair sees and only its own pairs' ancestor keys, instead of every pair's at every
        level -- at T = 512 and 4 levels about a third of the score products of one masked pass per level."""
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        b, t, _ = feats.shape
        pos = torch.arange(t, device=feats.device)
        outs, keys, vals = [], [], []
        prev = feats
        for s in range(1, levels + 1):
            if s > 1:  # pair j gets the guess made at pair j-1 one level up
                prev = torch.cat([torch.zeros_like(outs[-1][:, :1]), outs[-1][:, :-1]], dim=1)
            x = self.pair(emb_next, prev)
            q, k, v = self.layer.project(x, pos)
            keys.append(k)
            vals.append(v)
            anc_k = [_shift(keys[i - 1], s - i) for i in range(2, s + 1)]  # pair j: the level-i key at j-s+i
            anc_v = [_shift(vals[i - 1], s - i) for i in range(2, s + 1)]
            parts = []
            for lo in range(0, t, block):
                hi = min(lo + block, t)
                n1 = max(0, hi - s + 1)  # level-1 keys some pair of the block sees: those <= hi-1-(s-1)
                rows = torch.arange(lo, hi, device=feats.device)
                causal = torch.arange(n1, device=feats.device)[None, :] <= rows[:, None] - (s - 1)
                eye = torch.eye(hi - lo, dtype=torch.bool, device=feats.device)
                mask = torch.cat([causal] + [eye] * (s - 1), dim=1)
                ks = torch.cat([keys[0][:, :, :n1]] + [x_[:, :, lo:hi] for x_ in anc_k], dim=2)
                vs = torch.cat([vals[0][:, :, :n1]] + [x_[:, :, lo:hi] for x_ in anc_v], dim=2)
                parts.append(attend(q[:, :, lo:hi], ks, vs, mask[None, None]))
            a = torch.cat(parts, dim=2)
            outs.append(self.norm(self.layer.finish(x, a)))
        return outs


def _shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """Shift along the sequence axis (dim 2 of [B, H, T, D]) right by n, zero-filled: out[j] = x[j - n]."""
    if n == 0:
        return x
    return torch.cat([torch.zeros_like(x[:, :, :n]), x[:, :, :-n]], dim=2)


def kept_vocab(d2t: torch.Tensor, meta: dict, vocab: int) -> torch.Tensor:
    """The ``vocab`` most frequent of a head's draft tokens (all of them for 0 or more than it has). A head whose
    ``d2t`` was put in frequency order (``experiments.vocab_order``; its description says ``d2t_order``) keeps its
    first ``vocab``; an older head (ids in increasing order) keeps its lowest ids, BPE merge order being a
    frequency prior of the tokenizer's own corpus."""
    if not 0 < vocab < d2t.shape[0]:
        return d2t
    ordered = d2t if meta.get("d2t_order") else d2t.sort().values
    return ordered[:vocab]


class EagleDrafter:
    """EAGLE-2 drafting with a trained EAGLE head. Options: ``weights`` (a head file; default: the user's trained
    head in the cache, else the one shipped for the embedded model), ``tree`` (``dynamic`` | ``kary`` | ``chain``),
    ``min_prob`` (do not expand paths less likely than this, 0: off), ``vocab`` (keep only the head's ``vocab``
    most frequent draft tokens, 0: all of them; a smaller projection per node, see ``VOCAB``)."""

    name = "eagle"
    kind = "eagle"  # the head kind it loads
    VOCAB = 0  # the default of option ``vocab``
    exact_replay = False  # dynamic trees do not prune to smaller arms (replay records them as approximations)

    def __init__(
        self,
        weights: str | None = None,
        tree: str = "dynamic",
        min_prob: float = 0.0,
        vocab: int | None = None,
    ) -> None:
        weights = path_option(self.name, "weights", weights)
        tree = tree_option(self.name, tree)
        min_prob = float_option(self.name, "min_prob", min_prob, 0.0, 1.0)
        vocab = self.VOCAB if vocab is None else vocab
        if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 0:
            raise DrafterError(
                f"{self.name} option vocab must be an integer >= 0 (0: the whole draft vocabulary)"
            )
        self.weights, self.tree, self.min_prob, self.vocab = weights, tree, min_prob, vocab
        self.head: EagleHead | None = None
        self._target_key: tuple[int, torch.dtype] | None = None

    # ---- loading ----
    def _load(self, target: TargetModel) -> None:
        if self._target_key == (id(target.model), target.dtype):
            return
        model_id = target.model_id
        path = find_head(self.kind, model_id, self.weights)
        cfg, tensors, self.meta = load_head(path, self.kind, target.model, model_id)
        head = EagleHead(cfg)
        self.dtype = head_dtype(target)
        load_state(head, tensors, str(path), dtype=self.dtype)  # finite in the dtype it computes in
        self.device = torch.device(target.device)
        self.head = reorder_linears(head.to(self.device, self.dtype).eval().requires_grad_(False))
        self.d2t = kept_vocab(tensors["d2t"], self.meta, self.vocab).to(self.device)
        self.w_draft = target.model.lm_head.weight.detach()[self.d2t].to(self.dtype)  # [Vd, H]
        self.draft_pk = Reordered()  # its fp32 CPU products (drafters.lockstep)
        self.embed = target.model.get_input_embeddings()
        self.cfg = cfg
        self.scratch: dict[str, torch.Tensor] = {}  # buffers of the batched tree attention, shared by forks
        self.fused = bool(cfg.fuse_layers)  # EAGLE-3: fed the fused residual streams, not the final feature
        self._target_key = (id(target.model), target.dtype)

    def prepare(self, target: TargetModel) -> None:
        """Load the head for ``target`` now (``drafters.base.prepare_drafter``)."""
        self._load(target)

    # ---- Drafter protocol ----
    def reset(self, ctx: DraftContext) -> None:
        if ctx.target is None:
            raise DrafterError("the eagle drafter needs the target (DraftContext.target)")
        self._load(ctx.target)
        self.kv = KVBuffer(self.cfg.kv_heads, self.cfg.head_dim, self.dtype, self.device)
        self.first_pair = 0  # pair index held in cache slot 0
        self.pending: list[torch.Tensor] = []  # features f_j, j = first_pair + kv.n + i, not yet in the cache
        self.root_feat: torch.Tensor | None = None  # f' of the root pair (head output), valid for root_at
        self.root_at = -1
        if self.fused and tuple(ctx.aux_layers) != self.cfg.fuse_layers:
            raise DrafterError(
                f"the {self.name} head fuses the target's layers {list(self.cfg.fuse_layers)}, the engine keeps "
                f"{list(ctx.aux_layers)}"
            )
        prompt_hidden = ctx.prompt_aux if self.fused else ctx.prompt_hidden
        last = ctx.last_aux if self.fused else ctx.last_hidden
        n_feat = len(ctx.tokens) - 1  # features f_0 .. f_{n-2} are known after prefill
        if prompt_hidden is not None and prompt_hidden.shape[0] == n_feat:
            self.pending = list(prompt_hidden.to(self.device, self.dtype))
        elif last is not None:  # no prompt features: start from the last one alone
            self.first_pair = n_feat - 1
            self.pending = [last.to(self.device, self.dtype)]
        else:
            raise DrafterError(
                f"the {self.name} drafter needs the target's hidden states (DraftContext.last_hidden/last_aux)"
            )

    def observe(self, ctx: DraftContext, feedback: Feedback) -> None:
        if self.head is None:
            return
        want = self._missing(ctx)
        ph = getattr(feedback, "path_aux" if self.fused else "path_hidden", None)
        if want > 0 and ph is not None and ph.shape[0] >= want:
            self.pending.extend(ph[-want:].to(self.device, self.dtype))
        self._sync(ctx)

    def _missing(self, ctx: DraftContext) -> int:
        """Features f_j the head lacks: it needs f_0 .. f_{n-2} for n committed tokens."""
        return len(ctx.tokens) - 1 - (self.first_pair + self.kv.n + len(self.pending))

    def _sync(self, ctx: DraftContext) -> None:
        """A caller that kept only the last feature (a trace recorder, a calibration loop that never calls
        ``observe``): the missing ones are filled with it (weaker drafts, still exact decoding)."""
        want = self._missing(ctx)
        if want > 0:
            last = ctx.last_aux if self.fused else ctx.last_hidden
            self.pending.extend([last.to(self.device, self.dtype)] * want)

    def fork(self) -> EagleDrafter:
        """A drafter for another sequence over the same loaded head (weights are read once, shared read-only)."""
        other = type(self)(self.weights, self.tree, self.min_prob, self.vocab)
        if self.head is not None:
            for name in (
                "meta",
                "dtype",
                "device",
                "head",
                "d2t",
                "w_draft",
                "draft_pk",
                "embed",
                "cfg",
                "scratch",
                "fused",
                "_target_key",
            ):
                setattr(other, name, getattr(self, name))
        return other

    def propose(self, ctx: DraftContext, shape: TreeShape) -> DraftTree:
        return self.propose_batch([(self, ctx, shape)])[0]

    def propose_batch(self, items: list[tuple[EagleDrafter, DraftContext, TreeShape]]) -> list[DraftTree]:
        """Trees for several sequences (``(drafter, ctx, shape)``, one drafter per sequence), grown in lockstep
        (``drafters.lockstep``): per round, one head pass over the frontier nodes of every sequence that shares
        this drafter's head, and one projection to the draft vocabulary. The same trees as one at a time."""
        grows: list[Growing | DraftTree] = []
        other = next((d for d, _, _ in items if not isinstance(d, type(self))), None)
        if other is not None:  # (its missing head was an AttributeError)
            raise DrafterError(
                f"{type(self).__name__}.propose_batch drafts its own kind's rows, got a {type(other).__name__}"
            )
        with torch.inference_mode():
            drafting = [(d, ctx) for d, ctx, shape in items if shape.depth > 0 and d.head is not None]
            for d, ctx in drafting:
                d._sync(ctx)
            _catch_up_many([(d, ctx.tokens) for d, ctx in drafting])
            for d, ctx, shape in items:
                if shape.depth == 0 or d.head is None:
                    grows.append(DraftTree.root_only(ctx.tokens[-1]))
                    continue
                steps = tree_steps(d.tree, ctx.tokens[-1], shape, d.min_prob)
                grows.append(Growing(d, shape, steps, slots=TreeSlots(d.kv.n), base=len(ctx.tokens) - 2))
            return propose_lockstep(grows, _head_pass)

    # ---- internals ----
    def _catch_up(self, tokens: list[int]) -> None:
        """Move pending features into the cache as committed pairs; the last one's output is the root's f'."""
        if not self.pending:
            return  # proposing again at the same root: root_feat still holds
        j0 = self.first_pair + self.kv.n
        n = len(self.pending)
        feats = torch.stack(self.pending)  # [n, H] (fused: [n, k * H], fused here in one pass)
        if self.fused:
            feats = self.head.fused(feats)
        ids = torch.tensor(tokens[j0 + 1 : j0 + 1 + n], device=self.device)
        x = self.head.pair(self.embed(ids).to(self.dtype), feats)[None]  # [1, n, H]
        pos = torch.arange(j0, j0 + n, device=self.device)
        q, k, v = self.head.layer.project(x, pos)
        self.kv.write(self.kv.n, k, v)
        self.kv.n += n
        self.pending = []
        a = attend(q[:, :, -1:], self.kv.k[:, :, : self.kv.n], self.kv.v[:, :, : self.kv.n], None)
        self.root_feat = self.head.norm(self.head.layer.finish(x[:, -1:], a))[0, 0]
        self.root_at = len(tokens) - 1


def _catch_up_many(pairs: list[tuple[EagleDrafter, list[int]]]) -> None:
    """``_catch_up`` of several sequences (``(drafter, tokens)``) in one pass per head: the head's products read
    its weights once for every sequence's pending pairs, not once per sequence (at 16 rows that was ~1.2 ms a
    row); attention stays per sequence, over its own cache. The same caches and root features as one at a time."""
    groups: dict[int, list[tuple[EagleDrafter, list[int]]]] = {}
    for d, tokens in pairs:
        if d.pending:
            groups.setdefault(id(d.head), []).append((d, tokens))
    for grp in groups.values():
        if len(grp) == 1:
            grp[0][0]._catch_up(grp[0][1])
            continue
        first = grp[0][0]
        head = first.head
        feats, ids, pos, spans = [], [], [], []
        for d, tokens in grp:
            j0, n = d.first_pair + d.kv.n, len(d.pending)
            feats.append(torch.stack(d.pending))
            ids.extend(tokens[j0 + 1 : j0 + 1 + n])
            pos.append(torch.arange(j0, j0 + n, device=first.device))
            spans.append((sum(s for _, s in spans), n))
        feat = torch.cat(feats)  # [N, H] (fused: [N, k * H], fused here in one pass)
        if first.fused:
            feat = head.fused(feat)
        x = head.pair(first.embed(torch.tensor(ids, device=first.device)).to(first.dtype), feat)[None]
        q, k, v = head.layer.project(x, torch.cat(pos))  # [1, Hq | Hkv, N, D]
        outs = []
        for (d, tokens), (at, n) in zip(grp, spans):
            d.kv.write(d.kv.n, k[:, :, at : at + n], v[:, :, at : at + n])
            d.kv.n += n
            d.pending = []
            kk, vv = d.kv.k[:, :, : d.kv.n], d.kv.v[:, :, : d.kv.n]
            outs.append(attend(q[:, :, at + n - 1 : at + n], kk, vv, None))
            d.root_at = len(tokens) - 1
        last = [at + n - 1 for at, n in spans]
        roots = head.norm(head.layer.finish(x[:, last], torch.cat(outs, dim=2)))[0]  # [R, H]
        for (d, _), f in zip(grp, roots):
            d.root_feat = f


def _head_pass(grows: list[Growing]) -> list[torch.Tensor]:
    """One batched head pass over every sequence's frontier (input: (f' of the parent, e(token))); the attention
    of each sequence over its own cache (committed pairs, then its tree slots). Returns each one's [F, H]."""
    d0 = grows[0].d
    head = d0.head
    outs: list[torch.Tensor | None] = [None] * len(grows)
    todo = []
    for j, gr in enumerate(grows):
        frontier, _ = gr.request
        if frontier == [0]:
            outs[j] = gr.d.root_feat[None]  # the root's f' came with the catch-up
        else:
            todo.append(j)
    if todo:
        ids, parent_f, pos = [], [], []
        for j in todo:
            frontier, g = grows[j].request
            ids += [g.tokens[u] for u in frontier]
            parent_f += [grows[j].feats[g.parents[u]] for u in frontier]
            pos += [grows[j].state["base"] + g.depths[u] for u in frontier]  # absolute pair index
        dev = d0.device
        x = head.pair(d0.embed(torch.tensor(ids, device=dev)).to(d0.dtype), torch.stack(parent_f))[None]
        q, k, v = head.layer.project(x, torch.tensor(pos, device=dev))
        sizes = [len(grows[j].request[0]) for j in todo]
        a = _tree_attention([grows[j] for j in todo], sizes, q, k, v)
        h = head.norm(head.layer.finish(x, a))[0]
        at = 0
        for j in todo:
            n = len(grows[j].request[0])
            outs[j] = h[at : at + n]
            at += n
    return outs  # type: ignore[return-value]


def _tree_attention(
    grows: list[Growing], sizes: list[int], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """Attention of every sequence's frontier over its own cache -- committed pairs, then the tree slots of its
    drafted ancestors and its own -- in ONE call. The caches live, for the length of a proposal, in one [S, Hkv, L,
    D] pair of buffers (``_layout``: the committed pairs copied in once, at the proposal's first head pass); each
    round's keys and values go in with one indexed write; the queries are padded to the widest frontier and keys
    past a sequence's own end are masked. q: [1, Hq, sum(sizes), D], k and v: [1, Hkv, sum(sizes), D]; returns
    [1, Hq, sum(sizes), D]."""
    dev = q.device
    keys, vals = _layout(grows)
    rows, places, ends = [], [], []
    for gr, n in zip(grows, sizes):
        frontier, g = gr.request
        slots = gr.state["slots"]
        start = slots.committed + len(slots.slot)
        slots.place(frontier, start, g)
        rows += [gr.state["row"]] * n
        places += range(start, start + n)
        ends.append(start + n)
    if max(ends) > keys.shape[2]:  # a tree with more slots than its shape promised: room, keeping the rows
        buf = grows[0].d.scratch["kv"]
        more = buf.new_zeros(*buf.shape[:3], max(ends) - buf.shape[3], buf.shape[4])
        grows[0].d.scratch["kv"] = buf = torch.cat([buf, more], dim=3)
        keys, vals = buf[0], buf[1]
    r_t, p_t = torch.tensor(rows, device=dev), torch.tensor(places, device=dev)
    keys[r_t, :, p_t] = k[0].transpose(0, 1).float()
    vals[r_t, :, p_t] = v[0].transpose(0, 1).float()
    mine = [gr.state["row"] for gr in grows]
    span = max(ends)
    if mine == list(range(len(mine))):
        keys, vals = keys[: len(mine), :, :span], vals[: len(mine), :, :span]
    else:  # some trees are done: the rows still growing
        pick = torch.tensor(mine, device=dev)
        keys, vals = keys[pick, :, :span], vals[pick, :, :span]
    s, width = len(grows), max(sizes)
    committed = torch.tensor([gr.state["slots"].committed for gr in grows], device=dev)
    m = torch.arange(span, device=dev)[None, None, :] < committed[:, None, None]  # [S, 1, L] committed pairs
    m = m.expand(s, width, span).clone()
    rs, cs, ss = [], [], []
    for r, gr in enumerate(grows):
        seen = gr.state["slots"].seen
        for c, u in enumerate(gr.request[0]):
            own = seen[u]
            rs += [r] * len(own)
            cs += [c] * len(own)
            ss += own
    m[rs, cs, ss] = True
    if all(n == width for n in sizes):
        qs = q[0].reshape(q.shape[1], s, width, -1).transpose(0, 1)
    else:  # padded query rows see slot 0 (never an empty row) and are dropped
        qs = q.new_zeros(s, q.shape[1], width, q.shape[3])
        at = 0
        for r, n in enumerate(sizes):
            qs[r, :, :n] = q[0, :, at : at + n]
            m[r, n:, 0] = True
            at += n
    out = attend_few(qs, keys, vals, m)  # [S, Hq, width, D]
    if all(n == width for n in sizes):
        return out.transpose(0, 1).reshape(1, q.shape[1], s * width, -1)
    return torch.cat([out[r : r + 1, :, :n] for r, n in enumerate(sizes)], dim=2)


def _layout(grows: list[Growing]) -> tuple[torch.Tensor, torch.Tensor]:
    """The proposal's key and value buffers [rows, Hkv, L, D] (fp32, for ``attend_few``), kept by the drafters
    that share the head (``scratch``, reused from proposal to proposal: a fresh multi-MB tensor of a new size costs
    the page faults of new memory, more than the copy). At a proposal's first head pass every sequence gets a row
    and its committed pairs are copied in; L has room for the longest cache plus the most tree slots a shape can
    take (``depth x topk`` for dynamic trees, ``budget`` for k-ary ones), rounded up to 64. Slots past a
    sequence's own end hold stale but finite values, masked by the caller."""
    placed = [gr.state.get("row") is not None for gr in grows]
    scratch = grows[0].d.scratch
    if all(placed):
        return scratch["kv"][0], scratch["kv"][1]
    if any(placed):
        raise RuntimeError("eagle drafting: a sequence joined a proposal after its first head pass")
    kv0 = grows[0].d.kv
    need = max(gr.d.kv.n + max(gr.shape.depth * max(gr.shape.topk, 1), gr.shape.budget) for gr in grows)
    s, span = len(grows), -(-need // 64) * 64
    buf = scratch.get("kv")
    if buf is None or buf.shape[1] < s or buf.shape[3] < span:
        if buf is not None:
            s, span = max(s, buf.shape[1]), max(span, buf.shape[3])
        buf = kv0.k.new_zeros(2, s, kv0.k.shape[1], span, kv0.k.shape[3], dtype=torch.float32)
        scratch["kv"] = buf
    for r, gr in enumerate(grows):
        n = gr.d.kv.n
        buf[0, r, :, :n] = gr.d.kv.k[0, :, :n]
        buf[1, r, :, :n] = gr.d.kv.v[0, :, :n]
        gr.state["row"] = r
    return buf[0], buf[1]


class Eagle3Drafter(EagleDrafter):
    """EAGLE-3: the same drafting over a head that fuses the target's low, middle and high residual streams
    (``EagleHead.fused``; the engine keeps them, ``DraftContext.aux_layers``) and was trained with a deeper
    training-time test on the corpus of ``experiments.corpus`` (``draftgym train-drafter eagle3``)."""

    name = "eagle3"
    kind = "eagle3"
    VOCAB = 2048  # the shipped head's d2t is in frequency order; held-out tau is the same as with all 8192
