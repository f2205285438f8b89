"""fp32 products through oneDNN with the weight reordered once (``kernels.packed``): the same products as
``F.linear`` up to the order of the sums, the reordered weight built once per layer within its budget, the setting
read from ``DRAFTGYM_FP32_MATMUL`` and kept per machine, a bad setting reported in one line, and the embedded
model's greedy decoding the same either way."""

from __future__ import annotations

import gc
import json

import pytest
import torch
import torch.nn.functional as F

from experiments.cli import main
from experiments.errors import is_user_error
from kernels import packed
from kernels.packed import (
    PACKED_ENV,
    QuantError,
    Reordered,
    ReorderedLinear,
    Stacked,
    packed_available,
    packed_fp32,
)
from kernels.quant import QLinear

needs_onednn = pytest.mark.skipif(not packed_available(), reason="this torch has no oneDNN reordered linear")


@pytest.fixture
def setting(monkeypatch):
    """Set ``DRAFTGYM_FP32_MATMUL`` for one test (the per-process decision is forgotten before and after; layers
    of earlier tests collected first, so that only this test's layers give bytes back to ``_packed_kept``)."""
    gc.collect()
    monkeypatch.setattr(packed, "_packed", [])

    def put(value: str) -> None:
        monkeypatch.setenv(PACKED_ENV, value)
        packed._packed.clear()

    return put


def _layer(bias: bool = True) -> QLinear:
    gen = torch.Generator().manual_seed(5)
    w, b = torch.randn(96, 128, generator=gen), torch.randn(96, generator=gen)
    return QLinear.dense(w, b if bias else None, torch.float32)


@needs_onednn
@pytest.mark.parametrize("shape", [(1, 128), (7, 128), (3, 5, 128), (300, 128)])
@pytest.mark.parametrize("bias", [True, False])
def test_a_reordered_product_equals_f_linear_up_to_the_order_of_sums(shape, bias, setting):
    lin = _layer(bias)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(6))
    setting("plain")
    plain = lin(x)
    assert not lin._pk.built
    setting("packed")
    packed = lin(x)
    assert lin._pk.built  # built on the first product
    assert packed.shape == plain.shape == (*shape[:-1], 96) and packed.dtype == torch.float32
    assert torch.allclose(packed, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-4)
    assert torch.allclose(packed, plain, rtol=1e-5, atol=1e-4)
    assert not torch.equal(lin.weight, torch.zeros_like(lin.weight))  # the plain weight stays (nbytes, tests)
    # a non-contiguous input (a slice of the nodes) reads the same
    if len(shape) == 3:
        assert torch.allclose(lin(x[:, 1:3]), F.linear(x[:, 1:3], lin.weight, lin.bias), rtol=1e-5, atol=1e-4)


@needs_onednn
def test_the_reordered_weight_is_built_once_within_the_budget(setting, monkeypatch):
    setting("packed")
    monkeypatch.setattr(packed, "_packed_kept", [0])
    lin = _layer()
    x = torch.randn(2, 128)
    lin(x)
    first = lin._pk._pk
    lin(x)
    assert lin._pk._pk is first and packed._packed_kept == [lin.weight.nbytes]  # built once
    monkeypatch.setattr(packed, "PACKED_BUDGET", lin.weight.nbytes + 10)
    other = _layer()
    assert torch.allclose(other(x), F.linear(x, other.weight, other.bias), rtol=1e-5, atol=1e-4)
    assert not other._pk.built  # beyond the budget: F.linear
    del lin
    gc.collect()
    assert packed._packed_kept == [0]
    # bf16 layers and activations never take it
    b16 = QLinear.dense(torch.randn(16, 32), None, torch.bfloat16)
    b16(torch.randn(2, 32, dtype=torch.bfloat16))
    assert not b16._pk.built


def test_the_setting_decides_and_plain_never_reorders(setting):
    setting("plain")
    assert packed_fp32() is False and packed.packed_decided() is False
    lin = _layer()
    lin(torch.randn(3, 128))
    assert not lin._pk.built
    setting("packed")
    assert packed_fp32() is packed_available()


@pytest.mark.parametrize("verdict", [True, False])
def test_the_probe_decides_once_per_process(setting, monkeypatch, verdict):
    calls = []
    monkeypatch.setattr(packed, "probe_packed", lambda: calls.append(1) or verdict)
    setting("auto")
    assert packed_fp32() is verdict and packed_fp32() is verdict and packed.packed_decided() is verdict
    assert calls == [1]
    lin = _layer()
    x = torch.randn(4, 128)
    lin(x)
    assert lin._pk.built is (verdict and packed_available())


@needs_onednn
def test_the_real_probe_runs_and_decides():
    assert isinstance(packed.probe_packed(), bool)


@needs_onednn
@pytest.mark.parametrize(
    ("plain_ms", "packed_ms", "verdict"), [(2.0, 1.0, True), (1.0, 2.0, False), (1.05, 1.0, False)]
)
def test_the_probe_chooses_the_reordered_product_only_when_it_is_enough_faster(
    monkeypatch, plain_ms, packed_ms, verdict
):
    """``interleaved_ms`` times the four plain products, then the four reordered ones: reordered is chosen when
    the plain ones take ``PACKED_GAIN`` times as long (timings given here: no clock in a test)."""
    try:  # the probe still reorders a real weight first
        torch.ops.mkldnn._reorder_linear_weight(torch.randn(8, 8), None)
    except RuntimeError:
        pytest.skip("this build's oneDNN cannot reorder a weight on this CPU")
    monkeypatch.setattr(packed, "interleaved_ms", lambda fns, *a, **k: [plain_ms] * 4 + [packed_ms] * 4)
    assert packed.probe_packed() is verdict


def test_the_decision_is_kept_per_machine_and_a_bad_store_is_ignored(setting, tmp_path, monkeypatch):
    """The model loader's ``settle_packed``: probed once per machine and kept beside the wide-product decision;
    a kept decision is followed; a damaged file is probed again and rewritten; a setting decides alone."""
    from env.machine import WIDE_FILE, settle_packed

    monkeypatch.setenv("DRAFTGYM_CACHE", str(tmp_path))
    store = tmp_path / WIDE_FILE
    setting("auto")
    first = settle_packed()
    kept = json.loads(store.read_text())
    assert list(kept.values()) == [first] and next(iter(kept)).endswith("fp32 reordered products")
    store.write_text(json.dumps({k: not first for k in kept}))  # another process decided otherwise: followed
    packed._packed.clear()
    assert settle_packed() is (not first) and packed_fp32() is (not first)
    store.write_text("{{{ not json")
    packed._packed.clear()
    again = settle_packed()
    assert json.loads(store.read_text()) == {next(iter(kept)): again}  # probed again and rewritten
    setting("plain")
    store.write_text(json.dumps({k: True for k in kept}))
    assert settle_packed() is False


def test_a_bad_setting_is_a_user_error_in_one_line(setting, capsys):
    setting("fastest")
    with pytest.raises(QuantError, match="DRAFTGYM_FP32_MATMUL=.fastest.") as err:
        packed_fp32()
    assert is_user_error(err.value)
    code = main(["generate", "Hello.", "--max-new-tokens", "2", "--dtype", "fp32", "--drafter", "none"])
    line = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in line and "DRAFTGYM_FP32_MATMUL" in line, line


@needs_onednn
@pytest.mark.model
def test_the_embedded_model_decodes_the_same_greedy_tokens_either_way(setting):
    """fp32, the lean forward: the speculative engine with reordered weights commits the tokens that plain
    ``F.linear`` autoregressive decoding commits, and its logits agree to fp32 noise (kernels.quant lives below
    env; this is its use there)."""
    from env.arms import parse_arm
    from env.batch import BatchEngine
    from env.decoder import SpeculativeDecoder
    from env.model import load_model

    loaded = load_model(None, dtype="fp32", weights="dense")
    prompt = "Write a short poem about the sea and the sky, then explain it."
    out, logits = {}, {}
    for how, arm in (("plain", "none"), ("packed", "ngram-d4"), ("packed", "none")):
        setting(how)
        dec = SpeculativeDecoder(loaded, [parse_arm(arm)])
        out[how, arm] = dec.generate(prompt, max_new_tokens=32).token_ids
        eng = BatchEngine(loaded, 1)
        pf = eng.target.begin_prefill(dec.generate(prompt, max_new_tokens=1).prompt_ids)
        eng.target.prefill_chunk(pf)
        logits[how] = eng.target.head(pf.hidden[-1][-1:]).float()[0]
    assert out["plain", "none"] == out["packed", "ngram-d4"] == out["packed", "none"]
    a, b = logits["plain"], logits["packed"]
    assert int(a.argmax()) == int(b.argmax()) and (a - b).abs().max() < 1e-3 * a.abs().max()


@needs_onednn
def test_a_reordered_copy_follows_its_weight_and_leaves_autograd_alone(setting, monkeypatch):
    """``Reordered`` (a drafter head's layers, its draft projection): the copy is rebuilt when the weight changes in
    place, when it is another tensor (``.data`` swapped, as ``Module.to`` does), and inside inference mode (whose
    tensors count no versions: there only by storage, shape and dtype); it gives its bytes back when dropped; a product that autograd records is
    ``F.linear`` with its gradients, the bias's included."""
    setting("packed")
    monkeypatch.setattr(packed, "_packed_kept", [0])
    gen = torch.Generator().manual_seed(8)
    w, b, x = (
        torch.randn(40, 24, generator=gen),
        torch.randn(40, generator=gen),
        torch.randn(6, 24, generator=gen),
    )
    pk = Reordered()
    assert torch.allclose(pk.product(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert pk.built and packed._packed_kept == [w.nbytes]
    w.mul_(2)  # changed in place: the next product reads the new weight
    assert torch.allclose(pk.product(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    w2 = torch.randn(40, 24, generator=gen)
    w.data = w2  # another storage behind the same tensor object, version unchanged
    assert torch.allclose(pk.product(x, w, b), F.linear(x, w2, b), rtol=1e-5, atol=1e-5)
    assert packed._packed_kept == [w.nbytes]  # one copy's bytes, however often rebuilt
    with torch.inference_mode():
        wi = torch.randn(40, 24, generator=gen)
        pi = Reordered()
        assert torch.allclose(pi.product(x, wi, b), F.linear(x, wi, b), rtol=1e-5, atol=1e-5)
        assert pi.built
        wn = torch.randn(40, 24, generator=gen)  # another weight: noticed by its storage
        assert torch.allclose(pi.product(x, wn, b), F.linear(x, wn, b), rtol=1e-5, atol=1e-5)
    del pk, pi
    gc.collect()
    assert packed._packed_kept == [0]
    wg = torch.randn(40, 24, generator=gen, requires_grad=True)
    bg = torch.randn(40, generator=gen, requires_grad=True)
    pg = Reordered()
    pg.product(x, wg.detach(), bg).sum().backward()  # a trainable bias alone: autograd's product
    assert torch.equal(bg.grad, torch.full((40,), 6.0)) and not pg.built
    pg.product(x, wg, b).sum().backward()
    assert torch.allclose(wg.grad, x.sum(0).expand(40, 24)) and not pg.built
    with torch.no_grad():
        pg.product(x, wg, b)
    assert pg.built  # inference of a trainable weight: reordered


@needs_onednn
@pytest.mark.model
def test_a_drafter_head_loaded_in_inference_mode_proposes_as_under_no_grad(setting):
    """The serving paths run under ``torch.inference_mode``, where a lazily loaded head's weights are inference
    tensors: its reordered products work there and propose the same tree as outside it."""
    from drafters import TreeShape, make_drafter
    from env.batch import BatchEngine
    from env.model import load_model

    setting("packed")
    loaded = load_model(None, dtype="fp32", weights="dense")
    prompt = torch.randint(100, 1000, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    shape = TreeShape(depth=3, topk=2, budget=6)
    trees = []
    for ctx in (torch.inference_mode, torch.no_grad):
        with ctx():
            d = make_drafter("eagle3")
            eng = BatchEngine(loaded, 1)
            eng.admit(prompt, {"eagle3": d})
            row = eng.target.rows[0]
            (tree,) = d.propose_batch([(d, row.ctx, shape)])
            layer = d.head.layer
            assert isinstance(layer.o, ReorderedLinear) and layer.o._pk.built
            assert (
                layer.qkv_stack._pk.built and layer.gate_up_stack._pk.built
            )  # q/k/v, gate/up: one product each
            trees.append((tree.tokens.tolist(), tree.parents.tolist()))
    assert trees[0] == trees[1]


def test_reorder_linears_keeps_the_parameters_and_the_state_dict(setting):
    setting("plain")
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Sequential(torch.nn.Linear(16, 4))
    )
    before = {k: v.clone() for k, v in net.state_dict().items()}
    weights = [net[0].weight, net[2][0].weight]
    x = torch.randn(3, 8)
    want = net(x)
    packed.reorder_linears(net)
    assert isinstance(net[0], ReorderedLinear) and isinstance(net[2][0], ReorderedLinear)
    assert net[0].weight is weights[0] and net[2][0].weight is weights[1]
    assert list(net.state_dict()) == list(before)
    assert all(torch.equal(net.state_dict()[k], v) for k, v in before.items())
    setting("packed")
    with torch.no_grad():
        assert torch.allclose(net(x), want, rtol=1e-5, atol=1e-5)
    assert net[0]._pk.built is packed_available()
    # a replaced layer keeps its module's mode
    frozen = torch.nn.Sequential(torch.nn.Linear(4, 2)).eval()
    packed.reorder_linears(frozen)
    assert isinstance(frozen[0], ReorderedLinear) and not frozen[0].training


@pytest.mark.parametrize("how", ["packed", "plain"])
def test_stacked_layers_give_each_layers_product_and_follow_their_weights(setting, how):
    """``Stacked``: one product for several layers that read one input equals each layer's own (up to sum order);
    the stacked weight is rebuilt when a layer's weight changes in place or is swapped; with autograd to record
    every layer runs on its own (gradients reach each weight); a deep copy starts empty."""
    import copy

    setting(how)
    torch.manual_seed(0)
    q, k = torch.nn.Linear(24, 16, bias=False), torch.nn.Linear(24, 8, bias=True)
    x = torch.randn(2, 5, 24)
    st = Stacked()
    with torch.no_grad():
        a, b = st(x, q, k)
        assert a.shape == (2, 5, 16) and b.shape == (2, 5, 8)
        assert torch.allclose(a, q(x), atol=1e-5) and torch.allclose(b, k(x), atol=1e-5)
        built = st._w
        st(x, q, k)
        assert st._w is built  # nothing changed: not rebuilt
        k.weight.mul_(2.0)  # in place
        assert torch.allclose(st(x, q, k)[1], k(x), atol=1e-5)
        q.weight = torch.nn.Parameter(torch.randn(16, 24))  # swapped
        assert torch.allclose(st(x, q, k)[0], q(x), atol=1e-5)
    a, b = st(x, q, k)  # autograd: each layer on its own
    (a.sum() + b.sum()).backward()
    assert q.weight.grad is not None and k.weight.grad is not None and k.bias.grad is not None
    assert copy.deepcopy(st)._w is None
    from kernels.packed import stacking

    with torch.no_grad(), stacking(False):  # a benchmark's baseline: each layer on its own, exactly
        a, b = Stacked()(x, q, k)
        assert torch.equal(a, q(x)) and torch.equal(b, k(x))


@needs_onednn
def test_a_new_weight_at_a_freed_weights_address_is_not_taken_for_it(setting):
    """A layer's weight replaced twice between products: the allocator often puts the newest where the first was
    freed, at version 0 again — the copy follows the tensor itself, not only its address and version."""
    setting("packed")
    gen = torch.Generator().manual_seed(3)
    lin, x = ReorderedLinear(64, 64, bias=False), torch.randn(2, 64, generator=gen)
    reused = 0
    with torch.no_grad():
        lin(x)
        for _ in range(8):
            before = lin.weight.data_ptr()
            lin.weight = torch.nn.Parameter(torch.randn(64, 64, generator=gen))
            lin.weight = torch.nn.Parameter(torch.randn(64, 64, generator=gen))
            reused += lin.weight.data_ptr() == before
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight), rtol=1e-5, atol=1e-5)
    if not reused:
        pytest.skip("the allocator put no new weight at a freed one's address")
