"""The sweep's sampler: Optuna's TPE (or random) sampler, seeded per trial from the study's history.

A plain seeded sampler draws from one random stream per process: the k-th point depends on how many points this
process drew before. A study killed and resumed by a new process would then draw other points than an
uninterrupted one. Here every parameter of every trial gets a fresh sampler, seeded from the sweep's seed, the
worker's index, the number of finished trials before that trial and the parameter's name (a tuple, not a sum:
worker 1 of seed 0 and worker 0 of seed 1 draw different points), so a point depends only on what the study
holds: a resumed study draws the points an uninterrupted one draws, the retry of a killed trial included, even
when the trial died before it had suggested all its parameters (the retry keeps those and suggests the rest).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import optuna

FINISHED = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)


class HistorySeededSampler(optuna.samplers.BaseSampler):
    """``make(seed)``'s sampler (independent sampling only: TPE's default, and the random sampler), re-seeded for
    every (trial, parameter)."""

    def __init__(
        self, make: Callable[[int], optuna.samplers.BaseSampler], seed: int, worker: int = 0
    ) -> None:
        self.make = make
        self.seed = int(seed)
        self.worker = int(worker)

    def trial_seed(self, study: optuna.Study, trial: optuna.trial.FrozenTrial, name: str) -> int:
        before = sum(1 for t in study.get_trials(deepcopy=False, states=FINISHED) if t.number < trial.number)
        return int(
            np.random.SeedSequence(
                [self.seed, self.worker, before, zlib.crc32(name.encode())]
            ).generate_state(1)[0]
        )

    def infer_relative_search_space(self, study: Any, trial: Any) -> dict[str, Any]:
        return {}

    def sample_relative(self, study: Any, trial: Any, search_space: dict[str, Any]) -> dict[str, Any]:
        return {}

    def sample_independent(self, study: Any, trial: Any, param_name: str, param_distribution: Any) -> Any:
        inner = self.make(self.trial_seed(study, trial, param_name))
        return inner.sample_independent(study, trial, param_name, param_distribution)
