"""Wide products (a prefill chunk, a wide verify) of bf16 activations in fp32 (``kernels.quant.wide_in_fp32``): the
same weights, the same products up to the output's rounding, the setting read from ``DRAFTGYM_WIDE_MATMUL``, and
a bad setting reported in one line."""

from __future__ import annotations

import json

import pytest
import torch

from experiments.cli import main
from experiments.errors import is_user_error
from kernels import quant
from kernels.quant import GROUP, WIDE_ENV, WIDE_ROWS_DENSE, QLinear, QuantError, wide_in_fp32


@pytest.fixture
def setting(monkeypatch):
    """Set ``DRAFTGYM_WIDE_MATMUL`` for one test (the per-process decision is forgotten before and after)."""
    monkeypatch.setattr(quant, "_wide", {})

    def put(value: str) -> None:
        monkeypatch.setenv(WIDE_ENV, value)
        quant._wide.clear()

    return put


def _layer(fmt: str) -> tuple[QLinear, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    w, b = torch.randn(96, 128, generator=gen), torch.randn(96, generator=gen)
    return getattr(QLinear, fmt)(w, b, torch.bfloat16), torch.randn(WIDE_ROWS_DENSE + 5, 128, generator=gen)


@pytest.mark.parametrize(
    "n", [32, 128]
)  # read through the kernel; unpacked from its layout (64-channel blocks)
def test_the_int4_weight_in_fp32_is_the_kernels_weight_exactly(n):
    """(q - 8) * scale + zero with the layer's own (bf16) scales, not rounded to bf16: the narrow kernel's weight."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (n, 64), generator=gen, dtype=torch.int32)
    scale = torch.rand(n, 64 // GROUP, generator=gen) * 0.1
    zero = torch.randn(n, 64 // GROUP, generator=gen) * 0.1
    lin = QLinear.from_int4(q, scale, zero, None, torch.bfloat16)
    s = scale.to(torch.bfloat16).float().repeat_interleave(GROUP, dim=1)
    z = zero.to(torch.bfloat16).float().repeat_interleave(GROUP, dim=1)
    assert torch.equal(lin.weight_fp32(), (q.float() - 8) * s + z)
    assert lin.weight_fp32() is lin.weight_fp32()  # built once


@pytest.mark.parametrize("fmt", ["dense", "int8", "int4"])
def test_a_wide_product_in_fp32_equals_the_native_one_up_to_rounding(fmt, setting):
    lin, x = _layer(fmt)
    xb = x.to(torch.bfloat16)
    setting("native")
    native = lin(xb)
    setting("fp32")
    wide = lin(xb)
    assert wide.dtype == torch.bfloat16 and wide.shape == native.shape
    exact = xb.float() @ lin.weight_fp32().T + lin.bias.float()
    # both are the fp32 sum rounded to bf16 (the native kernels may add in another order, and the bias apart)
    for y in (native, wide):
        assert (y.float() - exact).abs().max() <= 0.02 * exact.abs().max()
    assert (wide.float() - exact).abs().max() <= exact.abs().max() * 2**-8  # one bf16 rounding
    # natively, a quantized layer's wide product is a GEMM of its weight rounded to bf16 once
    if fmt != "dense":
        w16 = lin.weight_native(torch.bfloat16)
        assert torch.equal(w16, lin.weight_fp32().to(torch.bfloat16))
        assert torch.equal(native, torch.nn.functional.linear(xb, w16, lin.bias))
    # a narrow product keeps the native kernel: the same sums up to the weight's rounding
    narrow = lin(xb[:3])
    assert (narrow.float() - native[:3].float()).abs().max() <= exact.abs().max() * 2**-7


def test_a_dense_layer_keeps_its_fp32_weight_within_the_budget(setting, monkeypatch):
    """From ``WIDE_ROWS`` rows a dense bf16 layer multiplies in fp32 with a copy kept once, while the copies fit
    ``DENSE_FP32_BUDGET``; a layer beyond the budget keeps its native product below ``WIDE_ROWS_DENSE`` rows
    (casting per product there); a freed layer gives its bytes back."""
    import gc

    import torch.nn.functional as F

    setting("fp32")
    size = 4 * 96 * 128
    monkeypatch.setattr(quant, "_dense_kept", [0])
    monkeypatch.setattr(quant, "DENSE_FP32_BUDGET", size)
    lin, x = _layer("dense")
    xb = x[: quant.WIDE_ROWS].to(torch.bfloat16)
    assert lin.keeps_fp32() and lin._w32 is None
    y = lin(xb)
    assert lin._w32 is not None and lin.weight_fp32() is lin._w32 and quant._dense_kept == [size]
    exact = xb.float() @ lin.weight.float().T + lin.bias.float()
    assert (y.float() - exact).abs().max() <= exact.abs().max() * 2**-8
    other, _ = _layer("dense")
    assert not other.keeps_fp32()  # over the budget
    assert torch.equal(other(xb), F.linear(xb, other.weight, other.bias))  # native below WIDE_ROWS_DENSE rows
    assert other._w32 is None and quant._dense_kept == [size]
    del lin
    gc.collect()
    assert quant._dense_kept == [0] and other.keeps_fp32()


def test_fp32_activations_never_take_the_wide_path(setting):
    setting("fp32")
    assert not wide_in_fp32(torch.float32)
    assert wide_in_fp32(torch.bfloat16)
    setting("native")
    assert not wide_in_fp32(torch.bfloat16)


def test_the_probe_decides_once_per_process(setting):
    setting("auto")
    first = wide_in_fp32(torch.bfloat16)
    assert isinstance(first, bool) and quant.wide_setting() == {"bfloat16": first}
    assert wide_in_fp32(torch.bfloat16) is first


def test_the_decision_is_kept_per_machine_and_a_bad_store_is_ignored(setting, tmp_path, monkeypatch):
    """The model loader's ``settle_wide``: probed once per machine and kept in the cache folder; a kept decision
    is followed; a damaged or foreign file is probed again and rewritten."""
    from env.machine import WIDE_FILE, settle_wide

    monkeypatch.setenv("DRAFTGYM_CACHE", str(tmp_path))
    store = tmp_path / WIDE_FILE
    setting("auto")
    first = settle_wide(torch.bfloat16)
    kept = json.loads(store.read_text())
    assert list(kept.values()) == [first] and "bfloat16" in next(iter(kept))
    assert wide_in_fp32(torch.bfloat16) is first
    store.write_text(json.dumps({k: not first for k in kept}))  # another process decided otherwise: followed
    quant._wide.clear()
    assert settle_wide(torch.bfloat16) is (not first) and wide_in_fp32(torch.bfloat16) is (not first)
    for bad in ("{{{ not json", '["a list"]', json.dumps({k: "yes" for k in kept})):
        store.write_text(bad)
        quant._wide.clear()
        assert isinstance(settle_wide(torch.bfloat16), bool)
        assert all(isinstance(v, bool) for v in json.loads(store.read_text()).values())
    setting("native")  # a setting decides: nothing read
    store.write_text(json.dumps({k: True for k in kept}))
    assert settle_wide(torch.bfloat16) is False


def test_a_bad_setting_is_a_user_error_in_one_line(setting, capsys):
    setting("fastest")
    with pytest.raises(QuantError, match="DRAFTGYM_WIDE_MATMUL=.fastest.") as err:
        wide_in_fp32(torch.bfloat16)
    assert is_user_error(err.value)
    code = main(["generate", "Hello.", "--max-new-tokens", "2", "--dtype", "bf16", "--drafter", "none"])
    line = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in line and "DRAFTGYM_WIDE_MATMUL" in line, line


@pytest.mark.parametrize("weights", ["dense", "int4"])
def test_a_wide_prefill_of_the_embedded_model_in_fp32_agrees_with_the_native_one(weights, setting):
    """The lean forward's prefill (linears and attention) with wide products in fp32 and natively, in bf16: the
    same next token and logits within bf16 noise (kernels.quant lives below env; this is its use there)."""
    from env.batch import BatchEngine
    from env.model import load_model

    loaded = load_model(None, dtype="bf16", weights=weights)
    prompt = torch.randint(
        100, 5000, (WIDE_ROWS_DENSE + 40,), generator=torch.Generator().manual_seed(2)
    ).tolist()
    logits = {}
    for how in ("native", "fp32"):
        setting(how)
        eng = BatchEngine(loaded, 1)
        pf = eng.target.begin_prefill(prompt)
        eng.target.prefill_chunk(pf)
        logits[how] = eng.target.head(pf.hidden[-1][-1:]).float()[0]
    assert quant.wide_setting() == {"bfloat16": True}
    a, b = logits["native"], logits["fp32"]
    assert int(a.argmax()) == int(b.argmax())
    assert (a - b).abs().max() < 0.05 * a.abs().max()
