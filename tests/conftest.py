"""Shared fixtures. The embedded model loads once per test session (fp32: exactness is defined in fp32).

The tests run in parallel (pytest-xdist, one worker per CPU; README, Quickstart): a test writes only under its
``tmp_path`` (``DRAFTGYM_CACHE`` too, through ``monkeypatch``, where a command would write the cache), names a study
or a process it starts so that no other test can take it, and assumes nothing an earlier test left."""

from __future__ import annotations

import os
import sys

import pytest


def _cpus() -> int:
    """The CPUs this process may run on: a container's or ``taskset``'s limit, not the host's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (no affinity on this OS)
        return os.cpu_count() or 1


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """``-n logical`` (and ``auto``): one worker per CPU this process may use (xdist asks psutil, which counts the
    host's CPUs, however few a container may use); ``PYTEST_XDIST_AUTO_NUM_WORKERS`` decides where set."""
    given = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS", "")
    return int(given) if given.isdigit() and int(given) > 0 else _cpus()


def pytest_configure(config):
    """Under pytest-xdist (``-n N``) each worker gets its share of the CPUs for torch: N workers with torch's
    default thread count each spin against one another's load on a small machine (the kill matrix measured up to
    10x slower on 2 cores). Set in the environment before torch starts, so that the subprocesses a test runs
    inherit it too; a thread count the caller set (``OMP_NUM_THREADS``) is kept, for MKL as well."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2:
        return
    share = os.environ.get("OMP_NUM_THREADS") or str(max(1, _cpus() // workers))
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, share)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session")
def fp32_model():
    from env.model import load_model

    return load_model(dtype="fp32", device="cpu")
