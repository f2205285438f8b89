"""What a Hugging Face model folder must hold before either forward runs it: ``config.json``'s sizes as the
engines read them (``check_config``), and for the lean forward every tensor it reads, of the shape the config
gives (``check_lean_weights``); the safetensors files that hold the weights (``weight_files``, a sharded checkpoint's
too; never a pickle) and no more parameters in the config than they hold (``check_weight_count``). Each problem is
one ``env.model.ModelError`` naming the field, file or tensor."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# the lean forward's model types (env.lean.LEAN_TYPES), rope on every head of each
ROPE_PAIRS = ("llama", "qwen2", "mistral")
MAX_SHARDS = 4096  # a sharded checkpoint's files: far past any model's (a 405B model has 191)
PARAMS_SLACK = 4  # config.json may give at most this many times the parameters its weights hold (plus 2^20)


def _error(message: str) -> Exception:
    from env.model import ModelError  # (env.model imports these checks)

    return ModelError(message)


def check_no_code(folder: Path, values: dict[str, Any]) -> None:
    """A folder whose ``config.json`` names code of its own (``auto_map``) for a model type transformers does not
    know is refused in one line: transformers would import a Python file from the folder, after asking on a terminal
    (draftgym runs no code from a file, and calls transformers with ``trust_remote_code=False``, which refuses it
    in a paragraph). A known type with an ``auto_map`` loads as that type, the folder's code unused."""
    if "auto_map" not in values:
        return
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    kind = values.get("model_type")
    if not isinstance(kind, str) or kind not in CONFIG_MAPPING_NAMES:
        raise _error(
            f"{folder / 'config.json'} names custom code (auto_map) for model type {str(kind)[:40]!r}, which "
            "transformers does not know: draftgym runs no code from a model folder"
        )


def check_config(values: dict[str, Any], where: Path) -> None:
    """The sizes a decoder-only model's ``config.json`` gives, as the engines read them: positive integers (within
    what a model could be), heads that divide, a positive epsilon; ``ModelError`` naming the field otherwise."""
    import math

    def count(key: str, required: bool = True, most: int = 1 << 24) -> int | None:
        v = values.get(key)
        if v is None and not required:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= most:
            raise _error(f"{where}: {key} is {v!r}, not an integer in 1..{most}")
        return v

    hidden, heads = count("hidden_size"), count("num_attention_heads")
    count("num_hidden_layers", most=4096)
    count("vocab_size")
    count("intermediate_size", required=False)
    count("max_position_embeddings", required=False, most=1 << 30)
    kv = count("num_key_value_heads", required=False) or heads
    head_dim = count("head_dim", required=False)
    if heads % kv or (head_dim is None and hidden % heads):  # type: ignore[operator]
        raise _error(f"{where}: {heads} attention heads do not split into {kv} KV heads and hidden {hidden}")
    dims = head_dim or hidden // heads  # type: ignore[operator]
    if values.get("model_type") in ROPE_PAIRS and dims % 2:
        raise _error(
            f"{where}: heads of {dims} dimensions; rotary position embeddings rotate pairs, so it must be even"
        )
    check_eos(values.get("eos_token_id"), where)
    for key in ("rms_norm_eps", "rope_theta"):
        v = values.get(key)
        if v is not None and (
            isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0
        ):
            raise _error(f"{where}: {key} is {v!r}, not a positive number")


def check_eos(eos: Any, where: Path) -> None:
    """An ``eos_token_id`` as transformers' configs take it: none, a token id, or a list of them (not a bool)."""

    def is_id(e: Any) -> bool:
        return isinstance(e, int) and not isinstance(e, bool)

    if eos is not None and not (is_id(eos) or (isinstance(eos, list) and all(is_id(e) for e in eos))):
        raise _error(f"{where}: eos_token_id must be a token id or a list of them")


def lean_biases(values: dict[str, Any]) -> set[str]:
    """The projections of each layer that carry a bias, as transformers builds the model: Llama's ``attention_bias``
    (q, k, v, o) and ``mlp_bias`` (gate, up, down), Qwen2's q, k and v always, none in Mistral."""
    kind = values.get("model_type")
    out = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"} if kind == "qwen2" else set()
    if kind == "llama" and values.get("attention_bias"):
        out |= {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"}
    if kind == "llama" and values.get("mlp_bias"):
        out |= {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    return out


def tied_head(values: dict[str, Any]) -> bool:
    """Whether the LM head is the embeddings (``tie_word_embeddings``; false when absent, as in transformers' Llama,
    Qwen2 and Mistral configs). A tied model's file may still hold an ``lm_head.weight``, which is then used."""
    return bool(values.get("tie_word_embeddings", False))


def lean_shapes(values: dict[str, Any]) -> dict[str, list[int]]:
    """Every tensor the lean forward reads from a Llama-family ``model.safetensors``, with the shape ``config.json``
    gives it: the biases the config gives its projections (``lean_biases``) included, the LM head not (see
    ``check_lean_weights``)."""
    h, v = values["hidden_size"], values["vocab_size"]
    heads = values["num_attention_heads"]
    kv = values.get("num_key_value_heads") or heads
    hd = values.get("head_dim") or h // heads
    inter = values["intermediate_size"]
    out = {"model.embed_tokens.weight": [v, h], "model.norm.weight": [h]}
    biased = lean_biases(values)
    for i in range(values["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": [h], p + "post_attention_layernorm.weight": [h]}
        for proj, shape in {"self_attn.q_proj": [heads * hd, h], "self_attn.k_proj": [kv * hd, h],
                            "self_attn.v_proj": [kv * hd, h], "self_attn.o_proj": [h, heads * hd],
                            "mlp.gate_proj": [inter, h], "mlp.up_proj": [inter, h],
                            "mlp.down_proj": [h, inter]}.items():  # fmt: skip
            out[p + proj + ".weight"] = shape
            if proj in biased:
                out[p + proj + ".bias"] = shape[:1]
    return out


def check_lean_weights(f: Any, values: dict[str, Any], weights_file: Path) -> None:
    """The weights file (an open ``safe_open`` handle) holds every tensor the lean forward reads, of the shape
    ``config.json`` says (a layer more or less, a head count or size off, a projection of another width: one line
    here, not a KeyError or a shape error at the first forward); and the config's rope is one it can read."""
    where = weights_file.parent / "config.json"
    if values.get("intermediate_size") is None:
        raise _error(f"{where}: intermediate_size is missing (the lean forward's MLP width)")
    for key in ("rope_parameters", "rope_scaling"):
        rope = values.get(key)
        if rope is not None and not isinstance(rope, dict):
            raise _error(f"{where}: {key} is {str(rope)[:40]!r}, not an object")
        theta = (rope or {}).get("rope_theta")
        if theta is not None and (
            isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0
        ):
            raise _error(f"{where}: {key}.rope_theta is {str(theta)[:40]!r}, not a positive number")
    keys = set(f.keys())
    for name, want in lean_shapes(values).items():
        if name not in keys:
            why = (
                f"{values.get('model_type')} with attention_bias {values.get('attention_bias', False)}, mlp_bias "
                f"{values.get('mlp_bias', False)}"
                if name.endswith(".bias")
                else f"{values['num_hidden_layers']} layers"
            )
            raise _error(f"{weights_file} has no {name} (config.json: {why})")
        got = list(f.get_slice(name).get_shape())
        if got != want:
            raise _error(f"{weights_file}: {name} has shape {got}, config.json gives {want}")
    if "lm_head.weight" not in keys and not tied_head(values):
        raise _error(
            f"{weights_file} has no lm_head.weight (config.json: tie_word_embeddings is not true, so the LM head is "
            "not the embeddings)"
        )
    if (
        "lm_head.weight" in keys
        and list(f.get_slice("lm_head.weight").get_shape())
        != lean_shapes(values)["model.embed_tokens.weight"]
    ):
        raise _error(f"{weights_file}: lm_head.weight does not match the embeddings' shape")


def weight_files(folder: Path) -> tuple[list[Path], Path]:
    """The safetensors files that hold a folder's weights, as transformers picks them: ``model.safetensors``, else
    the shards ``model.safetensors.index.json`` names; and the file a message names (that one, or the index).
    Nothing else is read: a folder of pickle-based ``pytorch_model.bin`` weights is refused (unpickling one may
    run code), as is an index naming a file outside the folder or one the folder lacks."""
    single = folder / "model.safetensors"
    if single.is_file():
        return [single], single
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        from drafters.base import reason, shown

        try:
            values = json.loads(index.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError) as err:  # JSON's and UTF-8's errors are ValueErrors
            raise _error(f"cannot read {index}: {reason(err)}") from None
        wmap = values.get("weight_map") if isinstance(values, dict) else None
        if not isinstance(wmap, dict) or not wmap:
            raise _error(f"{index}: weight_map is not an object naming each tensor's file")
        names = list(dict.fromkeys(wmap.values()))
        if len(names) > MAX_SHARDS:
            raise _error(f"{index} names {len(names)} files; at most {MAX_SHARDS}")
        for name in names:
            if not isinstance(name, str) or Path(name).name != name or not name.endswith(".safetensors"):
                raise _error(f"{index}: {shown(name)} is not the name of a .safetensors file in {folder}")
            if not (folder / name).is_file():
                raise _error(f"{index} names {name}, which {folder} does not hold")
        return [folder / name for name in names], index
    pickled = sorted(p.name for p in folder.glob("*.bin"))
    if pickled:
        raise _error(
            f"model folder {folder} holds {pickled[0]} (a PyTorch pickle) but no model.safetensors: draftgym reads "
            "safetensors weights only, which run no code when read (save the model with safe_serialization=True)"
        )
    raise _error(
        f"model folder {folder} has no weights: no model.safetensors nor model.safetensors.index.json"
    )


class Tensors:
    """The tensors' shapes of one or several safetensors files (the shards of one checkpoint) by name, with the part
    of a ``safe_open`` handle's API the checks read: ``keys()`` and ``get_slice(name).get_shape()``."""

    def __init__(self, shapes: dict[str, list[int]]) -> None:
        self.shapes = shapes

    def keys(self) -> list[str]:
        return list(self.shapes)

    def __contains__(self, name: object) -> bool:
        return name in self.shapes

    def get_slice(self, name: str) -> Any:
        return _Slice(self.shapes[name])


class _Slice:
    def __init__(self, shape: list[int]) -> None:
        self._shape = shape

    def get_shape(self) -> list[int]:
        return list(self._shape)


def read_headers(files: list[Path]) -> Tensors:
    """Every file's header (``safe_open``: names and shapes, no tensor read; one file open at a time), as one
    ``Tensors``: a name in two shards is the first one's, as the first file transformers reads it from."""
    from safetensors import safe_open

    shapes: dict[str, list[int]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118  (a safe_open handle)
                shapes.setdefault(name, list(f.get_slice(name).get_shape()))
    return Tensors(shapes)


def config_params(values: dict[str, Any]) -> int:
    """About how many parameters ``config.json``'s sizes give a decoder-only model (``check_config``'d): the
    embeddings and each layer's attention and three-matrix MLP; no LM head, norms or experts, so never more than the
    model really has (an MLP width under another name counts as none)."""
    h, heads = values["hidden_size"], values["num_attention_heads"]
    kv = values.get("num_key_value_heads") or heads
    hd = values.get("head_dim") or h // heads
    inter = values.get("intermediate_size") or 0
    return values["vocab_size"] * h + values["num_hidden_layers"] * (
        h * hd * (2 * heads + 2 * kv) + 3 * h * inter
    )


def check_weight_count(tensors: Tensors, values: dict[str, Any], weights_file: Path) -> None:
    """config.json gives no more parameters than the weights hold (``PARAMS_SLACK`` times, for packed formats):
    transformers allocates every parameter the file lacks, so a 700-byte config asking for vocab 2^24 and hidden
    2^14 would be a 1 TB allocation, not a load."""
    import math

    held = sum(math.prod(shape) for shape in tensors.shapes.values())
    implied = config_params(values)
    if implied > PARAMS_SLACK * held + (1 << 20):
        raise _error(
            f"{weights_file.parent / 'config.json'} gives a model of about {implied:,} parameters, but "
            f"{weights_file.name} holds {held:,} values"
        )


def check_weights(folder: Path, values: dict[str, Any], lean: bool) -> None:
    """The folder's safetensors weights (``weight_files``: one file or a sharded checkpoint's shards), checked by
    their headers before either forward reads them: no more parameters in config.json than they hold (what
    transformers would allocate), and for a Llama-family model (``lean``) every tensor the forward reads, of the
    shape config.json gives it."""
    from safetensors import SafetensorError

    files, weights_file = weight_files(folder)
    try:
        f = read_headers(files)
    except (OSError, SafetensorError) as err:
        raise _error(f"cannot load model from {folder}: {str(err).splitlines()[0]}") from err
    if lean:
        if "model.embed_tokens.weight" not in f:
            raise _error(f"{weights_file} has no model.embed_tokens.weight (not a Llama-family model)")
        shape = f.shapes["model.embed_tokens.weight"]
        if shape != [values["vocab_size"], values["hidden_size"]]:
            raise _error(
                f"{weights_file}: embeddings of shape {shape}, but config.json says vocab_size "
                f"{values['vocab_size']} and hidden_size {values['hidden_size']}"
            )
        check_lean_weights(f, values, weights_file)
    check_weight_count(f, values, weights_file)
