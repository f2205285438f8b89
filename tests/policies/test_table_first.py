"""The per-row serving policy ``table-first`` (``policies.serve_rows``): each row's arm from its table-drafter
match depth, by the rule of the batch's size bucket; its file round-trips and a bad rule table is one line; replay
runs it one arm per row (a rule that names one arm for every role serves as that static arm); the fit starts from
the best static table arm and never ends below it on the streams it fits on."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from env.serve_env import DEPTH_NORM, ServeSim, feature_names, obs_size
from policies.base import PolicyError, load_policy
from policies.serve_rows import TableFirstPolicy, fit_table_first, has_table_and_other, table_first_moves
from policies.serving import ROW_BLOCK_AT, ROW_WIDTH, run_policy, static_goodputs
from tests.env.conftest import make_trace

M = 4
ARMS = ["none", "ngram-d1", "ngram-d3", "eagle3-d2"]
COST = "roofline:h200/llama-3.1-8b"
TABLE = [[1, "ngram-d3", "ngram-d1", "eagle3-d2", 3], [1 << 30, "ngram-d1", "none", "none", 2]]


def _obs(rows: int, matches: list[int]) -> np.ndarray:
    obs = np.zeros(obs_size(M), np.float32)
    obs[0] = rows / M
    block = obs[ROW_BLOCK_AT:].reshape(M, ROW_WIDTH)
    for i, m in enumerate(matches):
        block[i, 0], block[i, 4] = 1.0, m / DEPTH_NORM
    return obs


def test_each_row_gets_its_arm_from_its_match_depth_by_the_batch_size_bucket():
    pol = TableFirstPolicy(ARMS, obs_size(M), feature_names(M), table=TABLE)
    assert pol.per_row and pol.kind == "heuristic"
    # one row: match >= 3 -> ngram-d3, 1..2 -> ngram-d1, none -> eagle3-d2
    assert pol.act(_obs(1, [5]))[0] == ARMS.index("ngram-d3")
    assert pol.act(_obs(1, [2]))[0] == ARMS.index("ngram-d1")
    assert pol.act(_obs(1, [0]))[0] == ARMS.index("eagle3-d2")
    # four rows: the second rule (repeat at 2 tokens)
    got = pol.act(_obs(4, [0, 1, 2, 7]))
    assert got.tolist() == [ARMS.index(a) for a in ("none", "none", "ngram-d1", "ngram-d1")]
    assert got.shape == (M,) and got.dtype == np.int64


def test_the_file_round_trips(tmp_path):
    pol = TableFirstPolicy(ARMS, obs_size(M), feature_names(M), table=TABLE)
    pol.save(tmp_path / "tf.zip")
    back = load_policy(tmp_path / "tf.zip")
    assert isinstance(back, TableFirstPolicy) and back.params() == pol.params()
    obs = _obs(3, [0, 4, 1])
    assert np.array_equal(back.act(obs), pol.act(obs))


@pytest.mark.parametrize(
    "table, why",
    [
        ([], "non-empty list"),
        ("ngram-d3", "non-empty list"),
        ([[1, "ngram-d3", "none", "none"]], "is not \\[max_rows"),
        ([[1, "ngram-d9", "none", "none", 3]], "repeat arm 'ngram-d9' is not in the menu"),
        ([[1, "ngram-d3", "none", 4, 3]], "other arm '4' is not in the menu"),
        ([[1, "x" * 10_000, "none", "none", 3]], "repeat arm 'x{60}' is not"),
        ([[4, "ngram-d3", "none", "none", 3], [2, "none", "none", "none", 3]], "must increase"),
        ([[1, "ngram-d3", "none", "none", 0]], "repeat_at"),
        ([[True, "ngram-d3", "none", "none", 3]], "max_rows"),
        ([[1, "ngram-d3", "none", "none", float("nan")]], "repeat_at"),
        ([[1, "ngram-d3", "none", "none", 10**400]], "repeat_at"),
        ([["x" * 200_000, "ngram-d3", "none", "none", 3]], "max_rows"),
    ],
)
def test_a_bad_rule_table_is_one_line(table, why):
    with pytest.raises(PolicyError, match=why) as err:
        TableFirstPolicy(ARMS, obs_size(M), feature_names(M), table=table)
    assert "\n" not in str(err.value) and len(str(err.value)) < 300


def _trace():
    t = make_trace(seed=3, prompts=6, max_new=32)
    header = dict(t.header)
    header["drafters"] = {
        **header["drafters"],
        "eagle3": {"exact": False, "shape": [16, 8, 0], "options": {}},
    }
    return dataclasses.replace(t, header=header, trees={**t.trees, "eagle3": t.trees["ngram"]})


def _make(trace):
    def make(n, loads=("2",), seed=0):
        return ServeSim(
            n, trace=trace, arms=ARMS, cost=COST, max_batch=M, loads=list(loads), requests=6, seed=seed
        )

    return make


def test_replay_runs_it_one_arm_per_row_and_a_one_arm_rule_is_that_static_arm():
    make = _make(_trace())
    feats, size = feature_names(M), obs_size(M)
    for k, arm in enumerate(ARMS):
        one = TableFirstPolicy(ARMS, size, feats, table=[[1 << 30, arm, arm, arm, 3]])
        a, b = make(3), make(3)
        a.reset(), b.reset()
        assert np.array_equal(run_policy(a, one), static_goodputs_of(b, k))
    sim = make(3)
    sim.reset()
    pol = TableFirstPolicy(ARMS, size, feats, table=TABLE)
    seen = set()
    while not sim.done().all():  # the per-row actions run_policy gives, by hand
        obs = sim.observe()
        a = np.stack([pol.act(obs[i]) for i in range(sim.num_envs)])
        seen |= {tuple(sorted(set(a[i][sim.active[i]].tolist()))) for i in range(sim.num_envs)}
        sim.step(a)
    again = make(3)
    again.reset()
    assert np.allclose(run_policy(again, pol), sim.goodput())
    assert any(len(s) > 1 for s in seen)  # rows of one batch served with different arms


def static_goodputs_of(sim, k: int) -> np.ndarray:
    while not sim.done().all():
        sim.step(np.full(sim.num_envs, k))
    return sim.goodput()


def test_the_fit_never_ends_below_the_best_static_table_arm_it_starts_from():
    assert has_table_and_other(ARMS) and not has_table_and_other(["none", "ngram-d1", "ngram-d3"])
    make = _make(_trace())
    feats, size = feature_names(M), obs_size(M)
    ticks = []  # the progress bar's ticks: one per (load, arm), one per move tried
    good = static_goodputs(make, ARMS, ["1", "2"], episodes=3, seed=0, tick=lambda: ticks.append("s"))
    pol = fit_table_first(make, ARMS, size, feats, [1, 2], good, episodes=3, seed=0, sweeps=1,
                          tick=lambda: ticks.append("m"))  # fmt: skip
    assert ticks.count("s") == 2 * len(ARMS) and ticks.count("m") == table_first_moves(ARMS, [1, 2], sweeps=1)
    for level in (1, 2):
        sim = make(3, loads=[str(level)], seed=0)
        sim.reset()
        _, a, b, c, at = pol._entry(level)  # the rule fitted at this level, alone
        one = TableFirstPolicy(ARMS, size, feats, table=[[1 << 30, ARMS[a], ARMS[b], ARMS[c], at]])
        best = max(v for a, v in good[str(level)].items() if a != "eagle3-d2")
        assert float(np.median(run_policy(sim, one))) >= best - 1e-9
    with pytest.raises(PolicyError, match="table drafter"):
        fit_table_first(make, ["none", "eagle3-d2"], size, feats, [1], good)
