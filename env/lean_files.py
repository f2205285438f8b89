"""Where a lean model's weights come from besides a state dict, and where it is kept between processes: the
GGUF's own int4 blocks (``gguf_int4``; for the embedded model read once and cached beside the converted model,
``cached_int4``), and the built lean model in its format, saved in the model folder (``lean/``) and read back by a
later process instead of converting again (``saved_path``, ``save``, ``read_saved``). Cache files are written
atomically; a damaged or foreign one is rebuilt.
"""

from __future__ import annotations

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
        deq = (q.float() - 8).reshape(n, k // GROUP, GROUP) * s[..., None] + z[..., None]
        if torch.allclose(deq.reshape(n, k), dense.float(), rtol=0, atol=1e-5):
            out[name] = (q, s, z)
    return out


# ---- the GGUF's blocks, cached ----
INT4_FILE = "int4_q4_1.safetensors"  # the GGUF's Q4_1 blocks in HF order, cached beside the converted model


def cached_int4(loaded: Any, cfg: Mapping[str, Any], state: Mapping[str, torch.Tensor]):
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


def read_saved(path: Path, conf: Mapping[str, Any], loaded: Any) -> LeanLlama | None:
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
