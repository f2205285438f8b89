"""A drafter that drafts a batch's rows together (a model head) is priced per batch, fixed plus per tree level
(``env.batch_cost.BatchedDraft``), not per row: ``draftgym calibrate --batch`` times it over rows x depths, the
serving replay prices each step at the rows drafting with it and the deepest of their trees, SmartSpec prices its
arms so, and the observation's match depth stays a table drafter's where the menu has one."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from env.batch_cost import BatchedDraft, FittedBatchCost, cost_digest, load_batch_cost, step_context, step_s
from env.cost import CostModelError
from tests.env.conftest import make_trace
from tests.env.test_batch_cost import BASE, REF, fitted

HEAD = BatchedDraft(rows=(1, 4, 16), fixed_s=(1e-3, 1.5e-3, 3e-3), level_s=(2e-3, 2.5e-3, 4e-3))


def with_head(**kw) -> FittedBatchCost:
    return fitted(batched={"eagle3": HEAD}, **kw)


def test_a_batched_drafter_costs_fixed_plus_depth_levels_per_batch_not_per_row():
    c = with_head()
    assert c.draft_s("eagle3", 1, 3) == pytest.approx(1e-3 + 3 * 2e-3)
    assert c.draft_s("eagle3", 16, 2) == pytest.approx(3e-3 + 2 * 4e-3)
    # between grid points linear in rows; past the last, extended along the last two points
    assert c.draft_s("eagle3", 10, 1) == pytest.approx(1.5e-3 + 0.5 * 1.5e-3 + 2.5e-3 + 0.5 * 1.5e-3)
    assert c.draft_s("eagle3", 20, 1) == pytest.approx(3e-3 + 4 * 1.5e-3 / 12 + 4e-3 + 4 * 1.5e-3 / 12)
    out = c.draft_s("eagle3", np.array([0, 1, 4]), np.array([0, 1, 5]))
    assert np.allclose(out, [0.0, 3e-3, 1.5e-3 + 5 * 2.5e-3])  # no rows: nothing
    # sixteen rows cost far less than sixteen times one row (a per-row price would say 16x)
    assert c.draft_s("eagle3", 16, 3) < 3 * c.draft_s("eagle3", 1, 3)
    assert c.draft_s("ngram", 4, 5) == pytest.approx(4 * 2e-4)  # a per-row drafter ignores the depth
    s = step_s(c, 4, 3, REF, {"ngram": 1, "eagle3": 3}, {"eagle3": 2})
    assert s == pytest.approx(BASE[2, 1] + 2e-4 + c.draft_s("eagle3", 3, 2))


def test_the_json_round_trips_and_a_model_without_batched_drafters_keeps_its_digest(tmp_path):
    c = with_head()
    back = load_batch_cost(c.save(tmp_path / "bc.json"))
    assert back.batched == c.batched and back.to_json() == c.to_json()
    shipped = load_batch_cost(None)
    assert "drafters_batched" not in shipped.to_json() and not shipped.batched
    # no batched drafter, no key: a model's JSON, and so its digest (``cost_digest``: serving policies record it
    # to tell which model they were built under), stays what it was before batched drafters
    before = {"format", "version", "model_id", "dtype", "weights", "rows", "nodes", "context_ref", "base_s",
              "slope_s_per_token", "prefill", "drafters_s_per_row", "padded_context", "meta"}  # fmt: skip
    assert set(shipped.to_json()) == before and set(c.to_json()) == before | {"drafters_batched"}
    assert cost_digest(shipped) == cost_digest(load_batch_cost(None))


@pytest.mark.parametrize(
    "entry, why",
    [
        ({"rows": [1, 4], "fixed_s": [1e-3], "level_s": [1e-3, 2e-3]}, "one fixed_s and one level_s each"),
        ({"rows": [4, 1], "fixed_s": [1e-3, 1e-3], "level_s": [1e-3, 2e-3]}, "rows must be increasing"),
        ({"rows": [0, 1], "fixed_s": [1e-3, 1e-3], "level_s": [1e-3, 2e-3]}, "whole numbers in \\[1,"),
        ({"rows": [1, 4], "fixed_s": [1e-3, float("nan")], "level_s": [1e-3, 2e-3]}, "finite seconds"),
        ({"rows": [1, 4], "fixed_s": [1e-3, -1.0], "level_s": [1e-3, 2e-3]}, "finite seconds"),
        ({"rows": [1, 4], "fixed_s": [2e-3, 1e-3], "level_s": [1e-3, 2e-3]}, "must not fall"),
        ({"rows": [1, 4], "fixed_s": [1e-3, 1e-3]}, "malformed"),
        ([1, 2, 3], "malformed"),
        ({"rows": "14", "fixed_s": [1e-3, 1e-3], "level_s": [1e-3, 2e-3]}, "must be lists"),
        ({"rows": [True, 4], "fixed_s": [1e-3, 1e-3], "level_s": [1e-3, 2e-3]}, "whole numbers"),
        ({"rows": [1, 10**400], "fixed_s": [1e-3, 1e-3], "level_s": [1e-3, 2e-3]}, "whole numbers"),
        ({"rows": [1, 4], "fixed_s": [1e-3, "x" * 100_000], "level_s": [1e-3, 2e-3]}, "malformed"),
    ],
)
def test_a_malformed_batched_entry_is_refused_naming_it(entry, why, tmp_path):
    d = with_head().to_json()
    d["drafters_batched"] = {"eagle3": entry}
    path = tmp_path / "bc.json"
    path.write_text(json.dumps(d))
    with pytest.raises(CostModelError, match=why) as err:
        load_batch_cost(path)
    msg = str(err.value)
    assert "drafters_batched.eagle3" in msg and "\n" not in msg and len(msg) < 400
    assert "CostModelError(" not in msg  # named once, not wrapped again by the file's own check


def _trace_with(name: str):
    t = make_trace(seed=3, prompts=6, max_new=32)
    header = dict(t.header)
    header["drafters"] = {**header["drafters"], name: {"exact": False, "shape": [16, 8, 0], "options": {}}}
    return dataclasses.replace(t, header=header, trees={**t.trees, name: t.trees["ngram"]})


def test_the_serving_replay_prices_a_batched_drafter_at_its_rows_and_deepest_tree():
    from env.serve_env import ServeSim

    c = with_head()
    arms = ["none", "ngram-d2", "eagle3-d2", "eagle3-d5"]
    sim = ServeSim(
        2, trace=_trace_with("eagle3"), arms=arms, cost=c, max_batch=4, loads=["4"], requests=6, seed=0
    )
    sim.reset()
    rows = sim.active.sum(1)
    assert (rows >= 2).all()
    act = np.zeros(sim.active.shape, np.int64)  # per row: eagle3-d2 on the first row, eagle3-d5 on the second
    for e in range(sim.num_envs):
        live = np.flatnonzero(sim.active[e])
        act[e, live] = 1  # ngram-d2
        act[e, live[0]], act[e, live[1]] = 2, 3
    out = sim.outcome(act)
    ctx = step_context(c, sim.prompt_len[sim.prompt] + sim.pos, sim.active)
    for e in range(sim.num_envs):
        fwd = c.forward_s(rows[e], out["nodes"][e], ctx[e])
        # the ngram rows per row; the two eagle3 rows as one batch of two drafting five levels
        assert out["cost"][e] == pytest.approx(fwd + (rows[e] - 2) * 2e-4 + c.draft_s("eagle3", 2, 5))
        assert out["forward"][e] == pytest.approx(fwd)  # the split a fidelity check compares with live


def test_the_match_depth_stays_a_table_drafters_and_smartspec_does_not_cap_a_model_heads_chains():
    from env.engine import parse_arm
    from env.serve_env import obs_size
    from env.serve_obs import match_drafter
    from env.serve_sim import _tables
    from policies.serving import SmartSpecPolicy

    assert match_drafter(["eagle3", "ngram"]) == "ngram" and match_drafter(["suffix", "eagle3"]) == "suffix"
    assert match_drafter(["eagle3"]) == "eagle3" and match_drafter([]) is None
    trace = _trace_with("eagle3")  # (its eagle3 trees are the n-gram's, so only the names differ)
    _, with_head_menu = _tables(trace, [parse_arm(a) for a in ("none", "eagle3-d3", "ngram-d2")], 32)
    _, ngram_only = _tables(trace, [parse_arm(a) for a in ("none", "ngram-d2")], 32)
    assert np.array_equal(with_head_menu, ngram_only)  # the n-gram match depth, though eagle3 sorts first

    arms = ["none", "ngram-d3", "suffix-d2", "eagle3-d3"]
    pol = SmartSpecPolicy(arms, obs_size(4), cost=with_head().to_json())
    assert pol.capped == [False, True, True, False]  # every table drafter's chains, not a model head's


def test_calibration_times_a_model_head_per_batch_over_rows_and_depths(tmp_path, monkeypatch):
    """Per row count, one batch per prompt, the rows' prompts rotated through them (a hybrid's cost depends on the
    text: one prompt's would price it)."""
    from env.batch import BatchEngine
    from env.batch_calibrate import _batches, _time_batched
    from tests.drafters.tiny import random_head, tiny_loaded

    assert _batches("eagle3") and _batches("eagle") and not _batches("ngram") and not _batches("suffix")
    loaded = tiny_loaded()
    head = random_head("eagle3", loaded, tmp_path / "head")
    admitted, sizes, real, init = [], {}, BatchEngine.admit, BatchEngine.__init__

    def made(self, loaded, max_rows):
        sizes[id(self)] = max_rows
        init(self, loaded, max_rows)

    def admit(self, prompt, *a, **k):
        admitted.append((sizes[id(self)], tuple(prompt)))
        return real(self, prompt, *a, **k)

    calls, step, propose = [], BatchEngine.step, BatchEngine.propose

    def stepped(self, arms, *a, **k):
        calls.append(("step", [x.name for x in arms]))
        return step(self, arms, *a, **k)

    def proposed(self, arms, *a, **k):
        calls.append(("propose", [x.name for x in arms]))
        return propose(self, arms, *a, **k)

    monkeypatch.setattr(BatchEngine, "__init__", made)
    monkeypatch.setattr(BatchEngine, "admit", admit)
    monkeypatch.setattr(BatchEngine, "step", stepped)
    monkeypatch.setattr(BatchEngine, "propose", proposed)
    prompts = [list(range(3, 40)), list(range(5, 30)), list(range(7, 20))]
    got = _time_batched(loaded, "eagle3", (1, 2, 4), prompts, 2, {"weights": str(head)})
    for r in (
        1,
        2,
        4,
    ):  # every prompt timed at every row count (and one row loading the head; a batch admitted
        # again where the tiny model's context would overflow)
        rows = [p for m, p in admitted if m == r]
        assert len(rows) >= 3 * r + (1 if r == 1 else 0) and {tuple(p) for p in prompts} == set(rows)
    # every timed proposal follows a speculative step of the same arm (the step proposes first, inside it)
    timed = [
        i for i, (kind, _) in enumerate(calls) if kind == "propose" and (i == 0 or calls[i - 1][0] != "step")
    ]
    assert timed and all(calls[i - 2] == ("step", calls[i][1]) for i in timed)
    assert all(name.startswith("eagle3-d") for _, names in calls for name in names)
    assert got.rows == (1, 2, 4) and len(got.fixed_s) == len(got.level_s) == 3
    assert all(x >= 0 for x in got.fixed_s + got.level_s) and sum(got.level_s) > 0  # a level is never free
    assert list(got.fixed_s) == sorted(got.fixed_s) and list(got.level_s) == sorted(got.level_s)
    assert BatchedDraft.from_json(got.to_json(), "x") == got
