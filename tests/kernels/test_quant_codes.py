"""Quantized codes chosen against the scales the kernels apply: every weight within half a step of its
dequantized value, in bf16 as in fp32 — for weights spread around 0 and for groups sitting far from 0 relative to
their spread (whose zero point bf16 cannot hold exactly)."""

import pytest
import torch

from kernels.quant import GROUP, QLinear

WEIGHTS = {
    "spread": lambda g: 0.02 * torch.randn(64, 128, generator=g),
    "offset": lambda g: 1.0 + 0.01 * torch.randn(64, 128, generator=g),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", list(WEIGHTS))
def test_int8_codes_within_half_a_step(kind, dtype):
    w = WEIGHTS[kind](torch.Generator().manual_seed(0))
    q = QLinear.int8(w, None, dtype)
    err = (w - q._exact_fp32()).abs()
    assert float((err / q.scales.float()[:, None]).max()) <= 0.5 + 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", list(WEIGHTS))
def test_int4_codes_within_half_a_step(kind, dtype):
    w = WEIGHTS[kind](torch.Generator().manual_seed(0))
    n, k = w.shape
    q = QLinear.int4(w, None, dtype)
    err = (w - q._exact_fp32()).reshape(n, k // GROUP, GROUP).abs()
    applied = q.scales.float()[..., 0].t()  # [N, K/32]: the scale the kernel applies
    assert float((err / applied[..., None]).max()) <= 0.5 + 1e-3
    # against an exact min/max grid: the step widens by at most the zero's rounding over 7 codes
    g = w.reshape(n, k // GROUP, GROUP)
    step = (g.amax(-1) - g.amin(-1)) / 15
    zero_rounding = q.scales.float()[..., 1].t().abs() * (2**-8 if dtype == torch.bfloat16 else 2**-23)
    bound = 0.5 * (step + zero_rounding / 7) * (1 + 2**-6)
    assert bool((err <= bound[..., None]).all())


def test_int4_needs_whole_groups_of_inputs_and_sixteen_outputs():
    from kernels.quant import int4_fits

    assert int4_fits(16, 64) and int4_fits(48, 32)
    assert not int4_fits(16, 48) and not int4_fits(8, 64) and not int4_fits(24, 64)
    q = torch.full((16, 48), 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="in_features divisible by 32"):
        QLinear.from_int4(q, torch.ones(16, 1), torch.zeros(16, 1), None, torch.float32)
    with pytest.raises(ValueError, match="cannot be read"):
        QLinear.from_tensors({}, "layer", "int4", 16, 48)
