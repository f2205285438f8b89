"""What a Hugging Face model folder must hold before either forward runs it: ``config.json``'s sizes as the
engines read them (``check_config``), and for the lean forward every tensor it reads, of the shape the config
gives (``check_lean_weights``). Each problem is one ``env.model.ModelError`` naming the field or tensor."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _error(message: str) -> Exception:
    from env.model import ModelError  # (env.model imports these checks)

    return ModelError(message)


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
    for key in ("rms_norm_eps", "rope_theta"):
        v = values.get(key)
        if v is not None and (
            isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0
        ):
            raise _error(f"{where}: {key} is {v!r}, not a positive number")


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
