"""What one serve-bench cell (``experiments.serve_bench.run_cell``) hands the scheduler, with ``env.serving.serve``
replaced by a recorder (no model): request i of a mix gets arm i mod k, the arrivals are the seeded Poisson draw
(``--rate``) or the trace (``--arrivals``), an open loop admits by arrival (no concurrency cap), a closed one keeps
``level`` requests in flight, the batch never has more rows than the level, the limit or the requests, and each
cell serves its own copy of a policy. The load levels are parsed once each, in order, up to ``MAX_LEVEL``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import env.batch
import env.serving
from env.engine import parse_arm
from env.serving import poisson_arrivals
from experiments.errors import UserError
from experiments.serve_bench import MAX_LEVEL, parse_levels, run_cell


@pytest.fixture
def served(monkeypatch):
    """Each ``serve`` call of a cell: its requests and its keyword arguments."""
    calls = []

    def fake_serve(engine, requests, **kw):
        calls.append({"engine": engine, "requests": list(requests), **kw})
        return []

    monkeypatch.setattr(env.serving, "serve", fake_serve)
    monkeypatch.setattr(env.batch, "BatchEngine", lambda loaded, max_rows: SimpleNamespace(max_rows=max_rows))
    return calls


def _args(**kw):
    base = {"policy_objects": {}, "policy_max_batch": {}, "batch_cost_model": None, "arrivals": None,
            "arrival_times": None, "rate": None, "seed": 0, "max_new_tokens": 8, "max_batch": None,
            "kv_budget": 1 << 20, "prefill_chunk": None, "drafter_options": {}}  # fmt: skip
    return SimpleNamespace(**{**base, **kw})


def _cell(args, method="ar", level=2, n=7):
    prompts = [[1, 2, 3 + i] for i in range(n)]
    rids = [f"p{i}" for i in range(n)]
    run_cell(None, method, level, prompts, rids, args, {})


def test_a_mix_gives_request_i_the_arm_i_mod_k(served):
    _cell(_args(), method="mix(none,ngram-d4,ngram-d2)")
    reqs = served[0]["requests"]
    names = ["none", "ngram-d4", "ngram-d2"]
    assert [r.rid for r in reqs] == [f"p{i}" for i in range(7)]
    assert [r.arm for r in reqs] == [parse_arm(names[i % 3]) for i in range(7)]
    assert [r.prompt_ids[-1] for r in reqs] == [3 + i for i in range(7)]  # each its own prompt


def test_a_closed_loop_keeps_level_requests_in_flight_and_an_open_one_has_no_cap(served, tmp_path):
    _cell(_args(), level=3)
    assert served[-1]["concurrency"] == 3 and [r.arrival_s for r in served[-1]["requests"]] == [0.0] * 7
    _cell(_args(rate=5.0), level=3)
    assert served[-1]["concurrency"] is None
    times = [0.0, 0.0, 0.1, 0.2, 0.2, 0.5, 1.0]
    _cell(_args(arrivals=str(tmp_path / "a.txt"), arrival_times=times), level=3)
    assert served[-1]["concurrency"] is None and [r.arrival_s for r in served[-1]["requests"]] == times


def test_open_loop_arrivals_follow_the_seed(served):
    for seed in (0, 7, 7):
        _cell(_args(rate=4.0, seed=seed))
    got = [[r.arrival_s for r in call["requests"]] for call in served]
    assert got[0] == poisson_arrivals(7, 4.0, 0) and got[1] == poisson_arrivals(7, 4.0, 7)
    assert got[1] == got[2] and got[0] != got[1]


@pytest.mark.parametrize(("level", "max_batch", "n", "rows"), [(4, None, 7, 4), (8, None, 3, 3), (8, 2, 7, 2),
                                                              (3, 16, 7, 3)])  # fmt: skip
def test_the_batch_has_at_most_level_limit_and_request_rows(served, level, max_batch, n, rows):
    _cell(_args(max_batch=max_batch), level=level, n=n)
    assert served[0]["max_batch"] == rows and served[0]["engine"].max_rows == rows


class Counting:
    """An online policy whose state (its count of decisions) must not leak from one cell into the next."""

    arm_names = ["none", "ngram-d2"]

    def __init__(self):
        self.seen = 0


def test_each_cell_serves_its_own_copy_of_a_policy(served):
    method = "policy:c"
    pol = Counting()
    args = _args(policy_objects={method: pol}, policy_max_batch={method: 2})
    _cell(args, method=method)
    used = served[0]["policy"]
    assert used is not pol and isinstance(used, Counting)
    used.seen += 5  # what the cell learned
    _cell(args, method=method)
    assert pol.seen == 0 and served[1]["policy"].seen == 0
    assert all(r.arm == parse_arm("none") for r in served[1]["requests"])  # a placeholder: serve ignores it


def test_levels_are_each_taken_once_in_order_up_to_max_level():
    assert parse_levels("8,2,8,1") == [1, 2, 8]
    assert parse_levels(f"1,{MAX_LEVEL}") == [1, MAX_LEVEL]
    for bad in (f"{MAX_LEVEL + 1}", "0", "", "2,x"):
        with pytest.raises(UserError):
            parse_levels(bad)
