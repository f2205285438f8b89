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


def lean_shapes(values: dict[str, Any]) -> dict[str, list[int]]:
    """Every tensor the lean forward reads from a Llama-family ``model.safetensors`` (biases and a tied LM head
    optional, not listed), with the shape ``config.json`` gives it."""
    h, v = values["hidden_size"], values["vocab_size"]
    heads = values["num_attention_heads"]
    kv = values.get("num_key_value_heads") or heads
    hd = values.get("head_dim") or h // heads
    inter = values["intermediate_size"]
    out = {"model.embed_tokens.weight": [v, h], "model.norm.weight": [h]}
    for i in range(values["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": [h], p + "post_attention_layernorm.weight": [h],
                p + "self_attn.q_proj.weight": [heads * hd, h], p + "self_attn.k_proj.weight": [kv * hd, h],
                p + "self_attn.v_proj.weight": [kv * hd, h], p + "self_attn.o_proj.weight": [h, heads * hd],
                p + "mlp.gate_proj.weight": [inter, h], p + "mlp.up_proj.weight": [inter, h],
                p + "mlp.down_proj.weight": [h, inter]}  # fmt: skip
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
            raise _error(f"{weights_file} has no {name} (config.json: {values['num_hidden_layers']} layers)")
        got = list(f.get_slice(name).get_shape())
        if got != want:
            raise _error(f"{weights_file}: {name} has shape {got}, config.json gives {want}")
    if (
        "lm_head.weight" in keys
        and list(f.get_slice("lm_head.weight").get_shape())
        != lean_shapes(values)["model.embed_tokens.weight"]
    ):
        raise _error(f"{weights_file}: lm_head.weight does not match the embeddings' shape")
