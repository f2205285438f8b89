"""A Hugging Face model folder given by ``--model``: its ``config.json`` is checked against its weights before either
forward runs them — a layer more or less, heads or widths that do not match, a rope that is not an object, a
tensor missing — as one ``ModelError`` naming the tensor; the transformers path no longer fills a missing weight
with random values and decodes on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from env.model import ModelError, load_model

CONFIG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=64, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False)  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(LlamaConfig(**CONFIG)).save_pretrained(out)
    return out


def _variant(folder: Path, tmp_path: Path, config=None, drop: str | None = None) -> Path:
    from safetensors.torch import load_file, save_file

    out = tmp_path / "m"
    out.mkdir()
    values = json.loads((folder / "config.json").read_text())
    values.update(config or {})
    (out / "config.json").write_text(json.dumps(values))
    state = load_file(folder / "model.safetensors")
    if drop:
        del state[drop]
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_the_folder_as_saved_loads(folder):
    assert load_model(str(folder), dtype="fp32", device="cpu").model_id == str(folder)


@pytest.mark.parametrize(
    ("config", "drop", "needle"),
    [
        ({"num_hidden_layers": 3}, None, "has no model.layers.2.input_layernorm.weight"),
        (
            {"num_key_value_heads": 4},
            None,
            "self_attn.k_proj.weight has shape [16, 32], config.json gives [32, 32]",
        ),
        (
            {"intermediate_size": 48},
            None,
            "mlp.gate_proj.weight has shape [64, 32], config.json gives [48, 32]",
        ),
        ({"rope_parameters": "abc"}, None, "rope_parameters is 'abc', not an object"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": "x"}}, None, "rope_theta is 'x'"),
        (None, "model.layers.1.mlp.down_proj.weight", "has no model.layers.1.mlp.down_proj.weight"),
    ],
)
def test_config_and_weights_that_disagree_are_one_line_on_the_lean_path(
    folder, tmp_path, config, drop, needle
):
    with pytest.raises(ModelError, match=needle.replace("[", r"\[").replace("]", r"\]")) as err:
        load_model(str(_variant(folder, tmp_path, config, drop)), dtype="fp32", device="cpu")
    assert "\n" not in str(err.value)


def test_the_transformers_path_refuses_a_missing_weight(folder, tmp_path):
    """A Llama-family folder's tensors are checked before transformers reads them; another model type's after,
    by transformers' load report (here Qwen3's q_norm and k_norm, which a Llama checkpoint lacks)."""
    path = _variant(folder, tmp_path, drop="model.layers.1.mlp.down_proj.weight")
    with pytest.raises(ModelError, match="has no model.layers.1.mlp.down_proj.weight"):
        load_model(str(path), dtype="fp32", device="cpu", forward="hf")
    (tmp_path / "qwen3").mkdir()
    other = _variant(
        folder, tmp_path / "qwen3", {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
    )
    with pytest.raises(
        ModelError, match=r"missing keys in its weights, e.g. model.layers.\d.self_attn.[qk]_norm"
    ):
        load_model(str(other), dtype="fp32", device="cpu", forward="hf")


def test_a_saved_lean_copy_is_rebuilt_when_config_json_changes(folder, tmp_path):
    """The lean forward saves its built model beside the weights; the rope's frequencies in it come from
    config.json, so an edited config (same weights file) must not reuse it."""
    from env.lean import lean_of, rope_inv_freq
    from env.lean_files import saved_path

    path = _variant(folder, tmp_path)
    first = load_model(str(path), dtype="bf16", device="cpu", weights="int8")
    lean_of(first)
    assert saved_path(first).is_file()
    values = json.loads((path / "config.json").read_text())
    rope = values.get("rope_parameters") or values  # (a newer transformers writes it inside rope_parameters)
    rope["rope_theta"] = 500000.0
    (path / "config.json").write_text(json.dumps(values))
    again = load_model(str(path), dtype="bf16", device="cpu", weights="int8")
    want, _ = rope_inv_freq(values, CONFIG["hidden_size"] // CONFIG["num_attention_heads"])
    assert not torch.allclose(lean_of(first).inv_freq.float().cpu(), want)  # the edit changes the frequencies
    assert torch.allclose(lean_of(again).inv_freq.float().cpu(), want)


@pytest.mark.parametrize("damage", ["truncated", "architecture"])
def test_a_damaged_embedded_gguf_is_one_line(tmp_path, monkeypatch, damage):
    """The embedded model converts from the GGUF its package ships: a truncated one, or one naming an architecture
    transformers does not read, is a ModelError saying how to reinstall it, not a reshape traceback."""
    import env.model as model

    src = model.embedded_gguf_path()
    data = src.read_bytes()
    if damage == "truncated":
        data = data[: len(data) // 2]
    else:
        data = data.replace(b"llama", b"llamb", 1)
    (tmp_path / "pkg").mkdir()
    bad = tmp_path / "pkg" / src.name
    bad.write_bytes(data)
    monkeypatch.setattr(model, "embedded_gguf_path", lambda: bad)
    monkeypatch.setattr(model, "cache_dir", lambda: tmp_path / "cache")
    with pytest.raises(ModelError, match="cannot read the embedded model .* reinstall it") as err:
        model.embedded_model_folder()
    assert "\n" not in str(err.value)
    assert not (tmp_path / "cache" / "models" / model.DEFAULT_MODEL).exists()
