"""Weight formats of a linear layer ``y = x W^T (+ b)``: dense (the activation dtype), int8 weight-only (one scale
per output channel, ``torch._weight_int8pack_mm``) and int4 weight-only (a scale and a zero per 32 input weights,
``torch._weight_int4pack_mm_for_cpu`` on the CPU; on CUDA the same weights are dequantized once and run dense).

int4 weights come either from quantizing a dense weight (min/max per group of 32) or straight from a GGUF file's
Q4_1 blocks (``q4_1_blocks``): Q4_1 stores, per 32 weights, ``d`` and ``m`` (fp16) and 4-bit ``q`` with
``w = d * q + m``; torch's layout is ``w = (q - 8) * scale + zero``, so ``scale = d`` and ``zero = m + 8 d`` — the
GGUF's own quantization, kept instead of requantizing a dequantized copy. Activations stay in the model's dtype
(bf16 or fp32); the scales follow it.
"""

from __future__ import annotations

import os
import weakref

import numpy as np
import torch
import torch.nn.functional as F

from kernels.packed import QuantError, Reordered
from kernels.timing import interleaved_ms

FORMATS = ("dense", "int8", "int4")
GROUP = 32  # int4 group size: one Q4_1 block

# ---- wide products (a prefill chunk, a wide verify): on a CPU without a fast bf16 GEMM (AVX-512 BF16 without AMX:
# see the README's "Wide products in fp32", `python -m env.bench_forward --wide-native`) a product of many rows runs
# faster in fp32. DRAFTGYM_WIDE_MATMUL=native|fp32 decides; else a probe (`probe_wide`), which the model loader
# keeps per machine (env.machine). Natively, a quantized layer's wide product is a GEMM of its weight in the
# activations' dtype too (kept once built), not the weight-only kernel.
WIDE_ENV = "DRAFTGYM_WIDE_MATMUL"
WIDE_ROWS = 128  # rows from which a product is wide (the layer's fp32 weight kept once built)
WIDE_ROWS_DENSE = 512  # a dense layer without a kept fp32 copy casts its weight per product: pays from here
# bytes of weight copies kept per process for wide products: dense layers' fp32 copies, quantized layers' bf16 ones
# (embedded model: 0.5 GB dense, 0.2 GB int4)
DENSE_FP32_BUDGET = 2 << 30
_dense_kept = [0]  # bytes of those copies alive now
WIDE_GAIN = 1.2  # fp32 must be this much faster in the probe to be used
_wide: dict[torch.dtype, bool] = {}


def wide_mode() -> str:
    """The ``DRAFTGYM_WIDE_MATMUL`` setting: auto (default), native or fp32; ``QuantError`` for anything else
    (a model load checks it up front)."""
    how = os.environ.get(WIDE_ENV, "auto").strip().lower() or "auto"
    if how not in ("auto", "native", "fp32"):
        raise QuantError(f"{WIDE_ENV}={how!r}: valid values are auto, native, fp32")
    return how


def probe_wide(dtype: torch.dtype) -> bool:
    """Whether a 256 x 1024 x 2048 product of ``dtype`` activations runs ``WIDE_GAIN`` times faster in fp32 (the
    activations' cast included) than natively, both timed in turn after warm-up calls: the GEMM's own speed."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2 * WIDE_ROWS, 1024, generator=gen).to(dtype)
    w = torch.randn(2048, 1024, generator=gen).to(dtype)
    w32 = w.float()
    native, fp32 = interleaved_ms(
        [lambda: F.linear(x, w), lambda: F.linear(x.float(), w32).to(dtype)], 7, warm=3
    )
    return native >= WIDE_GAIN * fp32


def decide_wide(dtype: torch.dtype, value: bool) -> None:
    """Set the decision for ``dtype`` (a kept one, read by the model loader)."""
    _wide[dtype] = bool(value)


def wide_decided(dtype: torch.dtype) -> bool | None:
    return _wide.get(dtype)


def wide_in_fp32(dtype: torch.dtype) -> bool:
    """Whether wide products of ``dtype`` activations run in fp32 on this CPU (never for fp32 itself): the
    ``DRAFTGYM_WIDE_MATMUL`` setting (``native``: never, ``fp32``: always), else the decision set by
    ``decide_wide``, else ``probe_wide`` once per process."""
    if dtype == torch.float32:
        return False
    if dtype not in _wide:
        how = wide_mode()
        _wide[dtype] = probe_wide(dtype) if how == "auto" else how == "fp32"
    return _wide[dtype]


def wide_setting() -> dict[str, bool]:
    """What the probe decided so far, per activation dtype (for a result's provenance)."""
    return {str(k).removeprefix("torch."): v for k, v in _wide.items()}


def int4_fits(out_features: int, in_features: int) -> bool:
    """The CPU int4 layout packs 16 output channels and 32 input weights at a time."""
    return out_features % 16 == 0 and in_features % GROUP == 0


def _in(dtype: torch.dtype, t: torch.Tensor) -> torch.Tensor:
    """``t`` (fp32) rounded to ``dtype`` and back: the value a kernel computing in ``dtype`` applies."""
    return t.to(dtype).float()


class QLinear:
    """One linear layer in one weight format; ``__call__(x)`` for x [..., K]. ``nbytes``: the weight bytes a forward
    reads (the cost models' bytes term)."""

    def __init__(self, fmt: str, out_features: int, in_features: int, bias: torch.Tensor | None, **parts):
        if fmt not in FORMATS:
            raise ValueError(f"unknown weight format {fmt!r}; valid: {', '.join(FORMATS)}")
        self.fmt, self.n, self.k, self.bias = fmt, out_features, in_features, bias
        self.weight: torch.Tensor | None = parts.get("weight")
        self.qweight: torch.Tensor | None = parts.get("qweight")
        self.scales: torch.Tensor | None = parts.get("scales")
        self._w32: torch.Tensor | None = None  # the fp32 weight of wide products, built once (see keeps_fp32)
        self._w16: torch.Tensor | None = None  # a quantized layer's weight in bf16 for native wide products
        self._pk = Reordered()  # a dense fp32 layer's weight reordered for oneDNN (kernels.packed)

    # ---- builders ----
    @staticmethod
    def dense(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> QLinear:
        n, k = weight.shape
        b = None if bias is None else bias.to(dtype)
        return QLinear("dense", n, k, b, weight=weight.to(dtype).contiguous())

    @staticmethod
    def int8(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> QLinear:
        """Symmetric per-output-channel int8 of a dense weight."""
        w = weight.float()
        # the codes are chosen against the scale the kernel applies: rounded to the activation dtype first
        scale = _in(dtype, (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12))
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        n, k = w.shape
        b = None if bias is None else bias.to(dtype)
        return QLinear("int8", n, k, b, qweight=q, scales=scale.to(dtype))

    @staticmethod
    def int4(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> QLinear:
        """Asymmetric int4 per group of 32 input weights (min/max) of a dense weight."""
        w = weight.float()
        n, k = w.shape
        g = w.reshape(n, k // GROUP, GROUP)
        lo, hi = g.amin(-1), g.amax(-1)
        # scale and zero as the kernel applies them (in the activation dtype), the codes chosen against those:
        # codes chosen against the fp32 ones were off by the zero's bf16 rounding, over a step for a group whose
        # values sit far from 0 relative to their spread; the scale is widened so that the codes 0..15 around the
        # rounded zero still span [lo, hi]
        zero = _in(dtype, lo + 8 * ((hi - lo) / 15.0))
        scale = torch.maximum((zero - lo) / 8.0, (hi - zero) / 7.0).clamp(min=1e-12)
        near = scale.to(dtype)  # the nearest in dtype, or the next one up where that is below
        scale = torch.where(
            near.float() < scale, torch.nextafter(near, torch.full_like(near, float("inf"))), near
        ).float()
        q = torch.round((g - zero[..., None]) / scale[..., None]) + 8
        return QLinear.from_int4(q.clamp(0, 15).to(torch.int32).reshape(n, k), scale, zero, bias, dtype)

    @staticmethod
    def from_int4(
        q: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> QLinear:
        """q int32 [N, K] in 0..15, scale and zero [N, K/32]: ``w = (q - 8) * scale + zero``."""
        n, k = q.shape
        if not int4_fits(n, k):
            raise ValueError(
                f"int4 needs in_features divisible by {GROUP} and out_features by 16, got {n}x{k}"
            )
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 2)
        sz = torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous()  # [K/32, N, 2]
        b = None if bias is None else bias.to(dtype)
        return QLinear("int4", n, k, b, qweight=packed, scales=sz)

    # ---- use ----
    def to(self, device: torch.device) -> QLinear:
        """On CUDA a quantized layer is dequantized (the CPU kernels' packing is CPU-only): its exact weight
        (``weight_fp32``'s values, read from the codes in O(N K), not through the kernel) in the activation dtype."""
        if device.type == "cpu":
            return self
        dtype = self.weight.dtype if self.fmt == "dense" else self.scales.dtype  # type: ignore[union-attr]
        w = (self.weight if self.fmt == "dense" else self._exact_fp32()).to(device, dtype)  # type: ignore[union-attr]
        b = None if self.bias is None else self.bias.to(device)
        return QLinear("dense", self.n, self.k, b, weight=w)

    def dequantized(self) -> torch.Tensor:
        """The weight [N, K] this layer multiplies by, in the activation dtype (for tests and CUDA)."""
        if self.fmt == "dense":
            return self.weight  # type: ignore[return-value]
        dtype = self.scales.dtype  # type: ignore[union-attr]
        eye = torch.eye(self.k, dtype=dtype)
        if self.fmt == "int8":
            return (self.qweight.to(dtype) * self.scales[:, None]).contiguous()  # type: ignore[union-attr,index]
        return (
            torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.qweight, GROUP, self.scales).t().contiguous()
        )

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """Its tensors by name (to save; ``from_tensors`` reads them back)."""
        parts = {"weight": self.weight, "qweight": self.qweight, "scales": self.scales, "bias": self.bias}
        return {f"{prefix}.{k}": v.contiguous() for k, v in parts.items() if v is not None}

    @staticmethod
    def from_tensors(flat: dict[str, torch.Tensor], prefix: str, fmt: str, n: int, k: int) -> QLinear:
        """Read back what ``tensors`` saved; every tensor's shape and dtype are checked against ``fmt``, ``n``, ``k``
        (a kernel given a packed weight of another size reads out of bounds): ``ValueError`` when they differ."""
        get = {name: flat.get(f"{prefix}.{name}") for name in ("weight", "qweight", "scales", "bias")}
        want: dict[str, tuple[tuple[int, ...], tuple[torch.dtype, ...]]] = {
            "dense": {"weight": ((n, k), (torch.float32, torch.bfloat16, torch.float16))},
            "int8": {"qweight": ((n, k), (torch.int8,)), "scales": ((n,), (torch.float32, torch.bfloat16))},
            "int4": {
                "qweight": ((n, k // 2), (torch.uint8,)),
                "scales": ((k // GROUP, n, 2), (torch.float32, torch.bfloat16)),
            },  # fmt: skip
        }.get(fmt)  # type: ignore[assignment]
        if want is None or (fmt == "int4" and not int4_fits(n, k)):
            raise ValueError(f"{prefix}: format {fmt} of {n}x{k} cannot be read")
        for name, (shape, dtypes) in want.items():
            t = get[name]
            if t is None or tuple(t.shape) != shape or t.dtype not in dtypes:
                raise ValueError(
                    f"{prefix}.{name}: expected {shape} {dtypes}, found {None if t is None else t.shape}"
                )
        bias = get.pop("bias")
        if bias is not None and tuple(bias.shape) != (n,):
            raise ValueError(f"{prefix}.bias: expected ({n},)")
        return QLinear(fmt, n, k, bias, **{key: v for key, v in get.items() if v is not None})

    @property
    def nbytes(self) -> int:
        parts = [self.weight, self.qweight, self.scales, self.bias]
        return sum(int(p.numel() * p.element_size()) for p in parts if p is not None)

    def weight_fp32(self) -> torch.Tensor:
        """The weight [N, K] in fp32, exactly as the kernels apply it (int4: ``(q - 8) * scale + zero`` with this
        layer's scales; int8: ``q * scale``); kept once built (wide products reuse it): always for quantized
        formats, for dense ones within ``DENSE_FP32_BUDGET`` (see ``keeps_fp32``)."""
        if self.fmt == "dense":
            if self.weight.dtype == torch.float32:  # type: ignore[union-attr]
                return self.weight  # type: ignore[return-value]
            if self._w32 is None and self.keeps_fp32():
                self._w32 = self.weight.float().contiguous()  # type: ignore[union-attr]
                size = self._w32.nbytes
                _dense_kept[0] += size
                weakref.finalize(self, _release_dense, size)
            return self.weight.float() if self._w32 is None else self._w32  # type: ignore[union-attr]
        if self._w32 is None:
            self._w32 = self._exact_fp32()
        return self._w32

    def weight_native(self, dtype: torch.dtype) -> torch.Tensor:
        """A quantized layer's weight in the activations' ``dtype`` (its exact fp32 weight rounded once), kept once
        built: a wide product of a CPU whose ``dtype`` GEMM is fast reads it instead of the weight-only kernel,
        which dequantizes its blocks again for every few rows (`python -m env.bench_forward --prefill`). Kept
        within ``DENSE_FP32_BUDGET`` with the dense layers' copies (see ``keeps_native``)."""
        if self._w16 is None or self._w16.dtype != dtype:
            self._w16 = (self._w32 if self._w32 is not None else self._exact_fp32()).to(dtype).contiguous()
            size = self._w16.nbytes
            _dense_kept[0] += size
            weakref.finalize(self, _release_dense, size)
        return self._w16

    def keeps_native(self, dtype: torch.dtype) -> bool:
        """Whether a quantized layer's wide product may read a kept copy in ``dtype``: built already, or the copies
        of all layers still fit ``DENSE_FP32_BUDGET`` with it (beyond it the weight-only kernel stays)."""
        if self._w16 is not None and self._w16.dtype == dtype:
            return True
        return _dense_kept[0] + dtype.itemsize * self.n * self.k <= DENSE_FP32_BUDGET

    def _exact_fp32(self) -> torch.Tensor:
        if self.fmt == "int8":
            return self.qweight.float() * self.scales.float()[:, None]  # type: ignore[union-attr]
        sz = self.scales.float()  # type: ignore[union-attr]  # [K/32, N, 2]
        scale = sz[..., 0].t().repeat_interleave(GROUP, dim=1)
        zero = sz[..., 1].t().repeat_interleave(GROUP, dim=1)
        return ((self._codes() - 8).float() * scale + zero).contiguous()

    def keeps_fp32(self) -> bool:
        """Whether wide products read a kept fp32 weight: always for quantized formats; for a dense one while the
        copies of all dense layers fit ``DENSE_FP32_BUDGET`` (beyond it, the weight is cast for each product)."""
        if self.fmt != "dense" or self._w32 is not None:
            return True
        return _dense_kept[0] + 4 * self.n * self.k <= DENSE_FP32_BUDGET

    def _through_kernel(self, cols: int) -> torch.Tensor:
        """``q - 8`` [N, cols] of the first ``cols`` inputs, read through the kernel with unit scales (small
        integers: exact in bf16)."""
        unit = torch.zeros_like(self.scales, dtype=torch.bfloat16)  # type: ignore[arg-type]
        unit[..., 0] = 1
        eye = torch.eye(cols, self.k, dtype=torch.bfloat16)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.qweight, GROUP, unit).t().float()

    def _codes(self) -> torch.Tensor:
        """The int4 codes q (0..15) [N, K]: unpacked from the CPU kernel's layout (blocks of 64 output channels,
        per input a byte of channel j and j + 32) when it is that layout, which the kernel itself confirms on the
        first 32 inputs; else all read through the kernel (slower: a K-row product)."""
        n, k = self.n, self.k
        if n % 64 == 0 and self.qweight.numel() == n * k // 2:  # type: ignore[union-attr]
            p = self.qweight.reshape(n // 64, k, 32)  # type: ignore[union-attr]
            q = torch.cat([p & 15, p >> 4], dim=2).permute(0, 2, 1).reshape(n, k).to(torch.int32)
            if torch.equal(q[:, :32].float() - 8, self._through_kernel(32)):
                return q
        return self._through_kernel(k).to(torch.int32) + 8

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.dtype != torch.float32 and x.numel() >= WIDE_ROWS * self.k and x.device.type == "cpu"
        if wide and not self.keeps_fp32():
            wide = x.numel() >= WIDE_ROWS_DENSE * self.k  # a dense layer beyond the budget casts per product
        if wide and wide_in_fp32(x.dtype):  # many rows: in fp32 where that runs faster (see wide_in_fp32)
            b = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight_fp32(), b).to(x.dtype)
        if self.fmt == "dense":
            return self._pk.product(x, self.weight, self.bias)  # type: ignore[arg-type]
        if wide and self.keeps_native(x.dtype):  # natively: a GEMM of the weight in x's dtype (weight_native)
            return F.linear(x, self.weight_native(x.dtype), self.bias)
        shape = x.shape
        x2 = x.reshape(-1, self.k)
        if self.fmt == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.qweight, GROUP, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.n)


def _release_dense(size: int) -> None:
    _dense_kept[0] -= size


def q4_1_blocks(raw: np.ndarray, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GGUF Q4_1 tensor's bytes (``[n, k/32 * 20]`` uint8: per block fp16 ``d``, fp16 ``m``, 16 bytes of nibbles,
    low nibbles weights 0..15 and high nibbles 16..31) as ``q`` int32 [n, k], ``scale`` and ``zero`` fp32
    [n, k/32] in torch's int4 convention (``w = (q - 8) * scale + zero``)."""
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // GROUP, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int32).reshape(n, k)
    scale = torch.from_numpy(d)
    return torch.from_numpy(q), scale, torch.from_numpy(m) + 8 * scale
