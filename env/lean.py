"""The lean forward of a Llama-family target (Llama, SmolLM2, Qwen2, Mistral) over the batch engine's
``RaggedCache``: fused QKV and gate/up projections, rotary tables computed once per forward, each layer's keys and
values written straight into the rows' cache slots, one SDPA call per layer with the tree mask the step needs (or
none: a single row's causal forward). No per-layer Python work beyond the arithmetic.

The weights come in one of ``kernels.quant.FORMATS``: ``dense`` (the activation dtype), ``int8`` (per output
channel) or ``int4`` (group 32; for the embedded model read from the GGUF's own Q4_1 blocks, see ``gguf_int4``).
A quantized target is its own model: the engine's speculative output equals its own autoregressive output.

``LeanLlama.from_state`` builds it from a Hugging Face state dict (names as ``LlamaForCausalLM`` saves them) and a
config mapping (``config.json``), so the default path needs no transformers model at all.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kernels.quant import GROUP, WIDE_ROWS, QLinear, int4_fits, q4_1_blocks, wide_in_fp32

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
        (used as they are for int4 instead of requantizing). ``rope``: (inv_freq, scaling) when not a default rope."""
        if weights not in ("dense", "int8", "int4"):
            raise ValueError(f"unknown weight format {weights!r}; valid: dense, int8, int4")
        quantize = weights != "dense" and device.type == "cpu"
        blocks = int4_blocks or {}

        def lin(names: list[str], bias_names: list[str] | None = None) -> QLinear:
            w = torch.cat([state[n].float() for n in names]) if len(names) > 1 else state[names[0]].float()
            bias = None
            if bias_names and all(b in state for b in bias_names):
                bias = torch.cat([state[b].float() for b in bias_names])
            if not quantize:
                return QLinear.dense(w, bias, dtype).to(device)
            if weights == "int8":
                return QLinear.int8(w, bias, dtype)
            if not int4_fits(*w.shape):
                return QLinear.int8(w, bias, dtype)  # no int4 layout for this shape
            if all(n in blocks for n in names):
                q, s, z = (torch.cat([blocks[n][j] for n in names]) for j in range(3))
                return QLinear.from_int4(q, s, z, bias, dtype)
            return QLinear.int4(w, bias, dtype)

        n_layers = int(cfg["num_hidden_layers"])
        layers = []
        for i in range(n_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            layers.append(
                LeanLayer(
                    state[p + "input_layernorm.weight"].to(device, dtype),
                    state[p + "post_attention_layernorm.weight"].to(device, dtype),
                    lin(
                        [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"],
                        [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"],
                    ),  # fmt: skip
                    lin([a + "o_proj.weight"], [a + "o_proj.bias"]),
                    lin([m + "gate_proj.weight", m + "up_proj.weight"]),
                    lin([m + "down_proj.weight"]),
                )
            )
        embed = state["model.embed_tokens.weight"]
        head_w = state.get("lm_head.weight", embed)
        # the LM head of an int4 target is int8 per channel (the GGUF keeps it in 8 bits, Q8_0, too)
        if quantize:
            lm_head = QLinear.int8(head_w.float(), None, dtype)
        else:
            lm_head = QLinear.dense(head_w.float(), None, dtype).to(device)
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
        ``aux`` is empty)."""
        b, q = ids.shape
        x = F.embedding(ids, self.embed)
        freqs = pos.float()[..., None] * self.inv_freq  # [B, q, D/2], in fp32 as transformers computes it
        emb = torch.cat([freqs, freqs], dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(self.dtype)[:, None]  # [B, 1, q, D]
        sin = (emb.sin() * self.attention_scaling).to(self.dtype)[:, None]
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
        wide = b * q >= WIDE_ROWS and ids.device.type == "cpu" and self.dtype != torch.float32
        wide = wide and wide_in_fp32(self.dtype)
        # compiled: decoding and verifying steps; a prompt's causal forward and wide products stay eager (their time
        # is in the matrix products, and every prompt length would be one more shape to compile)
        compiled = self._compiled is not None and not (causal or wide)
        run = self._compiled if compiled else self._layers
        if compiled:
            _sizes_vary((x, cos, sin), (mask, write.rows, write.slots))
            if not hasattr(cache.k[0], "_dynamo_weak_dynamic_indices"):  # a grown cache: no new shape either
                for t in (*cache.k, *cache.v):
                    torch._dynamo.maybe_mark_dynamic(t, 2)
        x, taps = run(x, cos, sin, mask, causal, cache.k, cache.v, write.rows, write.slots, write.lo, write.hi,
                      write.span, at, tap, wide)  # fmt: skip
        return self._rms(x, self.norm), (torch.cat(taps, dim=-1) if taps else None)

    def compile(self) -> None:
        """Run the layers of decoding and verifying steps through ``torch.compile`` (inductor, the whole stack of
        layers as one graph; on the CPU with its C++ wrapper, which calls the kernels without Python in between).
        Rows, nodes, context length and the cache's capacity are dynamic wherever they exceed 1 (``_sizes_vary``);
        the integers that locate a single row's step become so at their first change. A run compiles a few graphs
        (a single row's decoding step twice, a verify, a batch) and then reuses them. Compiled code is cached on disk
        under the draftgym cache (``inductor/``): a later process on the same machine only traces again."""
        if self._compiled is not None:
            return
        from env.model import cache_dir

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
        for i, L in enumerate(self.layers):
            h = self._rms(x, L.ln1)
            qkv = L.qkv(h)
            qk = qkv[..., : nq + nk].view(b, q, nh, hd).transpose(1, 2)  # rotary on q and k heads at once
            qk = qk * cos + qk.roll(half, -1) * sin  # = qk * cos + rotate_half(qk) * sin, value for value
            qs, ks = qk[:, : self.heads], qk[:, self.heads :]
            vs = qkv[..., nq + nk :].view(b, q, self.kv_heads, hd)
            kc, vc = ks_cache[i], vs_cache[i]
            if at >= 0:
                kc[lo, :, at : at + q] = ks[0]
                vc[lo, :, at : at + q] = vs[0].transpose(0, 1)
            else:
                kc[rows, :, slots] = ks.transpose(1, 2)
                vc[rows, :, slots] = vs
            if causal:
                keys, vals = ks, vs.transpose(1, 2)
            else:
                keys, vals = kc[lo:hi, :, :span], vc[lo:hi, :, :span]
            if wide:
                qs, keys, vals = qs.float(), keys.float(), vals.float()
            a = F.scaled_dot_product_attention(
                qs, keys, vals, attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=self.gqa
            ).to(x.dtype)
            x = x + L.o(a.transpose(1, 2).reshape(b, q, nq))
            gu = L.gate_up(self._rms(x, L.ln2))
            x = x + L.down(F.silu(gu[..., : self.inter]) * gu[..., self.inter :])
            if tap and tap[i]:
                taps.append(x)
        return x, taps


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


# ---- the GGUF's own int4 blocks ----
_GGUF_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _unpermute_rows(n: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's rotary permutation of q/k weights (as transformers undoes it when
    reading a GGUF): HF row ``r`` is GGUF row ``perm[r]``."""
    dim = n // heads // 2
    idx = torch.arange(n).reshape(heads, dim, 2)
    return idx.transpose(1, 2).reshape(n)


def gguf_int4(
    path: Path, cfg: Mapping[str, Any], state: Mapping[str, torch.Tensor]
) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The Q4_1 tensors of a llama GGUF as int4 blocks per HF weight name, rows in HF order. Each is checked against
    the dense weight it must equal (dequantized ``(q - 8) * scale + zero`` vs ``state``); a tensor that does not
    match (another permutation, another format) is left out, and is quantized from the dense weight instead."""
    from gguf import GGUFReader  # noqa: PLC0415  (only for int4 from a GGUF)
    from gguf.constants import GGMLQuantizationType

    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    out: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for t in GGUFReader(path).tensors:
        parts = t.name.split(".")
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _GGUF_NAMES:
            continue
        if t.tensor_type != GGMLQuantizationType.Q4_1:
            continue
        name = f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.weight"
        dense = state.get(name)
        if dense is None:
            continue
        n, k = dense.shape
        q, s, z = q4_1_blocks(t.data, n, k)
        if parts[2] in ("attn_q", "attn_k"):
            perm = _unpermute_rows(n, heads if parts[2] == "attn_q" else kv_heads)
            q, s, z = q[perm], s[perm], z[perm]
        deq = (q.float() - 8).reshape(n, k // GROUP, GROUP) * s[..., None] + z[..., None]
        if torch.allclose(deq.reshape(n, k), dense.float(), rtol=0, atol=1e-5):
            out[name] = (q, s, z)
    return out


# ---- one lean model per load ----
INT4_FILE = "int4_q4_1.safetensors"  # the GGUF's Q4_1 blocks in HF order, cached beside the converted model


def _cached_int4(loaded: Any, cfg: Mapping[str, Any], state: Mapping[str, torch.Tensor]):
    """The embedded model's Q4_1 blocks: read from the GGUF once, then from the cache folder (q packed two per
    byte, scale and zero fp32). None for models without a GGUF (their int4 is quantized from the dense weights)."""
    from safetensors.torch import load_file

    from env.model import DEFAULT_MODEL, embedded_gguf_path

    if loaded.model_id != DEFAULT_MODEL or loaded.folder is None:
        return None
    path = Path(loaded.folder) / INT4_FILE
    if path.is_file():
        try:
            flat = load_file(path)
            out = {}
            for key in flat:
                if key.endswith(".q"):
                    name = key[:-2]
                    packed = flat[key].to(torch.int32)
                    q = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
                    s, z = flat[name + ".scale"].float(), flat[name + ".zero"].float()
                    dense = state.get(name)
                    n, k = q.shape
                    if (
                        dense is None
                        or tuple(dense.shape) != (n, k)
                        or s.shape != (n, k // GROUP)
                        or z.shape != s.shape
                    ):
                        raise ValueError(f"{path}: {name} does not fit the model")
                    out[name] = (q, s, z)
            return out
        except Exception:  # noqa: BLE001  (a damaged or foreign cache file is rebuilt from the GGUF)
            path.unlink(missing_ok=True)
    blocks = gguf_int4(embedded_gguf_path(), cfg, state)
    flat = {}
    for name, (q, s, z) in blocks.items():
        q8 = q.to(torch.uint8).reshape(q.shape[0], -1, 2)
        flat[name + ".q"] = (q8[..., 0] | (q8[..., 1] << 4)).contiguous()
        flat[name + ".scale"], flat[name + ".zero"] = s.contiguous(), z.contiguous()
    _save_tensors(flat, path)
    return blocks


def _save_tensors(flat: dict[str, torch.Tensor], path: Path, meta: dict[str, str] | None = None) -> None:
    """Write a safetensors cache file atomically (a killed write leaves no half file; processes building at once
    each write their own temporary); a folder that cannot be written is no error: it is built again next time."""
    from safetensors.torch import save_file

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        save_file({k: v.contiguous() for k, v in flat.items()}, str(tmp), metadata=meta)
        tmp.replace(path)
    except (OSError, RuntimeError):
        pass  # read-only, or tensors safetensors will not write


def lean_of(loaded: Any) -> LeanLlama | None:
    """The lean forward of ``loaded`` in its weight format (built once per load and shared by every engine over
    it), or None where the engine runs the transformers forward (``forward="hf"``, or not a Llama-family model).
    On the CPU a built one is saved in the model folder (``lean/``) and read from there by later processes."""
    if getattr(loaded, "forward", "lean") not in ("lean", "compiled"):
        return None
    cfg = loaded.config
    if getattr(cfg, "model_type", None) not in LEAN_TYPES:
        return None
    key = f"lean-{loaded.weights}-{loaded.dtype}"  # the eager and the compiled forward share one model's weights
    if key not in loaded.derived:
        conf = cfg.to_dict()
        saved = _saved_path(loaded)
        net = _read_saved(saved, conf, loaded) if saved is not None else None
        if net is None:
            state = loaded.state
            head_dim = int(
                conf.get("head_dim") or int(conf["hidden_size"]) // int(conf["num_attention_heads"])
            )
            rope = rope_inv_freq(conf, head_dim)
            if rope is None or loaded.has_model:  # the model's own rotary tables (any rope type)
                rot = loaded.model.model.rotary_emb
                rope = (rot.inv_freq.detach().float(), float(getattr(rot, "attention_scaling", 1.0)))
            blocks = _cached_int4(loaded, conf, state) if loaded.weights == "int4" else None
            net = LeanLlama.from_state(
                conf, state, loaded.dtype, torch.device(loaded.device), loaded.weights, blocks, rope
            )
            if saved is not None:
                _save(net, saved, loaded)
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


# ---- the built lean model, saved beside the weights (a fresh process reads it instead of converting) ----
_LINEARS = ("qkv", "o", "gate_up", "down")


def _source_stamp(loaded: Any) -> str:
    """What the saved copy was built from: the weights file's size and modification time."""
    st = (Path(loaded.folder) / "model.safetensors").stat()
    return f"{st.st_size}-{st.st_mtime_ns}"


def _saved_path(loaded: Any) -> Path | None:
    """``lean/{weights}-{dtype}-torch{version}-{cpu capability}.safetensors`` in the model folder (the int4
    packing is the CPU kernel's own layout); None off the CPU or without a folder of safetensors weights."""
    if loaded.folder is None or torch.device(loaded.device).type != "cpu":
        return None
    if loaded.weights == "dense" and loaded.dtype == torch.float32:
        return None  # the folder's own fp32 weights, fused in a moment: a copy would not load faster
    if not (Path(loaded.folder) / "model.safetensors").is_file():
        return None
    dtype = str(loaded.dtype).removeprefix("torch.")
    cap = torch.backends.cpu.get_cpu_capability()
    name = f"{loaded.weights}-{dtype}-torch{torch.__version__.replace('+', '_')}-{cap}.safetensors"
    return Path(loaded.folder) / "lean" / name


def _save(net: LeanLlama, path: Path, loaded: Any) -> None:
    flat = {"embed": net.embed, "norm": net.norm, "inv_freq": net.inv_freq}
    formats = {}
    for i, L in enumerate(net.layers):
        flat[f"{i}.ln1"], flat[f"{i}.ln2"] = L.ln1, L.ln2
        for name in _LINEARS:
            lin = getattr(L, name)
            flat.update(lin.tensors(f"{i}.{name}"))
            formats[f"{i}.{name}"] = [lin.fmt, lin.n, lin.k]
    head = net.lm_head.tensors("lm_head")
    tied = net.lm_head.weight is not None and net.lm_head.weight.data_ptr() == net.embed.data_ptr()
    if tied:  # the LM head is the embedding (tied, same dtype): saved once
        del head["lm_head.weight"]
    flat.update(head)
    formats["lm_head"] = [net.lm_head.fmt, net.lm_head.n, net.lm_head.k]
    meta = {"formats": json.dumps(formats), "attention_scaling": str(net.attention_scaling),
            "source": _source_stamp(loaded), "weights": net.weights, "tied": str(int(tied))}  # fmt: skip
    _save_tensors(flat, path, meta)


def _read_saved(path: Path, conf: Mapping[str, Any], loaded: Any) -> LeanLlama | None:
    """The saved lean model, or None when there is none, or it is of other weights, or unreadable (rebuilt)."""
    if not path.is_file():
        return None
    from safetensors import safe_open
    from safetensors.torch import load_file

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        if meta.get("source") != _source_stamp(loaded):
            return None
        # copies in fresh allocations: the CPU kernels assume aligned buffers, which a file's offsets need not be
        flat = {k: v.clone() for k, v in load_file(str(path)).items()}
        formats = json.loads(meta["formats"])
        if meta.get("tied") == "1":
            flat["lm_head.weight"] = flat["embed"]
        layers = []
        for i in range(int(conf["num_hidden_layers"])):
            lins = [QLinear.from_tensors(flat, f"{i}.{n}", *formats[f"{i}.{n}"]) for n in _LINEARS]
            layers.append(LeanLayer(flat[f"{i}.ln1"], flat[f"{i}.ln2"], *lins))
        head = QLinear.from_tensors(flat, "lm_head", *formats["lm_head"])
        return LeanLlama(conf, layers, flat["embed"], flat["norm"], head, flat["inv_freq"],
                         float(meta["attention_scaling"]), loaded.dtype, meta["weights"])  # fmt: skip
    except Exception:  # noqa: BLE001  (a damaged copy is rebuilt from the weights)
        return None
