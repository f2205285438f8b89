"""What the lean forward (env.lean) reads, checked: a quantized target off the CPU runs the CPU's quantized
weights, the biases a config gives its projections are applied, an untied LM head must be in the file, and a saved
lean model (env.lean_files) or a cached GGUF int4 block file that is not what the config gives is rebuilt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from env.lean import LeanLlama, lean_of
from env.model import ModelError, load_model
from env.ragged_cache import RaggedCache, Write
from kernels.quant import GROUP, QLinear
from tests.drafters.tiny import tiny_loaded

SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=96, max_position_embeddings=128)  # fmt: skip
IDS = torch.tensor([[3, 5, 7, 9, 11, 13]])


def _logits(net: LeanLlama, cfg: dict, ids: torch.Tensor = IDS) -> torch.Tensor:
    hd = cfg["hidden_size"] // cfg["num_attention_heads"]
    cache = RaggedCache(cfg["num_hidden_layers"], 1, cfg["num_key_value_heads"], hd, net.dtype, "cpu")
    q = ids.shape[1]
    write = Write(torch.zeros(1, q, dtype=torch.long), torch.arange(q)[None], 0, 1, q, 0)
    return net.head(net.forward(ids, torch.arange(q)[None], cache, write, None)[0])


def _folder(tmp_path: Path, seed: int = 0, **config) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**(SIZES | config)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 1.0)  # (zeros as initialized: a dropped bias would change nothing)
    out = tmp_path / f"m{seed}"
    model.save_pretrained(out)
    return out


# ---- 1. a quantized target off the CPU ----
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_quantized_target_off_the_cpu_runs_the_cpus_quantized_weights(monkeypatch, fmt):
    """``--weights int8/int4`` on CUDA: each layer is quantized on the CPU as there, then moved by ``QLinear.to``
    (dequantized); "meta" stands for any device that is not the CPU. Before, such a device got the dense weights
    while the model still said int8."""
    loaded = tiny_loaded()
    conf, state = loaded.config.to_dict(), loaded.state
    cpu = LeanLlama.from_state(conf, state, torch.float32, torch.device("cpu"), fmt)
    moved: list[tuple[QLinear, QLinear]] = []
    to = QLinear.to

    def spy(self: QLinear, device: torch.device) -> QLinear:
        out = to(self, device)
        moved.append((self, out))
        return out

    monkeypatch.setattr(QLinear, "to", spy)
    meta = LeanLlama.from_state(conf, state, torch.float32, torch.device("meta"), fmt)
    want = [getattr(L, n) for L in cpu.layers for n in ("qkv", "o", "gate_up", "down")] + [cpu.lm_head]
    assert len(moved) == len(want) and meta.weights == fmt
    for (before, after), ref in zip(moved, want):
        assert before.fmt == ref.fmt != "dense"  # quantized before it was moved
        assert torch.equal(before.weight_fp32(), ref.weight_fp32())  # the very weights the CPU runs
        assert after.fmt == "dense" and after.weight.device.type == "meta"
        assert tuple(after.weight.shape) == (ref.n, ref.k) and after.weight.dtype == torch.float32
    got = [getattr(L, n) for L in meta.layers for n in ("qkv", "o", "gate_up", "down")] + [meta.lm_head]
    assert all(g is a for g, (_, a) in zip(got, moved))


# ---- 2. biases ----
def test_the_biases_a_llama_config_gives_are_applied(tmp_path):
    """``mlp_bias`` and ``attention_bias``: the lean logits equal transformers' (the MLP's were dropped: 0.42)."""
    from transformers import LlamaForCausalLM

    folder = _folder(tmp_path, mlp_bias=True, attention_bias=True)
    loaded = load_model(str(folder), dtype="fp32", device="cpu")
    net = lean_of(loaded)
    assert net.layers[0].gate_up.bias is not None and net.layers[0].down.bias is not None
    with torch.no_grad():
        ref = LlamaForCausalLM.from_pretrained(folder).eval()(IDS).logits
    assert torch.allclose(_logits(net, SIZES), ref, atol=1e-4, rtol=0)


def test_a_bias_the_config_gives_but_the_file_lacks_is_one_line(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _folder(tmp_path, mlp_bias=True)
    state = load_file(folder / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.bias"]
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ModelError, match=r"has no model\.layers\.1\.mlp\.up_proj\.bias .*mlp_bias True"
    ) as err:
        load_model(str(folder), dtype="fp32", device="cpu")
    assert "\n" not in str(err.value)


# ---- 3. an untied LM head ----
def test_an_untied_lm_head_missing_from_the_file_is_one_line(tmp_path):
    """Before, the lean path decoded with the embeddings as the LM head (transformers refuses the folder)."""
    from safetensors.torch import load_file, save_file

    folder = _folder(tmp_path, tie_word_embeddings=False)
    state = load_file(folder / "model.safetensors")
    del state["lm_head.weight"]
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ModelError, match=r"model\.safetensors has no lm_head\.weight .*tie_word_embeddings"
    ) as err:
        load_model(str(folder), dtype="fp32", device="cpu")
    assert "\n" not in str(err.value)
    conf = json.loads((folder / "config.json").read_text())
    with pytest.raises(ValueError, match="no lm_head.weight"):
        LeanLlama.from_state(conf, state, torch.float32, torch.device("cpu"))
    conf["tie_word_embeddings"] = True  # tied: the embeddings are the head
    net = LeanLlama.from_state(conf, state, torch.float32, torch.device("cpu"))
    assert torch.equal(net.lm_head.weight, state["model.embed_tokens.weight"])


# ---- 4. a saved lean model that is not the config's ----
def _set(key: str, fn):
    return lambda flat, meta: flat.update({key: fn(flat[key])})


TAMPER = {
    "inv_freq x2": _set("inv_freq", lambda t: t * 2),
    "inv_freq short": _set("inv_freq", lambda t: t[:4].contiguous()),
    "ln1 float64": _set("0.ln1", lambda t: t.double()),
    "ln2 wrong length": _set("1.ln2", lambda t: t[:8].contiguous()),
    "embed wrong width": _set("embed", lambda t: t[:, :32].contiguous()),
    "norm wrong length": _set("norm", lambda t: t[:1].contiguous()),
    "embed fp32": _set("embed", lambda t: t.float()),
    "scales fp32": _set("0.qkv.scales", lambda t: t.float()),
    "attention_scaling nan": lambda flat, meta: meta.update(attention_scaling="nan"),
    "attention_scaling x2": lambda flat, meta: meta.update(attention_scaling="2.0"),
    "weights int4": lambda flat, meta: meta.update(weights="int4"),
    "bias dropped": lambda flat, meta: flat.pop("0.gate_up.bias"),
    "formats dense": lambda flat, meta: (
        meta.update(formats=json.dumps(json.loads(meta["formats"]) | {"lm_head": ["dense", 96, 64]})),
        flat.update({"lm_head.weight": flat["embed"].clone()}),
    ),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A bf16 int8 model folder (with MLP biases) whose lean model was built and saved, and its logits."""
    from env.lean_files import saved_path

    folder = _folder(tmp_path_factory.mktemp("saved"), mlp_bias=True)
    loaded = load_model(str(folder), dtype="bf16", device="cpu", weights="int8")
    want = _logits(lean_of(loaded), SIZES)
    path = saved_path(loaded)
    assert path.is_file()
    return folder, path, want


@pytest.mark.parametrize("damage", list(TAMPER))
def test_a_saved_lean_model_not_of_the_configs_shapes_and_dtype_is_rebuilt(saved, damage):
    """Before, only the linear layers were checked: these raised at the first forward or changed the logits."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from env.lean_files import read_saved, tensors_digest

    folder, path, want = saved
    loaded = load_model(str(folder), dtype="bf16", device="cpu", weights="int8")
    conf = loaded.config.to_dict()
    assert read_saved(path, conf, loaded) is not None  # as saved: read back
    clean = path.read_bytes()
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    flat = load_file(str(path))
    TAMPER[damage](flat, meta)
    # with the digest of what it now holds: a file consistent in itself, yet not of this config (an older build)
    save_file(flat, str(path), metadata={**meta, "digest": tensors_digest(flat)})
    try:
        assert read_saved(path, conf, loaded) is None
        assert torch.equal(_logits(lean_of(loaded), SIZES), want)  # rebuilt from the weights
    finally:
        path.write_bytes(clean)


# ---- 5. the cached GGUF int4 blocks ----
def _at(t: torch.Tensor, row: int, value: float) -> torch.Tensor:
    t = t.clone()
    t[row, 1] = value
    return t


def test_a_cached_int4_block_file_not_of_the_models_weights_is_rebuilt(tmp_path, monkeypatch):
    """``cached_int4`` reads the embedded model's Q4_1 blocks back only when q is uint8, scale and zero fp32 of the
    model's shapes and they dequantize to its weights; else it reads the GGUF again (here: a stand-in)."""
    from safetensors.torch import load_file, save_file

    import env.lean_files as lf
    import env.model

    gen = torch.Generator().manual_seed(0)
    n, k, name = 32, 64, "model.layers.0.mlp.down_proj.weight"
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    s = torch.rand(n, k // GROUP, generator=gen) / 8
    z = torch.randn(n, k // GROUP, generator=gen) / 8
    dense = ((q.float() - 8).reshape(n, k // GROUP, GROUP) * s[..., None] + z[..., None]).reshape(n, k)
    reads = []
    monkeypatch.setattr(lf, "gguf_int4", lambda *a: reads.append(1) or {name: (q, s, z)})
    monkeypatch.setattr(env.model, "embedded_gguf_path", lambda: tmp_path / "x.gguf")

    class Loaded:
        model_id, folder = env.model.DEFAULT_MODEL, tmp_path

    def blocks():
        got = lf.cached_int4(Loaded(), {}, {name: dense})
        assert all(torch.equal(a, b) for a, b in zip(got[name], (q, s, z)))
        return len(reads)

    assert blocks() == 1 and blocks() == 1  # read from the GGUF, then from the cache
    path = tmp_path / lf.INT4_FILE
    good = load_file(path)
    damages = {
        "q int32 above 15": lambda t: t.update({name + ".q": t[name + ".q"].to(torch.int32) | 0x100}),
        "scale float64": lambda t: t.update({name + ".scale": t[name + ".scale"].double()}),
        "another model's": lambda t: t.update({name + ".zero": t[name + ".zero"] + 1}),
        # non-finite off the dequantized sample (every 8th row): found by the check of every scale and zero
        "a NaN scale on row 1": lambda t: t.update(
            {name + ".scale": _at(t[name + ".scale"], 1, float("nan"))}
        ),
        "an inf scale on row 3": lambda t: t.update(
            {name + ".scale": _at(t[name + ".scale"], 3, float("inf"))}
        ),
        "a -inf zero on row 5": lambda t: t.update(
            {name + ".zero": _at(t[name + ".zero"], 5, float("-inf"))}
        ),
    }
    for i, damage in enumerate(damages.values()):
        flat = dict(good)
        damage(flat)
        save_file(flat, path, metadata={"digest": lf.tensors_digest(flat)})  # consistent in itself, yet wrong
        assert blocks() == 2 + i  # ignored: read from the GGUF again (and cached afresh)
        assert load_file(path)[name + ".q"].dtype == torch.uint8
    # one code changed on a row the dequantization check does not sample: the file's digest finds it
    assert blocks() == 1 + len(damages)  # the last rebuilt cache, read back
    data = bytearray(path.read_bytes())
    q_row1 = bytes(load_file(path)[name + ".q"][1].numpy())
    at = bytes(data).index(q_row1)
    data[at] ^= 0x11
    path.write_bytes(bytes(data))
    assert blocks() == 2 + len(damages)


def test_a_saved_lean_model_damaged_anywhere_is_rebuilt(saved):
    """One flipped byte inside a weight (shapes and dtypes intact, which the checks of a saved model read) no
    longer matches the digest the file was written with: rebuilt from the weights, the same logits."""
    from env.lean_files import read_saved

    folder, path, want = saved
    loaded = load_model(str(folder), dtype="bf16", device="cpu", weights="int8")
    conf = loaded.config.to_dict()
    clean = path.read_bytes()
    data = bytearray(clean)
    data[len(data) - 1000] ^= 0x01  # in the last tensor's bytes
    path.write_bytes(bytes(data))
    try:
        assert read_saved(path, conf, loaded) is None
        assert torch.equal(_logits(lean_of(loaded), SIZES), want)
    finally:
        path.write_bytes(clean)


# ---- 6. a model folder that cannot be written ----
def test_a_model_folder_safetensors_cannot_write_to_is_no_error(tmp_path, monkeypatch):
    """safetensors reports a failed write (a read-only folder) as its own ``SafetensorError``, not an ``OSError``:
    before, that ended ``lean_of`` with a traceback. Now the lean model is built, and no file is left behind."""
    import safetensors.torch
    from safetensors import SafetensorError

    def failing_save(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")  # a write that started, then failed
        raise SafetensorError(
            f"Error while serializing: I/O error: Read-only file system (os error 30): {filename}"
        )

    folder = _folder(tmp_path)
    monkeypatch.setattr(safetensors.torch, "save_file", failing_save)
    loaded = load_model(str(folder), dtype="bf16", device="cpu", weights="int8")
    net = lean_of(loaded)
    assert net is not None and net.weights == "int8"
    assert not any((folder / "lean").iterdir())  # neither the saved model nor its temporary
