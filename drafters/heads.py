"""Pieces shared by the trained draft heads (``eagle``, ``early_exit``): a Llama-style decoder layer with explicit
keys/values (so one layer serves teacher-forced training, EAGLE-3's training-time test and tree drafting), the
reduced draft vocabulary, and the checkpoint format with the checks that refuse a head trained for another target.

A checkpoint is two files side by side: ``NAME.safetensors`` (fp16 weights and the int64 ``d2t`` map from draft
vocabulary to target ids) and ``NAME.json`` (the head config, the target fingerprint it was trained against, the
training data and the held-out metric). References: EAGLE (arXiv 2401.15077), EAGLE-3 (arXiv 2503.01840) for the
reduced draft vocabulary, Kangaroo (arXiv 2404.18911) for the early-exit adapter.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from drafters.base import DrafterError, TargetModel, reason, shown
from kernels.packed import Stacked

FORMAT = "draftgym-head"
VERSION = 1
DATA_DIR = Path(__file__).resolve().parent / "data"


def aux_layers(num_layers: int) -> tuple[int, ...]:
    """The layer counts whose residual streams the engine keeps beside the final hidden state of every forward:
    low, middle and high, as EAGLE-3 fuses them (after 2, L/2 and L-3 layers; arXiv 2503.01840, section 3). A
    target of 1 or 2 layers keeps the stream after its last layer, which both forwards give as transformers'
    ``hidden_states[L]`` does: after the final norm."""
    return tuple(sorted({min(2, num_layers), max(1, num_layers // 2), max(1, num_layers - 3)}))


@dataclass(frozen=True)
class HeadConfig:
    kind: str  # "eagle" | "early_exit"
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rope_theta: float
    rms_eps: float
    draft_vocab: int
    exit_layer: int = 0  # early_exit: the adapter reads the residual stream after this many target layers
    fuse_layers: tuple[int, ...] = ()  # eagle3: the target layer counts whose residual streams the head fuses

    def __post_init__(self) -> None:
        """Types and signs of every field (a head description is a file: anything may be in it), so that a bad
        one is a one-line ``DrafterError`` naming the field, before a module is built from it; ``check_against``
        bounds the sizes by the target's."""

        def bad(name: str, what: str) -> DrafterError:
            return DrafterError(f"config.{name} must be {what}, got {shown(getattr(self, name))}")

        if not isinstance(self.kind, str):
            raise bad("kind", "a string")
        for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "draft_vocab"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise bad(name, "an integer >= 1")
        if not _is_int(self.exit_layer) or self.exit_layer < 0:
            raise bad("exit_layer", "an integer >= 0")
        for name in ("rope_theta", "rms_eps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise bad(name, "a finite number > 0")
        if self.rms_eps >= 1:
            raise bad("rms_eps", "below 1")
        fuse = self.fuse_layers
        if not isinstance(fuse, (list, tuple)) or not all(_is_int(n) and n >= 1 for n in fuse):
            raise bad("fuse_layers", "a list of layer counts >= 1")
        if self.heads % self.kv_heads:
            raise DrafterError(
                f"config.heads ({self.heads}) must be a multiple of config.kv_heads ({self.kv_heads})"
            )
        if self.head_dim % 2:
            raise bad("head_dim", "even (rotary embeddings rotate pairs)")
        object.__setattr__(self, "fuse_layers", tuple(int(n) for n in fuse))

    def check_against(self, model: Any) -> None:
        """Sizes that fit the target ``model`` (a Hugging Face causal LM): the same hidden size, attention and MLP
        widths bounded by the target's (a head is one of its layers, or about that), draft vocabulary and layer
        counts within the target's. A ``DrafterError`` naming the field, before any module is allocated."""
        c = model.config
        hidden, layers, vocab = int(c.hidden_size), int(c.num_hidden_layers), int(c.vocab_size)
        heads = int(c.num_attention_heads)
        q_width = heads * int(getattr(c, "head_dim", None) or hidden // heads)
        inter = int(getattr(c, "intermediate_size", 0) or 0)
        if self.hidden != hidden:
            raise DrafterError(f"config.hidden is {self.hidden}, this target's hidden size is {hidden}")
        if self.heads * self.head_dim > max(4 * hidden, q_width):
            raise DrafterError(
                f"config.heads x config.head_dim ({self.heads} x {self.head_dim}) is too wide for this target "
                f"(at most {max(4 * hidden, q_width)})"
            )
        if self.intermediate > max(8 * hidden, 2 * inter):
            raise DrafterError(
                f"config.intermediate ({self.intermediate}) is too wide for this target (at most "
                f"{max(8 * hidden, 2 * inter)})"
            )
        if self.draft_vocab > vocab:
            raise DrafterError(
                f"config.draft_vocab ({self.draft_vocab}) exceeds this target's vocabulary ({vocab})"
            )
        if self.exit_layer >= layers:
            raise DrafterError(
                f"config.exit_layer ({self.exit_layer}) must be below this target's {layers} layers"
            )
        if len(self.fuse_layers) > layers or any(n > layers for n in self.fuse_layers):
            raise DrafterError(
                f"config.fuse_layers {list(self.fuse_layers)} must be layer counts of this target (1..{layers})"
            )

    @classmethod
    def from_target(cls, model: Any, kind: str, draft_vocab: int, **over: Any) -> HeadConfig:
        c = model.config
        rope = getattr(c, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)))
        head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
        base = dict(
            kind=kind,
            hidden=int(c.hidden_size),
            heads=int(c.num_attention_heads),
            kv_heads=int(c.num_key_value_heads),
            head_dim=head_dim,
            intermediate=int(c.intermediate_size),
            rope_theta=theta,
            rms_eps=float(c.rms_norm_eps),
            draft_vocab=int(draft_vocab),
        )
        base.update(over)
        return cls(**base)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def rope_tables(
    pos: torch.Tensor, d: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of Llama's rotary embedding at ``pos`` ([B, T] or [T] int): [B, 1, T, D] or [T, D]."""
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=pos.device, dtype=torch.float32) / d))
    ang = pos.to(torch.float32)[..., None] * inv  # [B?, T, D/2]
    if ang.dim() == 3:
        ang = ang[:, None]  # [B, 1, T, D/2]
    ang = torch.cat([ang, ang], -1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class DraftLayer(nn.Module):
    """One pre-norm Llama decoder layer (GQA attention + SwiGLU MLP). Attention is split in two halves so that the
    caller chooses the keys and the mask: ``project`` (queries, keys, values) and ``finish`` (output + MLP)."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        h, hd = cfg.hidden, cfg.head_dim
        self.cfg = cfg
        self.norm1 = RMSNorm(h, cfg.rms_eps)
        self.q = nn.Linear(h, cfg.heads * hd, bias=False)
        self.k = nn.Linear(h, cfg.kv_heads * hd, bias=False)
        self.v = nn.Linear(h, cfg.kv_heads * hd, bias=False)
        self.o = nn.Linear(cfg.heads * hd, h, bias=False)
        self.norm2 = RMSNorm(h, cfg.rms_eps)
        self.gate = nn.Linear(h, cfg.intermediate, bias=False)
        self.up = nn.Linear(h, cfg.intermediate, bias=False)
        self.down = nn.Linear(cfg.intermediate, h, bias=False)
        # inference: q/k/v as one product, gate/up as another (kernels.packed.Stacked; training runs each layer)
        self.qkv_stack, self.gate_up_stack = Stacked(), Stacked()

    def project(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [B, T, H]; pos: [B, T] or [T]. Returns q [B, Hq, T, D], k and v [B, Hkv, T, D] (rotated q, k)."""
        b, t, _ = x.shape
        c = self.cfg
        hn = self.norm1(x)
        q, k, v = self.qkv_stack(hn, self.q, self.k, self.v)
        q = q.reshape(b, t, c.heads, c.head_dim).transpose(1, 2)
        k = k.reshape(b, t, c.kv_heads, c.head_dim).transpose(1, 2)
        v = v.reshape(b, t, c.kv_heads, c.head_dim).transpose(1, 2)
        cos, sin = rope_tables(pos, c.head_dim, c.rope_theta, x.dtype)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """x: [B, T, H] (the layer input); attn: [B, Hq, T, D] (attention output)."""
        b, _, t, _ = attn.shape
        x = x + self.o(attn.transpose(1, 2).reshape(b, t, -1))
        hn = self.norm2(x)
        gate, up = self.gate_up_stack(hn, self.gate, self.up)
        return x + self.down(F.silu(gate) * up)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """Scaled dot-product attention with grouped KV heads. ``allowed``: bool, broadcast to [B, Hq, Tq, Tk]."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)


def attend_few(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``attend`` for a few queries per sequence over fp32 caches (a tree's frontier while drafting): two batched
    products with the query heads of each KV head side by side, in fp32, with none of the blocked kernel's setup
    (on a CPU, ``scaled_dot_product_attention`` with a mask spends ~2 ms on 16 sequences x 1 query x 300 keys).
    q: [B, Hq, T, D]; k, v: [B, Hkv, S, D] fp32; allowed: bool [B, T, S]. Returns [B, Hq, T, D] in q's dtype."""
    b, hq, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    g = hq // hkv  # query head h reads KV head h // g, as enable_gqa does
    scores = (q.float().reshape(b, hkv, g * t, d) @ k.transpose(2, 3)).view(b, hkv, g, t, s)
    scores = scores.masked_fill_(~allowed[:, None, None], float("-inf")).view(b, hkv, g * t, s)
    return (torch.softmax(scores * d**-0.5, dim=-1) @ v).view(b, hq, t, d).to(q.dtype)


# ---- target fingerprint and checkpoints ----


def target_fingerprint(model: Any, model_id: str) -> dict[str, Any]:
    """What a head must match: the target's id, shapes, and a checksum of its embedding (same shapes, other weights)."""
    c = model.config
    emb = model.get_input_embeddings().weight
    return {
        "model_id": str(model_id),
        "hidden_size": int(c.hidden_size),
        "vocab_size": int(c.vocab_size),
        "num_layers": int(c.num_hidden_layers),
        "embed_checksum": round(float(emb[:512].float().abs().mean()), 6),
    }


def check_fingerprint(saved: Any, model: Any, model_id: str, where: str) -> None:
    """Raise a DrafterError naming the first difference between a head's target and this one (or the field of the
    saved fingerprint that is not of its type: it comes from a file)."""
    if not isinstance(saved, dict):
        raise DrafterError(f"{where}: its target fingerprint must be a table, got {shown(saved)}")
    now = target_fingerprint(model, model_id)
    for key in ("hidden_size", "vocab_size", "num_layers", "model_id"):
        if saved.get(key) != now[key]:
            raise DrafterError(
                f"{where} was trained for another target ({key} {shown(saved.get(key))}, this target has "
                f"{now[key]!r}); train one for it with: draftgym train-drafter ... --model {model_id}"
            )
    a, b = saved.get("embed_checksum"), now["embed_checksum"]
    if isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a):
        raise DrafterError(
            f"{where}: its target fingerprint's embed_checksum must be a finite number, got {shown(a)}"
        )
    if abs(a - b) > 2e-2 * max(abs(a), abs(b), 1e-6):
        raise DrafterError(
            f"{where} was trained for a target with other weights (embedding checksum {a} vs {b})"
        )


def save_head(
    path: Path, module: nn.Module, d2t: torch.Tensor, cfg: HeadConfig, meta: dict[str, Any]
) -> Path:
    """Write ``path`` (.safetensors, fp16) and its ``.json`` beside it, each atomically; the description names the
    weights' sha256, so that a kill between the two renames (new weights beside the old description) is caught
    when the head loads."""
    from safetensors.torch import save_file

    path = Path(path).with_suffix(".safetensors")
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.float16).contiguous() for k, v in module.state_dict().items()}
    tensors["d2t"] = d2t.to(torch.int64).contiguous()
    header = {"format": FORMAT, "version": VERSION, "config": asdict(cfg), **meta}
    tmp_w, tmp_j = path.with_suffix(".safetensors.tmp"), path.with_suffix(".json.tmp")
    save_file(tensors, str(tmp_w))
    header["weights_sha256"] = hashlib.sha256(tmp_w.read_bytes()).hexdigest()
    tmp_j.write_text(json.dumps(header, indent=2))
    os.replace(tmp_w, path)
    os.replace(tmp_j, path.with_suffix(".json"))
    return path


def load_head(
    path: Path, kind: str, model: Any, model_id: str
) -> tuple[HeadConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """Read and check a head: format, kind, target fingerprint, tensor names and shapes. Every failure is a
    one-line DrafterError that names the file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path).with_suffix(".safetensors")
    meta_path = path.with_suffix(".json")
    if not path.is_file() or not meta_path.is_file():
        raise DrafterError(f"no {kind} head at {path} (needs {path.name} and {meta_path.name})")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        cfg = HeadConfig(**meta["config"])
    except DrafterError as err:  # a field of the wrong type or sign
        raise DrafterError(f"{meta_path}: {err}") from err
    except (
        KeyError,
        TypeError,
        ValueError,
        RecursionError,
        OverflowError,
    ) as err:  # JSON's errors are ValueErrors
        why = reason(err)  # one line, whatever the file held
        raise DrafterError(f"{meta_path} is not a draftgym head description ({why})") from err
    if meta.get("format") != FORMAT or cfg.kind != kind:
        raise DrafterError(f"{meta_path} describes a {cfg.kind!r} head, not {kind!r}")
    version = meta.get("version", VERSION)  # (a head of a later format: refused, not misread)
    if isinstance(version, bool) or version != VERSION:
        raise DrafterError(
            f"{meta_path}: head format version {shown(version)} is not one this draftgym reads ({VERSION})"
        )
    check_fingerprint(meta.get("target", {}), model, model_id, str(path))
    try:  # sizes within the target's: before any module is built from them
        cfg.check_against(model)
    except DrafterError as err:
        raise DrafterError(f"{meta_path}: {err}") from err
    want = meta.get("weights_sha256")  # heads saved before it was recorded have none
    if want is not None and not isinstance(want, str):
        raise DrafterError(f"{meta_path}: weights_sha256 must be a hex string, got {shown(want)}")
    if want is not None and want != hashlib.sha256(path.read_bytes()).hexdigest():
        raise DrafterError(
            f"{path} is not the weights {meta_path.name} describes (a save cut short, or a file replaced)"
        )
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise DrafterError(f"{path} is corrupted or not a safetensors file ({err})") from err
    if "d2t" not in tensors or tensors["d2t"].shape != (cfg.draft_vocab,):
        raise DrafterError(f"{path} has no valid draft vocabulary map 'd2t' of {cfg.draft_vocab} ids")
    d2t = tensors["d2t"]
    if d2t.dtype not in (torch.int32, torch.int64):  # (unsigned ones have no min(); uint8 indexes as a mask)
        raise DrafterError(
            f"{path}: the draft vocabulary map 'd2t' must hold int32/int64 ids, not {d2t.dtype}"
        )
    tensors["d2t"] = d2t = d2t.long()
    if int(d2t.min()) < 0 or int(d2t.max()) >= int(model.config.vocab_size):
        raise DrafterError(f"{path}: draft vocabulary ids fall outside the target's vocabulary")
    for name, t in tensors.items():  # a head of NaN weights drafts, but nothing the target accepts
        if name == "d2t":
            continue
        if not t.is_floating_point():  # complex, integer, bool: a parameter holds real numbers
            raise DrafterError(f"{path}: tensor {name} must hold real floating-point values, not {t.dtype}")
        if not _finite(t):
            raise DrafterError(f"{path}: tensor {name} holds NaN or infinite values")
    return cfg, tensors, meta


def _finite(t: torch.Tensor) -> bool:
    """Whether a floating tensor holds no NaN or inf (fp8 has no ``isfinite``: checked widened, exactly)."""
    return bool((t if t.dtype.itemsize > 1 else t.float()).isfinite().all())


def load_state(
    module: nn.Module, tensors: dict[str, torch.Tensor], where: str, dtype: torch.dtype | None = None
) -> None:
    """Load weights into ``module`` with shape and value checks that speak to the user. Every weight must be
    finite in the dtype it is converted to (the module's; also ``dtype``, the one the head will compute in, where
    given): a float64 1e300 is finite in the file and inf in fp32."""
    want = module.state_dict()
    got = {k: v for k, v in tensors.items() if k != "d2t"}
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing or extra:
        raise DrafterError(f"{where} does not match this head: missing {missing[:3]}, unexpected {extra[:3]}")
    for k, v in want.items():
        if tuple(got[k].shape) != tuple(v.shape):
            raise DrafterError(
                f"{where}: tensor {k} has shape {tuple(got[k].shape)}, expected {tuple(v.shape)}"
            )
    cast = {}
    for k, v in want.items():
        if v.is_floating_point() and not got[k].is_floating_point():  # complex, integer, bool
            raise DrafterError(
                f"{where}: tensor {k} must hold real floating-point values, not {got[k].dtype}"
            )
        cast[k] = got[k].to(v.dtype)
        if not v.is_floating_point():
            continue
        for t in (cast[k], *([got[k].to(dtype)] if dtype not in (None, v.dtype) else [])):
            if not _finite(t):
                raise DrafterError(
                    f"{where}: tensor {k} holds values that are NaN or infinite in {t.dtype} (out of its range)"
                )
    module.load_state_dict(cast)


def cache_heads_dir() -> Path:
    """Where ``train-drafter`` writes heads by default: $DRAFTGYM_CACHE/heads, else $XDG_CACHE_HOME/draftgym/heads."""
    if os.environ.get("DRAFTGYM_CACHE"):
        return Path(os.environ["DRAFTGYM_CACHE"]) / "heads"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "draftgym" / "heads"


def head_name(kind: str, model_id: str) -> str:
    return f"{kind}-{Path(model_id).name}"


def find_head(kind: str, model_id: str, weights: str | None) -> Path:
    """The head to load: ``weights`` if given, else the user's trained one in the cache, else the shipped one."""
    if weights is not None and not str(weights).strip():  # "" read as not given: the default head, silently
        raise DrafterError(f"{kind}: its weights option names no file (leave it out for the default head)")
    if weights:
        return Path(weights)
    name = head_name(kind, model_id) + ".safetensors"
    for folder in (cache_heads_dir(), DATA_DIR):
        if (folder / name).is_file():
            return folder / name
    raise DrafterError(
        f"no trained {kind} head for model {model_id!r}; train one with "
        f"`draftgym train-drafter {kind} --model {model_id}` (it is saved to {cache_heads_dir() / name})"
    )


def head_paths(name: str, d: Any, model_id: str) -> dict[str, Path]:
    """The head files drafter ``d`` (made as ``name``) loads for ``model_id`` (``find_head``): ``{name: path}`` for
    a head drafter (eagle, eagle3, early_exit: those with a ``weights`` option), ``{name.PART: path}`` for each
    head part of a hybrid. A head not found is left out (its drafter says so when it loads)."""
    out: dict[str, Path] = {}
    for key, part in zip(getattr(d, "part_names", []), getattr(d, "parts", [])):
        out.update(head_paths(f"{name}.{key}", part, model_id))
    if hasattr(d, "weights"):
        try:
            path = find_head(getattr(d, "kind", getattr(d, "name", name)), model_id, d.weights)
        except DrafterError:
            return out
        if path.is_file():
            out[name] = path
    return out


def head_dtype(target: TargetModel) -> torch.dtype:
    """The head computes in the target's dtype, except bf16 on a CPU without native bf16 (slow there): fp32."""
    dtype, device = target.dtype, target.device
    if dtype == torch.bfloat16 and torch.device(device).type == "cpu" and not _cpu_bf16():
        return torch.float32
    return dtype


def _cpu_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(f in flags for f in (" avx512_bf16", " amx_bf16", " bf16"))
