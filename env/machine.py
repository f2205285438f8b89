"""Facts about the machine a figure is measured on, and the matmul decisions made once per machine: the draftgym
cache folder, the CPU's label and native bf16, and the probes' kept decisions (``kernels.quant``'s wide products,
``kernels.packed``'s reordered fp32 products), read and written in ``cache_dir()/wide_products.json``.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from env import allocator


def cache_dir() -> Path:
    """Where converted models live: $DRAFTGYM_CACHE, else $XDG_CACHE_HOME/draftgym, else ~/.cache/draftgym."""
    if os.environ.get("DRAFTGYM_CACHE"):
        return Path(os.environ["DRAFTGYM_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "draftgym"


BF16_FLAGS = (
    "avx512_bf16",
    "amx_bf16",
    "amx_tile",
    "bf16",
)  # x86's (AMX tiles carry its bf16 products), Arm's


def _cpu_fields() -> dict[str, str] | None:
    """The first processor's fields of /proc/cpuinfo (None where there is none to read). Arm names its flags
    ``Features`` and gives no ``model name``."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    fields: dict[str, str] = {}
    for line in info.splitlines():
        if ":" in line:
            k, v = (x.strip() for x in line.split(":", 1))
            fields.setdefault(k, v)
        elif fields:
            break  # the first processor only
    return fields


def _flags(fields: dict[str, str]) -> set[str]:
    return set((fields.get("flags") or fields.get("Features") or "").split())


def cpu_has_bf16() -> bool:
    """True when this CPU has native bf16 arithmetic (AVX-512 BF16 or AMX on x86; bf16 on Arm), read from the
    same fields as ``cpu_label`` names."""
    fields = _cpu_fields()
    return fields is not None and any(f in _flags(fields) for f in ("avx512_bf16", "amx_bf16", "bf16"))


def cpu_label() -> str:
    """The CPU as a figure should name it: model name, family/model (x86) or implementer/part (Arm), and its bf16
    flags. A VM that hides the model name is named as ``platform`` knows it."""
    fields = _cpu_fields()
    fallback = platform.processor() or platform.machine() or "?"
    if fields is None:
        return fallback
    flags = _flags(fields)
    bf16 = [f for f in BF16_FLAGS if f in flags] or ["no native bf16"]
    name = fields.get("model name") or fields.get("Hardware") or fallback
    if "cpu family" not in fields and "CPU part" in fields:
        where = f"implementer {fields.get('CPU implementer', '?')} part {fields['CPU part']}"
    else:
        where = f"family {fields.get('cpu family', '?')} model {fields.get('model', '?')}"
    return f"{name} ({where}; {', '.join(bf16)})"


WIDE_FILE = "wide_products.json"  # in cache_dir(): the matmul probes' decisions per machine


def _settle(
    what: str, decided: bool | None, probe: Callable[[], bool], decide: Callable[[bool], None]
) -> bool:
    """A matmul probe's decision, made once per machine: read from ``cache_dir()/wide_products.json`` (keyed by
    CPU, its bf16 flags, torch version, threads and ``what``), else ``probe()``d and kept there, so every process on
    a machine computes alike. Processes that start at once take turns (``taking_turns``): one probes, the others
    read its decision (else each probed under the others' load and could decide otherwise, and the file kept one
    of them). A damaged or foreign file is ignored (probed again and rewritten); one that cannot be written is no
    error."""
    if decided is not None:
        return bool(decided)
    from env.folder_lock import taking_turns

    cap, threads = torch.backends.cpu.get_cpu_capability(), torch.get_num_threads()
    key = f"{cpu_label()}|{cap}|{threads} threads|torch {torch.__version__}|{what}"
    path = cache_dir() / WIDE_FILE
    kept = _kept(path)
    if key in kept:  # decided before: no turn to wait for
        decide(kept[key])
        return kept[key]
    with taking_turns(path.with_name(f".{WIDE_FILE}.lock")):
        return _settle_here(path, key, probe, decide)


def _kept(path: Path) -> dict[str, bool]:
    try:
        kept = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        kept = {}
    return {k: v for k, v in kept.items() if isinstance(v, bool)} if isinstance(kept, dict) else {}


def _settle_here(path: Path, key: str, probe: Callable[[], bool], decide: Callable[[bool], None]) -> bool:
    from env.files import atomic_write_text

    kept = _kept(path)  # again, in turn: another process may have probed meanwhile
    if key in kept:
        decide(kept[key])
        return kept[key]
    value = bool(probe())
    decide(value)
    with contextlib.suppress(OSError):  # a folder that cannot be written: probed again next time
        atomic_write_text(path, json.dumps({**kept, key: value}, indent=1))
    return value


def settle_wide(dtype: torch.dtype) -> bool:
    """Whether wide products of ``dtype`` run in fp32 here (``kernels.quant.wide_in_fp32``), decided once per
    machine (``_settle``). Under ``DRAFTGYM_WIDE_MATMUL=native|fp32`` the setting decides and nothing is read or
    kept."""
    from kernels import quant

    if quant.wide_mode() != "auto":
        return quant.wide_in_fp32(dtype)
    return _settle(
        str(dtype),
        quant.wide_decided(dtype),
        lambda: quant.probe_wide(dtype),
        lambda v: quant.decide_wide(dtype, v),
    )


def settle_packed() -> bool:
    """Whether fp32 products on the CPU go through oneDNN with reordered weights here
    (``kernels.packed.packed_fp32``), decided once per machine (``_settle``). Under
    ``DRAFTGYM_FP32_MATMUL=packed|plain`` the setting decides."""
    from kernels import packed

    if packed.packed_mode() != "auto":
        return packed.packed_fp32()
    return _settle(
        "fp32 reordered products", packed.packed_decided(), packed.probe_packed, packed.decide_packed
    )


LIBRARIES = ("draftgym", "torch", "transformers", "gymnasium", "stable-baselines3", "scikit-learn", "optuna",
             "triton", "numpy")  # fmt: skip


def library_versions(libs: tuple[str, ...] = LIBRARIES) -> dict[str, str | None]:
    """The installed version of each library a result file names (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for name in libs:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def machine_info() -> dict[str, Any]:
    """The machine a measurement ran on, for a result file's provenance: CPU (its label with the bf16 flags),
    platform, threads, torch version, GPU."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu_label": cpu_label(),
        "host": platform.node(),
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        **allocator.allocator_state(),  # the C allocator's setting (env.allocator)
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def one_blas_thread() -> Any:
    """A context in which NumPy's BLAS runs on one thread: for a policy's NumPy (a LinUCB solve, a network's
    matrix products) between the target's forwards. NumPy's OpenBLAS threads spin after each call, on the cores
    torch's threads are about to use: on a 2-core CPU a 1 ms solve before a forward made it ~70 ms slower (two
    threads each) and ~6 ms with one BLAS thread. It limits every BLAS library threadpoolctl finds loaded: with
    torch's pip wheels, NumPy's (and SciPy's) only (torch's own threads, OpenMP, are not touched); a torch linked
    to a shared BLAS would be limited too. The limit is set when this is called (it scans the loaded libraries)
    and lifted when its ``with`` block ends."""
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=1, user_api="blas")
