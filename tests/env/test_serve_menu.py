"""The serving env's arm menu takes any drafter the trace recorded, not only those the single-sequence cost model
was calibrated for: the batch cost model prices every serving step (a serve trace with ``suffix`` trees and
``suffix`` arms was refused by the per-sequence cost model's drafter check before)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from env.serve_env import ServeSim
from tests.env.conftest import make_trace

COST = "roofline:h200/llama-3.1-8b"


def _with_copy_of_ngram(name: str):
    t = make_trace(seed=3, prompts=6, max_new=32)
    header = dict(t.header)
    header["drafters"] = {**header["drafters"], name: {"exact": False, "shape": [16, 8, 0], "options": {}}}
    return dataclasses.replace(t, header=header, trees={**t.trees, name: t.trees["ngram"]})


def _run(trace, arms, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Serve the same request streams (a fresh simulator, the same seed) with arm ``k`` throughout."""
    sim = ServeSim(4, trace=trace, arms=arms, cost=COST, max_batch=4, loads=["2"], requests=5, seed=1)
    sim.reset()
    steps = np.zeros(sim.num_envs, np.int64)
    while not sim.done().all():
        steps += ~sim.done()
        sim.step(np.full(sim.num_envs, k))
    return sim.tokens_total.copy(), steps


def test_a_suffix_arm_replays_like_the_same_trees_under_another_name():
    trace = _with_copy_of_ngram("suffix")
    arms = ["none", "ngram-d3", "suffix-d3"]
    tok_none, steps_none = _run(trace, arms, 0)
    tok_ngram, steps_ngram = _run(trace, arms, 1)
    tok_suffix, steps_suffix = _run(trace, arms, 2)
    assert (tok_ngram == tok_none).all() and (tok_suffix == tok_none).all()  # greedy: the same tokens
    assert (steps_ngram < steps_none).any()  # the repetitive trace accepts drafts
    assert (steps_suffix == steps_ngram).all()  # the same trees: the same steps


def test_a_drafter_the_batch_cost_model_cannot_price_is_refused_when_the_env_is_built(tmp_path):
    from env.batch_cost import load_batch_cost
    from env.cost import CostModelError

    doc = load_batch_cost(None).to_json()  # the shipped calibration: ngram only
    assert "suffix" not in doc["drafters_s_per_row"]
    path = tmp_path / "bc.json"
    path.write_text(json.dumps(doc))
    trace = _with_copy_of_ngram("suffix")
    ServeSim(2, trace=trace, arms=["none", "ngram-d3"], cost=str(path), max_batch=4, loads=["2"], requests=3)
    with pytest.raises(CostModelError, match="no calibration for drafter 'suffix'"):
        ServeSim(
            2, trace=trace, arms=["none", "suffix-d3"], cost=str(path), max_batch=4, loads=["2"], requests=3
        )
