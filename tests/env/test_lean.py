"""The lean forward (env.lean) and its weight formats (kernels.quant): the same logits as the transformers model in
fp32, the GGUF's Q4_1 blocks read exactly, and a quantized target's speculative output equal to its own
autoregressive output."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from env.batch import BatchEngine
from env.decoder import SpeculativeDecoder, chat_prompt
from env.engine import parse_arm
from env.lean import lean_of
from env.lean_files import gguf_int4
from env.model import embedded_gguf_path, load_model
from env.ragged_cache import RaggedCache, Write
from kernels.quant import GROUP, QLinear, q4_1_blocks
from tests.hf_reference import hf_greedy


def _lean_logits(loaded, ids: torch.Tensor) -> torch.Tensor:
    net = lean_of(loaded)
    c = loaded.config
    cache = RaggedCache(c.num_hidden_layers, 1, c.num_key_value_heads, c.head_dim, loaded.dtype, "cpu")
    q = ids.shape[1]
    write = Write(torch.zeros(1, q, dtype=torch.long), torch.arange(q)[None], 0, 1, q, 0)
    return net.head(net.forward(ids, torch.arange(q)[None], cache, write, None)[0])


def test_lean_logits_equal_the_transformers_model_in_fp32(fp32_model):
    ids = torch.tensor(
        [fp32_model.tokenizer("The quick brown fox jumps over the lazy dog. Once upon")["input_ids"]]
    )
    with torch.no_grad():
        ref = fp32_model.model(ids).logits
    got = _lean_logits(fp32_model, ids)
    # with oneDNN's reordered products (kernels.packed, where this machine chose them) the fp32 sums run in
    # another order than the transformers model's F.linear (logits reach ~20): 1.1e-4 seen
    from kernels.packed import packed_decided

    tol = 5e-4 if packed_decided() else 1e-4
    assert torch.allclose(got, ref, atol=tol, rtol=0), (got - ref).abs().max()
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_the_transformers_forward_still_decodes_exactly():
    loaded = load_model(dtype="fp32", device="cpu", forward="hf")
    assert BatchEngine(loaded, 1).target.net is None
    prompt = chat_prompt(loaded.tokenizer, "Summarize: the cat sat on the mat. The cat sat on the mat again.")
    got = SpeculativeDecoder(loaded, [parse_arm("ngram-d4")]).generate(prompt, max_new_tokens=24).token_ids
    assert got == hf_greedy(loaded, prompt, 24)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_linear_multiplies_by_its_dequantized_weight(fmt):
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 128, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(5, 128, generator=gen)
    lin = getattr(QLinear, fmt)(w, b, torch.float32)
    deq = lin.dequantized()
    assert torch.allclose(lin(x), x @ deq.T + b, atol=1e-3)
    assert (deq - w).abs().max() < (0.02 if fmt == "int8" else 0.3)  # it quantized w, not something else
    assert lin.nbytes < w.numel() * 4 / (3.5 if fmt == "int8" else 4.5)


def test_q4_1_blocks_read_as_d_times_q_plus_m():
    rng = np.random.default_rng(0)
    n, k = 16, 64
    d = rng.uniform(0.01, 0.1, (n, k // GROUP)).astype(np.float16)
    m = rng.uniform(-1, 0, (n, k // GROUP)).astype(np.float16)
    q = rng.integers(0, 16, (n, k // GROUP, GROUP))
    raw = np.zeros((n, k // GROUP, 20), dtype=np.uint8)
    raw[..., 0:2] = d[..., None].view(np.uint8)
    raw[..., 2:4] = m[..., None].view(np.uint8)
    raw[..., 4:] = (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)
    qq, scale, zero = q4_1_blocks(raw.reshape(n, -1), n, k)
    want = d.astype(np.float32)[..., None] * q + m.astype(np.float32)[..., None]
    got = ((qq.float() - 8).reshape(n, k // GROUP, GROUP) * scale[..., None] + zero[..., None]).numpy()
    assert np.allclose(got, want, atol=1e-6)
    lin = QLinear.from_int4(qq, scale, zero, None, torch.float32)
    assert torch.allclose(lin.dequantized(), torch.from_numpy(want).float().reshape(n, k), atol=1e-5)


def test_the_ggufs_int4_blocks_are_the_models_weights(fp32_model):
    """Every Q4_1 tensor of the embedded GGUF (q and k un-permuted) dequantizes to the model's own weight."""
    state = fp32_model.state if fp32_model.state is not None else fp32_model.model.state_dict()
    blocks = gguf_int4(embedded_gguf_path(), fp32_model.config.to_dict(), state)
    assert len(blocks) == 7 * fp32_model.config.num_hidden_layers


@pytest.mark.parametrize(("fmt", "arm"), [("int8", "ngram-d4"), ("int4", "recycling-d3-k2-b6")])
def test_a_quantized_target_speculates_its_own_greedy_output(fp32_model, fmt, arm):
    """fp32 activations: the contract of exactness (a quantized target is its own model). The CPU's int4/int8
    kernels are slow in fp32, so a sample: one arm each, 12 tokens (``python -m env.exactness --weights`` runs
    the workload)."""
    loaded = fp32_model.replace(weights=fmt)
    prompt = chat_prompt(loaded.tokenizer, "Repeat: one two three four, one two three four, one two three")
    ar = SpeculativeDecoder(loaded, [parse_arm("none")]).generate(prompt, max_new_tokens=12).token_ids
    got = SpeculativeDecoder(loaded, [parse_arm(arm)]).generate(prompt, max_new_tokens=12).token_ids
    assert got == ar
    assert BatchEngine(loaded, 1).target.net.weights == fmt  # it really ran quantized
    dense = SpeculativeDecoder(fp32_model, [parse_arm("none")]).generate(prompt, max_new_tokens=12).token_ids
    assert ar[:3] == dense[:3]  # the same model, quantized: it agrees with the dense one at first


def test_a_damaged_or_hostile_saved_lean_model_is_rebuilt(tmp_path):
    """The lean model saved beside the weights is read back only when every tensor fits: garbage, or a packed
    quantized weight of another size (which a kernel would read out of bounds), is rebuilt from the weights."""
    import shutil

    from safetensors.torch import load_file, save_file

    from env.lean_files import saved_path
    from env.model import embedded_model_folder

    src = embedded_model_folder()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, tmp_path / name)
    (tmp_path / "model.safetensors").symlink_to(src / "model.safetensors")
    ids = torch.tensor([[1, 504, 6147, 282, 260, 3426]])

    def logits():
        loaded = load_model(str(tmp_path), dtype="bf16", device="cpu", weights="int8")
        return loaded, _lean_logits(loaded, ids)

    loaded, want = logits()
    saved = saved_path(loaded)
    assert saved.is_file()  # built and saved on first use
    flat = load_file(str(saved))
    from safetensors import safe_open

    with safe_open(str(saved), framework="pt") as f:
        meta = f.metadata()
    flat["0.qkv.qweight"] = flat["0.qkv.qweight"][:16].contiguous()  # a weight of another size
    save_file(flat, str(saved), metadata=meta)
    assert torch.equal(logits()[1], want)
    saved.write_bytes(b"\x00" * 64)  # garbage
    assert torch.equal(logits()[1], want)
    assert load_file(str(saved))["0.qkv.qweight"].shape[0] > 16  # written again, whole


@pytest.mark.parametrize("rows, masked", [(1, False), (3, True)])
def test_a_decoding_steps_attention_is_sdpas_in_fp32(rows, masked):
    """``env.lean._attend_one`` (one new token per row, bf16 models): the query heads of a KV head grouped as
    transformers' GQA groups them, masked positions left out; equal to torch's attention computed in fp32."""
    from env.lean import _attend_one

    gen = torch.Generator().manual_seed(rows)
    heads, kv, span, d = 9, 3, 37, 64
    q = torch.randn(rows, heads, 1, d, generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(rows, kv, span, d, generator=gen).to(torch.bfloat16) for _ in range(2))
    mask = None
    if masked:  # ragged rows: row i reads its first span - 5 * i positions
        mask = (torch.arange(span)[None, :] < span - 5 * torch.arange(rows)[:, None])[:, None, None]
    got = _attend_one(q, k, v, mask, d**-0.5)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask, scale=d**-0.5, enable_gqa=True
    )
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    assert (got.float() - ref).abs().max() <= 2**-8 * ref.abs().max()  # the same values, rounded once to bf16
    if masked:  # a masked key changes nothing: the last row does not see its last 10 positions
        k2 = k.clone()
        k2[-1, :, -10:] = 100.0
        assert torch.equal(_attend_one(q, k2, v, mask, d**-0.5)[-1], got[-1])


def test_auto_weights_are_int4_only_for_bf16_activations_on_a_cpu():
    """The CPU's int4 kernel is fast with bf16 activations and slow with fp32 ones; CUDA runs dense."""
    from env.model import ModelError, resolve_weights

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_weights("auto", cpu, torch.bfloat16) == "int4"
    assert resolve_weights("auto", cpu, torch.float32) == "dense"
    assert resolve_weights("auto", cuda, torch.bfloat16) == "dense"
    assert resolve_weights("int4", cpu, torch.float32) == "int4"  # asked for: kept
    assert resolve_weights("fp32", cpu, torch.float32) == "dense"
    with pytest.raises(ModelError, match="unknown weight format"):
        resolve_weights("int3", cpu)
