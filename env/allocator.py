"""The C allocator's setting for a process that runs a target: freed memory kept for the next tensors
(``settle_allocator``, called by ``env.model.load_model``; ``DRAFTGYM_MALLOC=keep|system``), and what a process
ran under, for provenance (``allocator_state``). Imports nothing heavy: the llama.cpp worker
(``experiments.llama_cpp``) settles it too.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

ALLOCATOR_ENV = "DRAFTGYM_MALLOC"
# glibc's mallopt parameters (malloc.h) and the size below which freed memory stays in the process; where a glibc
# refuses an mmap threshold that high (older ones cap it at 32 MiB), it gets 32 MiB
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
KEEP_BYTES, KEEP_BYTES_OLD = 1 << 30, 32 << 20
# what the environment may have set for the allocator before Python started: recorded with the setting
ALLOCATOR_VARS = ("LD_PRELOAD", "GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                  "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX")  # fmt: skip
SETTINGS = ("keep", "system")  # DRAFTGYM_MALLOC's values
# what settle_allocator did: "keep", "keep-32MiB", "partial", "system", "unavailable", "preloaded"
_allocator: str | None = None


class AllocatorError(ValueError):
    """A ``DRAFTGYM_MALLOC`` value that is not one of its settings."""


def allocator_mode() -> str:
    """The ``DRAFTGYM_MALLOC`` setting: keep (default) or system; ``AllocatorError`` for anything else."""
    how = os.environ.get(ALLOCATOR_ENV, "keep").strip().lower() or "keep"
    if how not in SETTINGS:
        raise AllocatorError(f"{ALLOCATOR_ENV}={how!r}: valid values are {', '.join(SETTINGS)}")
    return how


def allocator_intent() -> str:
    """What ``settle_allocator`` will run a target under, before it runs: "system" or, where ``LD_PRELOAD`` puts
    another allocator in glibc's place, "preloaded", else "keep" (a sweep's workers compare it before they load a
    target); then the environment's allocator variables that are set (``ALLOCATOR_VARS``, as ``allocator_state``
    records them: "keep; MALLOC_ARENA_MAX=2"). ``AllocatorError`` for a bad ``DRAFTGYM_MALLOC``."""
    how = allocator_mode()
    how = "preloaded" if how == "keep" and _preloaded() else how
    env = "".join(f"; {k}={os.environ[k]}" for k in ALLOCATOR_VARS if os.environ.get(k))
    return how + env


def _preloaded() -> bool:
    """Whether ``LD_PRELOAD`` puts another allocator (jemalloc, tcmalloc, mimalloc) in glibc's place."""
    return "malloc" in os.environ.get("LD_PRELOAD", "")


def glibc_mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``mallopt`` in this process, None elsewhere (musl, macOS, Windows, a Python without ctypes) or where
    ``LD_PRELOAD`` puts another allocator in glibc's place (its ``mallopt``, if it has one, does something else)."""
    if _preloaded():
        return None
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 -- glibc's own symbol
        mallopt = libc.mallopt
    except (ImportError, OSError, AttributeError, TypeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def settle_allocator() -> str:
    """Keep freed memory in the process for its next tensors: glibc's malloc serves a block above its mmap
    threshold (128 KiB at start, raised as such blocks are freed, to 32 MiB at most) from fresh pages and unmaps
    it when freed, and gives the heap's free top back to the system past its trim threshold. A forward's
    activations, attention scores and KV caches are such blocks, so a process can page-fault the same memory in
    again and again as the batch and its contexts change. On a 2-core AMD EPYC, serving a sixteen-row stream three
    times, seven processes of ten under glibc's thresholds did (6.8-13.6 s in the kernel over the passes) and took
    longer in most passes (the forward 1.16-1.37x by the medians of four rounds with model heads in the menu); none
    with both thresholds at 1 GiB (``python -m
    experiments.bench_allocator``; docs/results/policies-under-load.md, "The allocator: freed memory kept for the
    next forward"). Set once per process, before the target runs (``env.model.load_model``);
    ``DRAFTGYM_MALLOC=system`` leaves glibc's dynamic thresholds. Returns what the process runs with: "keep",
    "keep-32MiB" (a glibc that caps the mmap threshold), "partial" (the mmap threshold set, the trim threshold
    refused), "system", "unavailable" (no glibc ``mallopt``, or the mmap threshold refused: nothing changed) or
    "preloaded" (``LD_PRELOAD`` names another allocator). The mmap threshold goes first: setting either one stops
    glibc's dynamic thresholds. The setting is checked on every call; the first call decides."""
    global _allocator
    how = allocator_mode()
    if _allocator is not None:
        return _allocator
    if how == "system":
        done = "system"
    elif _preloaded():
        done = "preloaded"
    else:
        mallopt = glibc_mallopt()
        done = "unavailable"
        if mallopt is not None:
            if mallopt(M_MMAP_THRESHOLD, KEEP_BYTES) == 1:
                done = "keep"
            elif mallopt(M_MMAP_THRESHOLD, KEEP_BYTES_OLD) == 1:
                done = "keep-32MiB"
            if done != "unavailable" and mallopt(M_TRIM_THRESHOLD, KEEP_BYTES) != 1:
                done = "partial"
    _allocator = done
    return done


def allocator_state() -> dict[str, Any]:
    """The allocator a process's timings ran under, for provenance and a run's identity: what ``settle_allocator``
    did ("untouched" before it ran: no target loaded) and the environment's allocator variables (those set)."""
    env = {k: os.environ[k] for k in ALLOCATOR_VARS if os.environ.get(k)}
    return {"allocator": _allocator or "untouched", "allocator_env": env}
