"""The lean forward of a Llama-family target (Llama, SmolLM2, Qwen2, Mistral) over the batch engine's
``RaggedCache``: fused QKV and gate/up projections, rotary tables computed once per forward, each layer's keys and
values written straight into the rows' cache slots, one SDPA call per layer with the tree mask the step needs (or
none: a single row's causal forward; on CUDA in bf16, a step of several nodes attends through the split-key Triton
kernel ``kernels.tree_attention`` instead, at the shapes verified on a GPU, head size 64: ``attention_mode``). No
per-layer Python work beyond the arithmetic.

The weights come in one of ``kernels.quant.FORMATS``: ``dense`` (the activation dtype), ``int8`` (per output
channel) or ``int4`` (group 32; for the embedded model read from the GGUF's own Q4_1 blocks: ``env.lean_files``,
which also keeps the built model between processes).
A quantized target is its own model: the engine's speculative output equals its own autoregressive output.

``LeanLlama.from_state`` builds it from a Hugging Face state dict (names as ``LlamaForCausalLM`` saves them) and a
config mapping (``config.json``), so the default path needs no transformers model at all.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

import kernels
from kernels.quant import WIDE_ROWS, QLinear, int4_fits, wide_in_fp32

# config.model_type values the lean forward reproduces (full causal attention; see env.batch.check_architecture)
LEAN_TYPES = ("llama", "qwen2", "mistral")
WEIGHT_CHOICES = ("dense", "int8", "int4", "auto")


class LeanLayer:
    __slots__ = ("ln1", "ln2", "qkv", "o", "gate_up", "down")

    def __init__(self, ln1, ln2, qkv: QLinear, o: QLinear, gate_up: QLinear, down: QLinear) -> None:
        self.ln1, self.ln2, self.qkv, self.o, self.gate_up, self.down = ln1, ln2, qkv, o, gate_up, down


def rope_inv_freq(cfg: Mapping[str, Any], head_dim: int) -> tuple[torch.Tensor, float] | None:
    """The rotary inverse frequencies and attention scaling of a ``default`` rope (as transformers computes them);
    None for another rope type (the caller takes the model's own)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        return None
    base = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim))
    return inv, 1.0


class LeanLlama:
    """A Llama-family decoder: ``forward`` over a ``RaggedCache`` write, ``head`` for logits."""

    def __init__(
        self,
        cfg: Mapping[str, Any],
        layers: list[LeanLayer],
        embed: torch.Tensor,
        norm: torch.Tensor,
        lm_head: QLinear,
        inv_freq: torch.Tensor,
        attention_scaling: float,
        dtype: torch.dtype,
        weights: str,
    ) -> None:
        self.cfg = cfg
        self.layers, self.embed, self.norm, self.lm_head = layers, embed, norm, lm_head
        self.inv_freq, self.attention_scaling = inv_freq, attention_scaling
        self.dtype, self.weights = dtype, weights
        self.heads = int(cfg["num_attention_heads"])
        self.kv_heads = int(cfg.get("num_key_value_heads") or self.heads)
        self.head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // self.heads)
        self.eps = float(cfg.get("rms_norm_eps", 1e-6))
        self.scale = self.head_dim**-0.5
        self.q_size = self.heads * self.head_dim
        self.kv_size = self.kv_heads * self.head_dim
        self.inter = int(cfg["intermediate_size"])
        # a constant for torch.compile (a comparison of ints is symbolic under dynamic shapes)
        self.gqa = bool(self.kv_heads != self.heads)
        self._compiled: Any = None

    # ---- building ----
    @staticmethod
    def from_state(
        cfg: Mapping[str, Any],
        state: Mapping[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        weights: str = "dense",
        int4_blocks: Mapping[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
        rope: tuple[torch.Tensor, float] | None = None,
    ) -> LeanLlama:
        """``weights``: dense | int8 | int4. ``int4_blocks``: per HF weight name, (q, scale, zero) read from a GGUF
        (used as they are for int4 instead of requantizing). ``rope``: (inv_freq, scaling) when not a default rope.
        A quantized model is quantized on the CPU whatever the ``device``: elsewhere each layer is then moved there
        by ``QLinear.to`` (dequantized on CUDA), so every device runs the same quantized weights. The biases are
        those the config gives the projections (``env.model_checks.lean_biases``); the LM head is ``lm_head.weight``,
        or the embeddings where the config ties them and the state has none."""
        from env.model_checks import lean_biases, tied_head

        if weights not in ("dense", "int8", "int4"):
            raise ValueError(f"unknown weight format {weights!r}; valid: dense, int8, int4")
        blocks = int4_blocks or {}
        biased = lean_biases(dict(cfg))

        def quantized(names: list[str], w: torch.Tensor, bias: torch.Tensor | None) -> QLinear:
            if weights == "dense":
                return QLinear.dense(w, bias, dtype)
            # quantized on the CPU even when the state is on the GPU (a random or sharded model is built there):
            # the int4 packing has no CUDA kernel, and every device must run the same quantized weights
            w, bias = w.cpu(), None if bias is None else bias.cpu()
            if weights == "int8" or not int4_fits(*w.shape):  # (no int4 layout for this shape: int8)
                return QLinear.int8(w, bias, dtype)
            if all(n in blocks for n in names):
                q, s, z = (torch.cat([blocks[n][j] for n in names]) for j in range(3))
                return QLinear.from_int4(q, s, z, bias, dtype)
            return QLinear.int4(w, bias, dtype)

        def lin(prefix: str, projs: list[str]) -> QLinear:
            names = [prefix + p + ".weight" for p in projs]
            w = torch.cat([state[n].float() for n in names]) if len(names) > 1 else state[names[0]].float()
            bias = None
            if any(p in biased for p in projs):
                missing = [prefix + p + ".bias" for p in projs if prefix + p + ".bias" not in state]
                if missing:
                    raise ValueError(
                        f"the weights have no {missing[0]} (the config gives the projection a bias)"
                    )
                bias = torch.cat([state[prefix + p + ".bias"].float() for p in projs])
            return quantized(names, w, bias).to(device)

        n_layers = int(cfg["num_hidden_layers"])
        layers = []
        for i in range(n_layers):
            p = f"model.layers.{i}."
            layers.append(
                LeanLayer(
                    state[p + "input_layernorm.weight"].to(device, dtype),
                    state[p + "post_attention_layernorm.weight"].to(device, dtype),
                    lin(p, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
                    lin(p, ["self_attn.o_proj"]),
                    lin(p, ["mlp.gate_proj", "mlp.up_proj"]),
                    lin(p, ["mlp.down_proj"]),
                )
            )
        embed = state["model.embed_tokens.weight"]
        head_w = state.get("lm_head.weight")
        if head_w is None:
            if not tied_head(dict(cfg)):
                raise ValueError(
                    "the weights have no lm_head.weight and the config does not tie it to the embeddings"
                )
            head_w = embed
        # the LM head of a quantized target is int8 per channel (the GGUF keeps it in 8 bits, Q8_0, too)
        if weights == "dense":
            lm_head = QLinear.dense(head_w.float(), None, dtype).to(device)
        else:
            lm_head = QLinear.int8(head_w.float().cpu(), None, dtype).to(device)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
        if rope is None:
            rope = rope_inv_freq(cfg, head_dim)
            if rope is None:
                raise ValueError("this rope type needs the model's own inverse frequencies (rope=)")
        return LeanLlama(
            cfg, layers, embed.to(device, dtype), state["model.norm.weight"].to(device, dtype), lm_head,
            rope[0].to(device), float(rope[1]), dtype, weights,
        )  # fmt: skip

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights one forward reads (linear layers and LM head; the embedding rows read are negligible)."""
        per = sum(x.nbytes for L in self.layers for x in (L.qkv, L.o, L.gate_up, L.down))
        return per + self.lm_head.nbytes

    # ---- running ----
    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """transformers' LlamaRMSNorm: normalized in fp32, back to the activation dtype, times the weight."""
        return w * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @torch.no_grad()
    def forward(
        self, ids: torch.Tensor, pos: torch.Tensor, cache: Any, write: Any, mask: torch.Tensor | None,
        aux: tuple[int, ...] = (),
    ):  # fmt: skip
        """ids, pos [B, q]; ``write``: an ``env.ragged_cache.Write`` (where the nodes go, which rows and positions
        are read); ``mask``: bool [B, 1, q, span] (True: may attend), or None for one row's causal forward.
        Returns the final hidden states [B, q, H] (after the last norm) and, for ``aux`` (layer counts n), the
        residual streams after n layers side by side [B, q, len(aux) * H] (EAGLE-3's fused features; None when
        ``aux`` is empty; n = L: the final hidden states, as transformers' ``hidden_states[L]``)."""
        b, q = ids.shape
        x = F.embedding(ids, self.embed)
        cos, sin = self._rotary(pos)
        causal = False
        if mask is None and q > 1:
            if write.past == 0:
                causal = True
            else:  # one row, q new tokens after ``past``: causal over the new ones
                kpos = torch.arange(write.span, device=ids.device)
                mask = (kpos[None, :] <= write.past + torch.arange(q, device=ids.device)[:, None])[None, None]
        # a single row's nodes go to consecutive slots: a slice copy instead of an indexed write
        at = int(write.slots[0, 0]) if b == 1 else -1
        tap = tuple(i + 1 in aux for i in range(len(self.layers))) if aux else ()
        # a wide forward (a prefill chunk) on the CPU attends in fp32 where wide products run faster so (kernels.quant)
        wide_rows = b * q >= WIDE_ROWS and ids.device.type == "cpu" and self.dtype != torch.float32
        wide = wide_rows and wide_in_fp32(self.dtype)
        # compiled: decoding and verifying steps; a prompt's causal forward and wide products stay eager (their time
        # is in the matrix products, and every prompt length would be one more shape to compile)
        compiled = self._compiled is not None and not (causal or wide_rows)
        run = self._compiled if compiled else self._layers
        if compiled:
            _sizes_vary((x, cos, sin), (mask, write.rows, write.slots))
            if not hasattr(cache.k[0], "_dynamo_weak_dynamic_indices"):  # a grown cache: no new shape either
                for t in (*cache.k, *cache.v):
                    torch._dynamo.maybe_mark_dynamic(t, 2)
        x, taps = run(x, cos, sin, mask, causal, cache.k, cache.v, write.rows, write.slots, write.lo, write.hi,
                      write.span, at, tap, wide)  # fmt: skip
        out = self._rms(x, self.norm)
        if tap and tap[-1]:  # after the last layer: the final norm's, as transformers' hidden_states[L]
            taps = [*taps[:-1], out]
        return out, (torch.cat(taps, dim=-1) if taps else None)

    def _rotary(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, q, 1, D] of positions [B, q] (broadcast over the heads of [B, q, heads, D])."""
        freqs = pos.float()[..., None] * self.inv_freq  # [B, q, D/2], in fp32 as transformers computes it
        emb = torch.cat([freqs, freqs], dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(self.dtype)[:, :, None]  # [B, q, 1, D]
        sin = (emb.sin() * self.attention_scaling).to(self.dtype)[:, :, None]
        return cos, sin

    @torch.no_grad()
    def device_forward(
        self, ids: torch.Tensor, pos: torch.Tensor, cache: Any, rows: torch.Tensor, slots: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """The forward of a device-resident step (``env.device_loop``): every row of ``cache``, ids, pos, rows and
        slots [B, q] as device tensors, mask bool [B, 1, q, span] (span: the positions read). Nothing is read
        back to the host and every size is fixed by the arguments' shapes, so the step can be captured in a CUDA
        graph. Returns the final hidden states [B, q, H]."""
        b, q = ids.shape
        x = F.embedding(ids, self.embed)
        cos, sin = self._rotary(pos)
        wide = b * q >= WIDE_ROWS and ids.device.type == "cpu" and self.dtype != torch.float32
        wide = wide and wide_in_fp32(self.dtype)
        x, _ = self._layers(x, cos, sin, mask, False, cache.k, cache.v, rows, slots, 0, b, mask.shape[-1], -1,
                            (), wide)  # fmt: skip
        return self._rms(x, self.norm)

    def compile(self) -> None:
        """Run the layers of decoding and verifying steps through ``torch.compile`` (inductor, the whole stack of
        layers as one graph; on the CPU with its C++ wrapper, which calls the kernels without Python in between).
        Rows, nodes, context length and the cache's capacity are dynamic wherever they exceed 1 (``_sizes_vary``);
        the integers that locate a single row's step become so at their first change. A run compiles a few graphs
        (a single row's decoding step twice, a verify, a batch) and then reuses them. Compiled code is cached on disk
        under the draftgym cache (``inductor/``): a later process on the same machine only traces again."""
        if self._compiled is not None:
            return
        from env.machine import cache_dir

        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
        options = {"cpp_wrapper": True} if self.embed.device.type == "cpu" else {}
        self._compiled = torch.compile(self._layers, dynamic=None, options=options)

    def _layers(self, x, cos, sin, mask, causal: bool, ks_cache, vs_cache, rows, slots, lo: int, hi: int,
                span: int, at: int, tap: tuple[bool, ...] = (), wide: bool = False):  # fmt: skip
        """``tap``: per layer, whether to keep the residual stream after it (bools: under torch.compile with dynamic
        shapes a membership test over a tuple of ints is traced wrongly, always False). ``wide``: attention in
        fp32. A causal forward (a whole prompt from position 0) attends over its own keys and values, the very
        values written to the cache, without reading them back."""
        b, q = x.shape[0], x.shape[1]
        if mask is not None:  # the same number, but a dynamic size under torch.compile (see _sizes_vary)
            span = mask.shape[-1]
        taps = []
        hd, nq, nk = self.head_dim, self.q_size, self.kv_size
        nh = self.heads + self.kv_heads
        half = hd // 2
        sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)  # rotate_half's sign, folded into sin
        fused = not causal and mask is not None and fused_attention(x, q)
        for i, L in enumerate(self.layers):
            h = self._rms(x, L.ln1)
            qkv = L.qkv(h)
            # rotary on q and k heads at once, in the projection's layout [b, q, heads, hd] (transposed first, a
            # step of several nodes ran these products on strided views: slower kernels on a GPU)
            qk = qkv[..., : nq + nk].view(b, q, nh, hd)
            qk = qk * cos + qk.roll(half, -1) * sin  # = qk * cos + rotate_half(qk) * sin, value for value
            qs, ks = (
                qk[:, :, : self.heads].transpose(1, 2),
                qk[:, :, self.heads :],
            )  # [b, heads, q, hd]; [b, q, kv, hd]
            vs = qkv[..., nq + nk :].view(b, q, self.kv_heads, hd)
            kc, vc = ks_cache[i], vs_cache[i]
            if at >= 0:
                kc[lo, :, at : at + q] = ks[0].transpose(0, 1)
                vc[lo, :, at : at + q] = vs[0].transpose(0, 1)
            else:
                kc[rows, :, slots] = ks
                vc[rows, :, slots] = vs
            if causal:
                keys, vals = ks.transpose(1, 2), vs.transpose(1, 2)
            else:
                keys, vals = kc[lo:hi, :, :span], vc[lo:hi, :, :span]
            if fused:  # [b, q, heads, hd]: the output projection reads it as it is
                a = kernels.tree_attention(qs, keys, vals, mask, self.scale).reshape(b, q, nq)
            elif q == 1 and x.dtype != torch.float32 and x.device.type == "cpu":  # a CPU decoding step
                a = _attend_one(qs, keys, vals, mask, self.scale).transpose(1, 2).reshape(b, q, nq)
            else:
                if wide:
                    qs, keys, vals = qs.float(), keys.float(), vals.float()
                a = F.scaled_dot_product_attention(
                    qs, keys, vals, attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=self.gqa
                ).to(x.dtype)
                a = a.transpose(1, 2).reshape(b, q, nq)
            x = x + L.o(a)
            gu = L.gate_up(self._rms(x, L.ln2))
            x = x + L.down(F.silu(gu[..., : self.inter]) * gu[..., self.inter :])
            if tap and tap[i]:
                taps.append(x)
        return x, taps


ATTENTION_MODES = ("auto", "sdpa", "triton")


def attention_mode() -> str:
    """``DRAFTGYM_ATTENTION``: how a masked step's attention runs on CUDA in bf16 or fp16. ``auto`` (default): the
    split-key Triton kernel (``kernels.tree_attention``; SDPA at the shapes it does not take) for steps of two or
    more nodes, SDPA for one (its cuDNN kernel is fast there; with a mask over several nodes it took 6x as long on
    an H200); ``sdpa``: always SDPA; ``triton``: the kernel for one node too. fp32 and CPUs keep SDPA (fp32 logits
    equal transformers')."""
    mode = os.environ.get("DRAFTGYM_ATTENTION", "auto")
    if mode not in ATTENTION_MODES:
        raise ValueError(f"DRAFTGYM_ATTENTION={mode!r}; valid: {', '.join(ATTENTION_MODES)}")
    return mode


def fused_attention(x: torch.Tensor, q: int) -> bool:
    """Whether a masked forward of ``q`` nodes per row with activations ``x`` attends through the Triton kernel."""
    if not x.is_cuda or x.dtype == torch.float32 or torch.compiler.is_compiling():
        return False
    mode = attention_mode()
    return mode == "triton" or (mode == "auto" and q > 1)


def _attend_one(qs: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor | None,
                scale: float) -> torch.Tensor:  # fmt: skip
    """Attention of one new token per row (qs [B, H, 1, D]; keys, vals [B, Hkv, S, D]; mask [B, 1, 1, S] or None),
    as two products in fp32 with the query heads of a KV head side by side (no copy of the keys per query head).
    For one token torch's CPU ``scaled_dot_product_attention`` of bf16 takes 2-5x longer (`python -m
    env.bench_forward --context 1200`: most of a step's time at long contexts); fp32 models keep it (their logits
    equal transformers')."""
    b, h, _, d = qs.shape
    hkv = keys.shape[1]
    g = h // hkv  # query heads per KV head: heads j * g .. j * g + g - 1 read KV head j (transformers' GQA)
    # scores: [B, Hkv, g, S]
    scores = torch.matmul(qs.float().reshape(b, hkv, g, d), keys.float().transpose(-1, -2)) * scale
    if mask is not None:  # [B, 1, 1, S]: broadcast over the KV heads and their query heads
        scores = scores.masked_fill(~mask, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    return torch.matmul(p, vals.float()).reshape(b, h, 1, d).to(qs.dtype)


def _sizes_vary(features: tuple[torch.Tensor, ...], indices: tuple[torch.Tensor | None, ...]) -> None:
    """Tell torch.compile that the rows, nodes and context length of a forward's inputs vary — every dimension over
    1 but the model's own (the last of ``features``: hidden size, head size; all of ``indices``: masks, rows,
    slots). The first compiled step of a kind (a verify, a batch) then compiles code for any of them, instead of
    code for its own sizes and again at the first other size. A dimension of 1 stays specialized (a single
    row's decoding step gets the fastest code)."""
    for t, last in [(t, t.dim() - 1) for t in features] + [(t, t.dim()) for t in indices if t is not None]:
        for d in range(last):
            if t.shape[d] > 1:
                torch._dynamo.maybe_mark_dynamic(t, d)


# ---- one lean model per load ----
def lean_of(loaded: Any) -> LeanLlama | None:
    """The lean forward of ``loaded`` in its weight format (built once per load and shared by every engine over
    it), or None where the engine runs the transformers forward (``forward="hf"``, or not a Llama-family model);
    a ``ModelError`` where the lean forward would not reproduce the model (``env.batch.check_architecture``: a
    sliding window shorter than the context). On the CPU a built one is saved in the model folder (``lean/``) and
    read from there by later processes."""
    if getattr(loaded, "forward", "lean") not in ("lean", "compiled"):
        return None
    cfg = loaded.config
    if getattr(cfg, "model_type", None) not in LEAN_TYPES:
        return None
    from env.batch import check_architecture  # (env.batch imports this module)
    from env.lean_files import cached_int4, read_saved, save, saved_path

    check_architecture(loaded)  # a sliding window shorter than the context: refused, as by the batch engine

    key = f"lean-{loaded.weights}-{loaded.dtype}"  # the eager and the compiled forward share one model's weights
    if key not in loaded.derived:
        conf = cfg.to_dict()
        saved = saved_path(loaded)
        net = read_saved(saved, conf, loaded) if saved is not None else None
        if net is None:
            state = loaded.state
            head_dim = int(
                conf.get("head_dim") or int(conf["hidden_size"]) // int(conf["num_attention_heads"])
            )
            rope = rope_inv_freq(conf, head_dim)
            if rope is None or loaded.has_model:  # the model's own rotary tables (any rope type)
                rot = loaded.model.model.rotary_emb
                rope = (rot.inv_freq.detach().float(), float(getattr(rot, "attention_scaling", 1.0)))
            blocks = cached_int4(loaded, conf, state) if loaded.weights == "int4" else None
            net = LeanLlama.from_state(
                conf, state, loaded.dtype, torch.device(loaded.device), loaded.weights, blocks, rope
            )
            if saved is not None:
                save(net, saved, loaded)
        loaded.derived[key] = net
    net = loaded.derived[key]
    if loaded.forward == "compiled":
        if f"{key}-compiled" not in loaded.derived:
            import sys

            print("draftgym: compiling the lean forward (torch.compile, inductor): the first steps of a new shape "
                  "take a minute or two here, seconds once cached on disk", file=sys.stderr, flush=True)  # fmt: skip
            view = copy.copy(net)  # the same weights, its own compiled function
            view._compiled = None
            view.compile()
            loaded.derived[f"{key}-compiled"] = view
        net = loaded.derived[f"{key}-compiled"]
    return net
