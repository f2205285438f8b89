"""``calibrate`` (``draftgym calibrate`` without ``--batch``) shows a bar over its measurement grid: on stderr, on a
terminal only, one tick per measurement (verify cells, then each drafter's positions), ending at its total."""

from __future__ import annotations

import sys

import pytest

from drafters import TreeShape


@pytest.mark.model
def test_calibrate_ticks_a_bar_over_its_measurements(fp32_model, monkeypatch):
    import tqdm

    from env.calibrate import calibrate

    bars = []

    class Recorder(tqdm.tqdm):
        def __init__(self, *a, **k):
            self.kw, self.ticks = k, 0
            bars.append(self)
            super().__init__(*a, **{**k, "disable": True})

        def update(self, n=1):
            self.ticks += n

    monkeypatch.setattr(tqdm, "tqdm", Recorder)
    calibrate(fp32_model, ["ngram"], reps=2, contexts=(16, 48), chain_nodes=(1, 3), tree_nodes=(5,),
              draft_shapes=(TreeShape(2),), draft_prompts=1, draft_positions=2, progress=True)  # fmt: skip
    (bar,) = bars
    assert bar.kw["disable"] is None and bar.kw["file"] is sys.stderr  # shown on a terminal, on stderr
    assert (
        bar.ticks == bar.total == 2 * 2 * 3 + 1 * 1 * 2
    )  # reps x contexts x cells, then the drafter's positions


def test_the_bar_is_off_without_progress():
    from env.cli import progress_bar

    bar = progress_bar(3, "x", enabled=False)
    assert bar.disable
    bar.close()
