"""Shared fixtures. The embedded model loads once per test session (fp32: exactness is defined in fp32)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def fp32_model():
    from env.model import load_model

    return load_model(dtype="fp32", device="cpu")
