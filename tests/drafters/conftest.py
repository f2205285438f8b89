"""Heads trained once per test session on the tiny target (``tests.drafters.tiny.trained_head``)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def trained_tiny(tmp_path_factory):
    """``trained_tiny(kind)``: (the tiny target, a path to a ``kind`` head trained on its greedy answers)."""
    from tests.drafters.tiny import tiny_loaded, trained_head

    folder = tmp_path_factory.mktemp("trained-heads")
    loaded, paths = tiny_loaded(), {}

    def get(kind: str):
        if kind not in paths:
            paths[kind] = trained_head(kind, loaded, folder)
        return loaded, paths[kind]

    return get
