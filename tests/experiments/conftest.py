"""Fixtures of the experiments tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.experiments.bad_input import make_files


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """The bad-input suite's bad files (``tests/experiments/bad_input.py``), made once per module."""
    return make_files(tmp_path_factory.mktemp("bad"))


@pytest.fixture
def quiet_optuna():
    """Optuna's per-trial log lines off within a test, and its verbosity as it was after it."""
    import optuna

    before = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    yield
    optuna.logging.set_verbosity(before)
