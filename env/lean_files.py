"""Where a lean model's weights come from besides a state dict, and where it is kept between processes: the
GGUF's own int4 blocks (``gguf_int4``; for the embedded model read once and cached beside the converted model,
``cached_int4``), and the built lean model in its format, saved in the model folder (``lean/``) and read back by a
later process instead of converting again (``saved_path``, ``save``, ``read_saved``). Cache files are written
atomically; a damaged or foreign one is rebuilt.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from env.lean import LeanLayer, LeanLlama
from kernels.quant import GROUP, QLinear, q4_1_blocks

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
        if _dequantizes_to(q, s, z, dense):
            out[name] = (q, s, z)
    return out


def _dequantizes_to(q: torch.Tensor, s: torch.Tensor, z: torch.Tensor, dense: torch.Tensor) -> bool:
    """Whether int4 blocks (q [N, K] in 0..15, scale and zero [N, K/32]) are ``dense``: ``(q - 8) * s + z``."""
    n, k = q.shape
    deq = (
        q.to(torch.float32, copy=True)
        .reshape(n, k // GROUP, GROUP)
        .sub_(8)
        .mul_(s[..., None])
        .add_(z[..., None])
    )
    # |deq - dense| <= 1e-5 everywhere (allclose with rtol 0), in place: a third of allclose's time
    return bool(deq.sub_(dense.reshape(n, k // GROUP, GROUP)).abs_().amax() <= 1e-5)


# ---- the GGUF's blocks, cached ----
INT4_FILE = "int4_q4_1.safetensors"  # the GGUF's Q4_1 blocks in HF order, cached beside the converted model


def cached_int4(loaded: Any, cfg: Mapping[str, Any], state: Mapping[str, torch.Tensor]):
    """The embedded model's Q4_1 blocks: read from the GGUF once, then from the cache folder (q packed two per
    byte, scale and zero fp32). None for models without a GGUF (their int4 is quantized from the dense weights)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from env.model import DEFAULT_MODEL, embedded_gguf_path

    if loaded.model_id != DEFAULT_MODEL or loaded.folder is None:
        return None
    path = Path(loaded.folder) / INT4_FILE
    if path.is_file():
        try:
            with safe_open(str(path), framework="pt") as f:
                recorded = (f.metadata() or {}).get("digest")
            flat = load_file(path)
            if recorded != tensors_digest(flat):  # damaged (or from before caches recorded a digest): rebuilt
                raise ValueError(f"{path}: its tensors are not those it was written with")
            out = {}
            for key in flat:
                if key.endswith(".q"):
                    # q uint8 [N, K/2] (two codes a byte: 0..15), scale and zero fp32 [N, K/32], dequantizing to
                    # the model's own weight as gguf_int4 checked it (a sample of rows: the full check took as
                    # long as the rest of the read; damage anywhere the digest above finds): else another model's
                    name = key[:-2]
                    packed, s, z = flat[key], flat[name + ".scale"], flat[name + ".zero"]
                    dense = state.get(name)
                    if dense is None or dense.dim() != 2 or dense.shape[1] % GROUP:
                        raise ValueError(f"{path}: {name} does not fit the model")
                    n, k = dense.shape
                    if (
                        packed.dtype != torch.uint8
                        or tuple(packed.shape) != (n, k // 2)
                        or s.dtype != torch.float32
                        or z.dtype != torch.float32
                        or tuple(s.shape) != (n, k // GROUP)
                        or z.shape != s.shape
                    ):
                        raise ValueError(f"{path}: {name} does not fit the model")
                    # every row's scale and zero finite (the dequantization below samples 1 row in 8)
                    if not (torch.isfinite(s).all() and torch.isfinite(z).all()):
                        raise ValueError(f"{path}: {name} has NaN or infinite scales or zeros")
                    wide = packed.to(torch.int32)
                    q = torch.stack([wide & 0x0F, wide >> 4], dim=-1).reshape(n, k)
                    if not _dequantizes_to(q[::8], s[::8], z[::8], dense[::8]):  # (every 8th row)
                        raise ValueError(f"{path}: {name} is not the model's weight")
                    out[name] = (q, s, z)
            return out
        except Exception:  # noqa: BLE001  (a damaged or foreign cache file is rebuilt from the GGUF)
            path.unlink(missing_ok=True)
    gguf = embedded_gguf_path()
    try:
        blocks = gguf_int4(gguf, cfg, state)
    except Exception as err:  # noqa: BLE001  (a damaged GGUF: the one line of unreadable_gguf)
        from env.model import unreadable_gguf

        raise unreadable_gguf(gguf, err) from None
    flat = {}
    for name, (q, s, z) in blocks.items():
        q8 = q.to(torch.uint8).reshape(q.shape[0], -1, 2)
        flat[name + ".q"] = (q8[..., 0] | (q8[..., 1] << 4)).contiguous()
        flat[name + ".scale"], flat[name + ".zero"] = s.contiguous(), z.contiguous()
    _save_tensors(flat, path)
    return blocks


def tensors_digest(flat: Mapping[str, torch.Tensor]) -> str:
    """A CRC-32 of the tensors' names, dtypes, shapes and bytes, in name order: a cache file records it when written
    and is rebuilt when what it holds no longer matches — a damaged byte anywhere, not only in the rows a check of
    values samples. (A checksum against damage, not a signature: the cache is this user's own folder; CRC-32 reads
    ~2 GB/s, a third of a second saved on every load of a 300 MB copy against sha256.)"""
    import zlib

    crc = 0
    for name in sorted(flat):
        t = flat[name].contiguous()
        crc = zlib.crc32(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode(), crc)
        crc = zlib.crc32(memoryview(t.reshape(-1).view(torch.uint8).numpy()), crc)
    return f"crc32:{crc:08x}"


def _save_tensors(flat: dict[str, torch.Tensor], path: Path, meta: dict[str, str] | None = None) -> None:
    """Write a safetensors cache file atomically (a killed write leaves no half file; processes building at once
    each write their own temporary), with the digest of its tensors (``tensors_digest``); a folder that cannot be
    written is no error: it is built again next time."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    meta = {**(meta or {}), "digest": tensors_digest(flat)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in flat.items()}, str(tmp), metadata=meta)
        tmp.replace(path)
    except (OSError, RuntimeError, SafetensorError):
        # read-only (safetensors reports its own I/O failures as SafetensorError), or tensors it will not write:
        # no temporary is left behind
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


# ---- the built lean model, saved beside the weights (a fresh process reads it instead of converting) ----
_LINEARS = ("qkv", "o", "gate_up", "down")


def _source_stamp(loaded: Any) -> str:
    """What the saved copy was built from: the weights file's size and modification time, and ``config.json``'s
    sha256 (the rope's frequencies and the sizes the copy holds come from it: an edited config rebuilds it)."""
    import hashlib

    folder = Path(loaded.folder)
    st = (folder / "model.safetensors").stat()
    try:
        conf = hashlib.sha256((folder / "config.json").read_bytes()).hexdigest()[:16]
    except OSError:
        conf = "-"
    return f"{st.st_size}-{st.st_mtime_ns}-{conf}"


def saved_path(loaded: Any) -> Path | None:
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


def save(net: LeanLlama, path: Path, loaded: Any) -> None:
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


def _check_saved(net: LeanLlama, meta: Mapping[str, str], conf: Mapping[str, Any], loaded: Any) -> None:
    """``ValueError`` where a saved lean model is not the one ``conf`` and ``loaded`` would build: every tensor of the
    config's shape in the load's dtype (a kernel reads a wrong-sized buffer out of bounds), each layer's weight format
    and biases what the config gives, the rotary frequencies the config's (or, for another rope type, finite ones)
    and a finite attention scaling."""
    import math

    from env.lean import rope_inv_freq
    from env.model_checks import lean_biases, tied_head
    from kernels.quant import int4_fits

    dtype, fmt = loaded.dtype, loaded.weights
    h, v, inter = int(conf["hidden_size"]), int(conf["vocab_size"]), int(conf["intermediate_size"])
    heads = int(conf["num_attention_heads"])
    kv, hd = net.kv_heads, net.head_dim
    if meta.get("weights") != fmt or net.weights != fmt:
        raise ValueError(f"weights {meta.get('weights')!r}, not {fmt!r}")
    if len(net.layers) != int(conf["num_hidden_layers"]):
        raise ValueError("another number of layers")
    vectors = [(net.embed, (v, h)), (net.norm, (h,))]
    vectors += [(t, (h,)) for L in net.layers for t in (L.ln1, L.ln2)]
    for t, shape in vectors:
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"a tensor of shape {tuple(t.shape)} {t.dtype}, not {shape} {dtype}")
    biased = lean_biases(dict(conf))
    sizes = {"qkv": (heads * hd + 2 * kv * hd, h, "self_attn.q_proj"), "o": (h, heads * hd, "self_attn.o_proj"),
             "gate_up": (2 * inter, h, "mlp.gate_proj"), "down": (h, inter, "mlp.down_proj")}  # fmt: skip
    lins = [(getattr(L, name), *sizes[name]) for L in net.layers for name in _LINEARS]
    for lin, n, k, proj in [*lins, (net.lm_head, v, h, "lm_head")]:
        # (as from_state builds them: int8 for an int4 shape the kernel does not take, and for the LM head)
        want = fmt if fmt == "dense" or (fmt == "int4" and int4_fits(n, k) and proj != "lm_head") else "int8"
        floats = [t for t in (lin.weight, lin.scales, lin.bias) if t is not None]
        if (lin.fmt, lin.n, lin.k) != (want, n, k) or (lin.bias is not None) != (proj in biased):
            raise ValueError(f"a {lin.fmt} layer of {lin.n}x{lin.k}, not {want} {n}x{k}")
        if any(t.dtype != dtype for t in floats):
            raise ValueError(f"a {lin.fmt} layer's tensors not in {dtype}")
    if net.lm_head.weight is not None and net.lm_head.weight is net.embed and not tied_head(dict(conf)):
        raise ValueError("an LM head tied to the embeddings the config does not tie")
    inv = net.inv_freq
    if tuple(inv.shape) != (hd // 2,) or inv.dtype != torch.float32 or not bool(torch.isfinite(inv).all()):
        raise ValueError("rotary frequencies of another size")
    if not math.isfinite(net.attention_scaling) or net.attention_scaling <= 0:
        raise ValueError(f"attention scaling {net.attention_scaling}")
    rope = rope_inv_freq(conf, hd)
    if rope is not None and (
        not torch.allclose(inv, rope[0], rtol=1e-6, atol=0) or net.attention_scaling != rope[1]
    ):
        raise ValueError("rotary frequencies other than the config's")


def read_saved(path: Path, conf: Mapping[str, Any], loaded: Any) -> LeanLlama | None:
    """The saved lean model, or None when there is none, or it is of other weights, or unreadable, or any tensor in
    it is not what the config and the load's dtype give (``_check_saved``): rebuilt then."""
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
        if meta.get("digest") != tensors_digest(flat):  # a damaged byte anywhere (the checks below: shapes)
            return None
        formats = json.loads(meta["formats"])
        if meta.get("tied") == "1":
            flat["lm_head.weight"] = flat["embed"]
        layers = []
        for i in range(int(conf["num_hidden_layers"])):
            lins = [QLinear.from_tensors(flat, f"{i}.{n}", *formats[f"{i}.{n}"]) for n in _LINEARS]
            layers.append(LeanLayer(flat[f"{i}.ln1"], flat[f"{i}.ln2"], *lins))
        head = QLinear.from_tensors(flat, "lm_head", *formats["lm_head"])
        net = LeanLlama(conf, layers, flat["embed"], flat["norm"], head, flat["inv_freq"],
                        float(meta["attention_scaling"]), loaded.dtype, meta["weights"])  # fmt: skip
        _check_saved(net, meta, conf, loaded)
        return net
    except Exception:  # noqa: BLE001  (a damaged or tampered copy is rebuilt from the weights)
        return None
