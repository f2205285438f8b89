"""How many steps serve-train gives PPO with one arm per row (``experiments.serve_train._row_timesteps``): as
given (0: none), else PPO's on a menu that is a grid of drafters and shapes with ``none``, else none; a number
given for a menu that is no grid is one line."""

from __future__ import annotations

import pytest

from experiments.errors import UserError
from experiments.serve_train import _row_timesteps

GRID = ["none", "ngram-d2", "eagle3-d2", "ngram-d4", "eagle3-d4"]


def test_row_timesteps_as_given_zero_included_else_ppos_on_a_grid():
    assert _row_timesteps(GRID, 100, None) == 100
    assert _row_timesteps(GRID, 100, 7) == 7
    assert _row_timesteps(GRID, 100, 0) == 0  # --row-timesteps 0: no per-row PPO
    assert _row_timesteps(["ngram-d2", "eagle3-d3"], 100, None) == 0
    with pytest.raises(UserError, match="--row-timesteps"):
        _row_timesteps(["ngram-d2", "eagle3-d3"], 100, 5)
