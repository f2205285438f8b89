"""Shared fixtures. The embedded model loads once per test session (fp32: exactness is defined in fp32)."""

from __future__ import annotations

import os
import sys

import pytest


def pytest_configure(config):
    """Under pytest-xdist (``-n N``) each worker gets its share of the cores for torch: N workers with torch's
    default thread count each spin against one another's load on a small machine (the kill matrix measured up to
    10x slower on 2 cores). Set in the environment before torch starts, so that the subprocesses a test runs
    inherit it too; a thread count the caller set is kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2:
        return
    share = str(max(1, (os.cpu_count() or 1) // workers))
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, share)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session")
def fp32_model():
    from env.model import load_model

    return load_model(dtype="fp32", device="cpu")
