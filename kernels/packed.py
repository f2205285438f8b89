"""fp32 products on the CPU through oneDNN with the weight reordered once.

``F.linear`` runs an fp32 product on the CPU through MKL's sgemm, which on some CPUs is slow for a few rows: on a
2-core AMD EPYC with AVX2 only, the embedded model's 121 linear products took 39 ms for one row and 65-74 ms for two
to eight, where oneDNN's product with the weight reordered to its blocked layout once
(``torch.ops.mkldnn._reorder_linear_weight``, what inductor's freezing uses) took 22, 23, 29 and 35 ms for 1, 2, 4
and 8 rows (README: "An fp32 target on a CPU without native bf16").

``DRAFTGYM_FP32_MATMUL=packed|plain`` decides; else a probe (``probe_packed``), kept per machine by the model loader
(``env.machine.settle_packed``). ``Reordered`` holds one weight's reordered copy (a target layer's, ``kernels.quant``;
a drafter head's, ``ReorderedLinear``); only inference products use it — fp32, on the CPU, nothing for autograd to
record, not while torch.compile traces — and everything else is ``F.linear``.
"""

from __future__ import annotations

import contextlib
import os
import weakref

import torch
import torch.nn.functional as F

from kernels.timing import interleaved_ms

PACKED_ENV = "DRAFTGYM_FP32_MATMUL"
# bytes of reordered copies kept per process (embedded model: 0.5 GB), counted as the weights' own bytes (oneDNN's
# blocked layout may pad a little)
PACKED_BUDGET = 4 << 30
_packed_kept = [0]
PACKED_GAIN = 1.1  # the reordered product must be this much faster in the probe to be used
_packed: list[bool] = []  # the decision, once made


class QuantError(ValueError):
    """A weight-format or matmul setting that cannot be used (reported in one line)."""


def packed_mode() -> str:
    """The ``DRAFTGYM_FP32_MATMUL`` setting: auto (default), packed or plain; ``QuantError`` for anything else."""
    how = os.environ.get(PACKED_ENV, "auto").strip().lower() or "auto"
    if how not in ("auto", "packed", "plain"):
        raise QuantError(f"{PACKED_ENV}={how!r}: valid values are auto, packed, plain")
    return how


def packed_available() -> bool:
    """Whether this torch has oneDNN's reordered linear (CPU builds with mkldnn)."""
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_linear_pointwise")
        and hasattr(ops, "_reorder_linear_weight")
    )


def _product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def probe_packed() -> bool:
    """Whether fp32 products of 1, 2, 4 and 8 rows with a 32 MB weight (larger than a cache: read from memory, as
    a model's layers are) run ``PACKED_GAIN`` times faster through oneDNN with the weight reordered than through
    ``F.linear``, summed over the four, timed in turn after warm-up calls."""
    if not packed_available():
        return False
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(8192, 1024, generator=gen)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        xs = [torch.randn(m, 1024, generator=gen) for m in (1, 2, 4, 8)]
        plain = [lambda x=x: F.linear(x, w) for x in xs]
        ms = interleaved_ms(plain + [lambda x=x: _product(x, packed, None) for x in xs], 7, warm=2)
    except RuntimeError:  # a build whose oneDNN cannot run it here
        return False
    return sum(ms[:4]) >= PACKED_GAIN * sum(ms[4:])


def decide_packed(value: bool) -> None:
    """Set the decision (a kept one, read by the model loader)."""
    _packed[:] = [bool(value)]


def packed_decided() -> bool | None:
    """The decision made in this process, or None (also what a result's provenance records)."""
    return _packed[0] if _packed else None


def packed_fp32() -> bool:
    """Whether fp32 inference products on the CPU go through oneDNN with reordered weights: the
    ``DRAFTGYM_FP32_MATMUL`` setting (``plain``: never, ``packed``: where this torch has it), else the decision set
    by ``decide_packed``, else ``probe_packed`` once per process."""
    if not _packed:
        how = packed_mode()
        _packed[:] = [probe_packed() if how == "auto" else how == "packed" and packed_available()]
    return _packed[0]


class _Same:
    """A tensor's identity, held weakly: equal to another only while both name the same live tensor (a new
    weight allocated where a freed one was has the same address and version 0 again, but is not the same)."""

    __slots__ = ("ref",)

    def __init__(self, t: torch.Tensor) -> None:
        self.ref = weakref.ref(t)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and (t := self.ref()) is not None and t is other.ref()

    __hash__ = None  # type: ignore[assignment]


def _signature(w: torch.Tensor) -> tuple:
    """What a reordered copy must match: the weight itself (``_Same``), its storage, shape, dtype and its version —
    except for an inference tensor (made under ``torch.inference_mode``), which counts no versions: a change in
    place of one is not noticed (the heads' weights are never changed after loading)."""
    return (_Same(w), w.data_ptr(), tuple(w.shape), w.dtype, None if w.is_inference() else w._version)


def _release(size: int) -> None:
    _packed_kept[0] -= size


class Reordered:
    """One weight's oneDNN-reordered copy: ``product(x, w, bias)`` is ``F.linear(x, w, bias)``, through the copy for
    an fp32 CPU product without autograd where ``packed_fp32`` chose it. The copy is built on first use within
    ``PACKED_BUDGET`` (a weight beyond it stays with ``F.linear``) and rebuilt when the weight is not the one it
    was built from (another tensor, or changed in place)."""

    __slots__ = ("_pk", "_sig", "_bytes", "__weakref__")

    def __init__(self) -> None:
        self._pk: torch.Tensor | None = None
        self._sig: tuple | None = None
        self._bytes = 0

    def product(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if (
            x.dtype != torch.float32
            or w.dtype != torch.float32
            or x.device.type != "cpu"
            or w.device.type != "cpu"
            or w.dim() != 2
            or (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, w, bias)))
            or torch.compiler.is_compiling()
            or not packed_fp32()
        ):
            return F.linear(x, w, bias)
        sig = _signature(w)
        if self._sig != sig:
            if not self._bytes:
                if _packed_kept[0] + w.nbytes > PACKED_BUDGET:
                    return F.linear(x, w, bias)
                self._bytes = w.nbytes
                _packed_kept[0] += w.nbytes
                weakref.finalize(self, _release, w.nbytes)
            self._pk = torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), None)
            self._sig = sig
        return _product(x, self._pk, bias)  # type: ignore[arg-type]

    @property
    def built(self) -> bool:
        return self._pk is not None


_stacking = [True]


@contextlib.contextmanager
def stacking(enabled: bool):
    """Within the block, ``Stacked`` products run each layer on its own when not ``enabled`` (a benchmark's
    baseline: ``python -m env.bench_draft --separate``)."""
    before = _stacking[0]
    _stacking[0] = bool(enabled)
    try:
        yield
    finally:
        _stacking[0] = before


class Stacked:
    """Several linear layers that read the same input, as ONE product: ``stacked(x, *layers)`` returns each layer's
    output (views of one tensor), from their weights (and biases) stacked once and rebuilt when any of them is not
    the one it was built from (``_signature``), through a ``Reordered`` copy (fp32 on a CPU where ``packed_fp32``
    chose it; else ``F.linear``). A drafter head's q/k/v and gate/up: one product each instead of three and two.
    With autograd to record, or while torch.compile traces, each layer runs on its own. Holds no layer (the caller
    passes them each time); a deep copy starts empty."""

    __slots__ = ("_w", "_b", "_sig", "_sizes", "_pk")

    def __init__(self) -> None:
        self._w: torch.Tensor | None = None
        self._b: torch.Tensor | None = None
        self._sig: tuple | None = None
        self._sizes: list[int] = []
        self._pk = Reordered()

    def __deepcopy__(self, memo: dict) -> Stacked:
        return Stacked()

    def __call__(self, x: torch.Tensor, *layers: torch.nn.Linear) -> tuple[torch.Tensor, ...]:
        params = [t for lin in layers for t in (lin.weight, lin.bias) if t is not None]
        if (torch.is_grad_enabled() and (x.requires_grad or any(t.requires_grad for t in params))) or (
            torch.compiler.is_compiling() or not _stacking[0]
        ):
            return tuple(lin(x) for lin in layers)
        sig = tuple(None if t is None else _signature(t) for lin in layers for t in (lin.weight, lin.bias))
        if sig != self._sig:
            self._w = torch.cat([lin.weight.detach() for lin in layers])
            biases = [lin.bias for lin in layers]
            self._b = (
                None
                if all(b is None for b in biases)
                else torch.cat(
                    [
                        lin.weight.new_zeros(lin.weight.shape[0]) if b is None else b.detach()
                        for lin, b in zip(layers, biases)
                    ]
                )
            )
            self._sizes = [lin.weight.shape[0] for lin in layers]
            self._sig = sig
        return self._pk.product(x, self._w, self._b).split(self._sizes, dim=-1)  # type: ignore[arg-type]


class ReorderedLinear(torch.nn.Linear):
    """``nn.Linear`` whose inference products go through its ``Reordered`` copy (fp32 on a CPU); the same parameters
    and state dict. Training (autograd) runs ``F.linear`` as before."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._pk = Reordered()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._pk.product(x, self.weight, self.bias)


def reorder_linears(module: torch.nn.Module) -> torch.nn.Module:
    """Every plain ``nn.Linear`` inside ``module`` replaced by a ``ReorderedLinear`` sharing its parameters (a
    drafter's head, loaded for inference); returns ``module``."""
    for name, child in list(module.named_children()):
        if type(child) is torch.nn.Linear:
            new = ReorderedLinear(
                child.in_features, child.out_features, bias=child.bias is not None, device="meta"
            )
            new.weight, new.bias = child.weight, child.bias
            new.train(child.training)
            setattr(module, name, new)
        else:
            reorder_linears(child)
    return module
