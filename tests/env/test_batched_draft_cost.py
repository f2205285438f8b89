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
    from env.batch_calibrate import CATCH_STEPS, _batches, _time_batched
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
    # every timed proposal follows a speculative step of the same arm (the step proposes first, inside it), or
    # CATCH_STEPS plain steps after one at depth 1 (the catch-up price)
    timed = [
        i for i, (kind, _) in enumerate(calls) if kind == "propose" and (i == 0 or calls[i - 1][0] != "step")
    ]
    plain = [i for i in timed if calls[i - 2][1][0] == "none"]
    assert timed and all(calls[i - 2] == ("step", calls[i][1]) for i in timed if i not in plain)
    steps = [[x for x in calls[: i - 1] if x[0] == "step"][-CATCH_STEPS - 1 :] for i in plain]
    assert len(plain) == 3 * 2 * 3 and all(  # 3 prompts x 2 reps x 3 row counts
        s[0][1] == calls[i][1] and {n for n in calls[i][1]} == {"eagle3-d1"} and all(
            x[1] == ["none"] * len(calls[i][1]) for x in s[1:]) for s, i in zip(steps, plain)
    )  # fmt: skip
    assert all(name.startswith("eagle3-d") or name == "none" for _, names in calls for name in names)
    assert got.rows == (1, 2, 4) and len(got.fixed_s) == len(got.level_s) == len(got.catch_s) == 3
    assert all(x >= 0 for x in got.fixed_s + got.level_s) and sum(got.level_s) > 0  # a level is never free
    assert list(got.fixed_s) == sorted(got.fixed_s) and list(got.level_s) == sorted(got.level_s)
    assert BatchedDraft.from_json(got.to_json(), "x") == got


CAUGHT = dataclasses.replace(HEAD, catch_s=(1e-5, 2e-5, 4e-5))


def test_a_heads_catch_up_is_priced_per_token_and_a_file_without_it_prices_none(tmp_path):
    c = fitted(batched={"eagle3": CAUGHT})
    assert c.catch_up_s("eagle3", 4, 100) == pytest.approx(2e-5 * 100)
    assert c.catch_up_s("eagle3", 10, 50) == pytest.approx((2e-5 + 0.5 * 2e-5) * 50)  # linear between points
    assert np.allclose(c.catch_up_s("eagle3", np.array([0, 1]), np.array([9, 9])), [0.0, 9e-5])
    assert c.catch_up_s("ngram", 4, 100) == 0.0 and c.catch_up_s(None, 4, 100) == 0.0
    assert with_head().catch_up_s("eagle3", 4, 100) == 0.0  # a file from before it
    back = load_batch_cost(c.save(tmp_path / "bc.json"))
    assert back.batched == c.batched and back.to_json()["drafters_batched"]["eagle3"]["catch_s_per_token"]
    assert "catch_s_per_token" not in with_head().to_json()["drafters_batched"]["eagle3"]  # its digest kept


@pytest.mark.parametrize(
    "catch, why",
    [([1e-5], "one per row count"), ([1e-5, -1e-5], "finite seconds"), ([1e-5, float("inf")], "finite seconds"),
     ([1e-5, 2.0], "finite seconds"), ("1e-5", "must be a list"), ([1e-5, "x"], "malformed")],
)  # fmt: skip
def test_a_malformed_catch_up_price_is_refused_naming_it(catch, why, tmp_path):
    d = with_head().to_json()
    d["drafters_batched"] = {"eagle3": {"rows": [1, 4], "fixed_s": [1e-3, 2e-3], "level_s": [1e-3, 2e-3],
                                        "catch_s_per_token": catch}}  # fmt: skip
    path = tmp_path / "bc.json"
    path.write_text(json.dumps(d))
    with pytest.raises(CostModelError, match=why) as err:
        load_batch_cost(path)
    assert "drafters_batched.eagle3" in str(err.value) and "\n" not in str(err.value)


def _twins(load: str, requests: int, max_batch: int, long: bool = False):
    """Two replays of one stream, the first pricing the head's catch-up, the second not (``long``: every request
    the trace's first prompt, which runs to its 32 new tokens)."""
    from env.serve_env import ServeSim

    arms, trace = ["none", "ngram-d2", "eagle3-d2"], _trace_with("eagle3")
    ids = trace.prompt_ids[:1] if long else None
    sims = [ServeSim(1, trace=trace, arms=arms, cost=fitted(batched={"eagle3": h}), max_batch=max_batch,
                     loads=[load], requests=requests, prompt_ids=ids, seed=5) for h in (CAUGHT, HEAD)]  # fmt: skip
    for s in sims:
        s.reset()
    return sims


def _extra(sims, act) -> float:
    outs = [s.step(np.asarray(act)[None])[1] for s in sims]
    assert np.array_equal(outs[0]["tok"], outs[1]["tok"])
    return float(outs[0]["cost"][0] - outs[1]["cost"][0]), outs[0]


def test_replay_charges_a_heads_catch_up_on_the_prompt_and_on_the_plain_steps_before_the_last():
    """A head reads the prompt at its row's first proposal and every token since its last proposal there; the
    fixed part of its price already holds the last step's commits, so the rest is charged per token."""
    c = fitted(batched={"eagle3": CAUGHT})
    sims = _twins("4", 4, 4, long=True)
    sim = sims[0]
    assert sim.active[0].all()
    prompts = sim.prompt_len[sim.prompt[0]].copy()
    extra, o1 = _extra(sims, [2, 2, 2, 2])  # every row's first proposal with the head: its prompt
    assert extra == pytest.approx(float(c.catch_up_s("eagle3", 4, prompts.sum())))
    extra, o2 = _extra(sims, [0, 0, 1, 1])  # plain and n-gram steps: no head, nothing to catch up
    assert extra == 0.0
    extra, o3 = _extra(sims, [0, 0, 0, 0])
    assert extra == 0.0
    assert not (o1["end"].any() or o2["end"].any() or o3["end"].any())  # the same rows in the same slots
    # rows 0 and 1 draft with the head again: they read what steps 1 and 2 committed (step 3's is in the fixed
    # part); rows 2 and 3 do not draft with it now
    extra, _ = _extra(sims, [2, 2, 0, 1])
    assert extra == pytest.approx(float(c.catch_up_s("eagle3", 2, (o1["tok"] + o2["tok"])[0, :2].sum())))
    # right after a step with the head, nothing is behind
    extra, _ = _extra(sims, [2, 2, 0, 0])
    assert extra == pytest.approx(0.0)


def test_a_row_admitted_in_a_freed_slot_reads_its_own_prompt_at_its_first_proposal():
    c = fitted(batched={"eagle3": CAUGHT})
    sims = _twins("1", 3, 1)
    sim = sims[0]
    assert sim.ptr[0] == 1
    _extra(sims, [2])  # the first request's head has read its prompt
    for _ in range(200):  # plain steps until the first request ends and the second enters
        if sim.ptr[0] == 2:
            break
        _extra(sims, [0])
    assert sim.active[0, 0] and sim.ptr[0] == 2
    second = int(sim.prompt[0, 0])
    extra, _ = _extra(sims, [2])
    assert extra == pytest.approx(float(c.catch_up_s("eagle3", 1, sim.prompt_len[second])))


def test_every_rows_state_travels_with_it_through_admission_and_retirement():
    """Each row's bookkeeping (position, acceptance counts, last accepted, last commits, tokens the head has yet to
    read) follows the row when rows retire and the batch's last row takes a hole (the live engine's order), and a
    row admitted into a freed slot starts fresh: checked step by step against the step's own outcome."""
    from env.serve_env import ServeSim
    from env.serve_obs import update_alpha

    sim = ServeSim(5, trace=_trace_with("eagle3"), arms=["none", "ngram-d2", "eagle3-d2"], cost=fitted(batched={"eagle3": CAUGHT}),
                   max_batch=4, loads=["3", "4", "ramp", "bursty"], requests=10, seed=11)  # fmt: skip
    assert sim._catch == [sim.drafter_names.index("eagle3")]
    sim.reset()
    rng = np.random.default_rng(4)
    names = ("prompt", "pos", "s", "n", "last", "took")
    moved = fresh = 0
    while not sim.done().all():
        a = rng.integers(0, 3, size=(5, 4))
        old = {k: getattr(sim, k).copy() for k in (*names, "pend", "active", "ptr")}
        _, o = sim.step(a)
        act = old["active"]
        s2, n2 = update_alpha(old["s"], old["n"], o["acc"], o["dr"], o["rejected"])
        want = {"prompt": old["prompt"], "pos": old["pos"] + o["tok"], "s": s2, "n": n2, "took": o["tok"],
                "last": np.where(act & (o["dr"] > 0), o["acc"], old["last"]),
                "pend": np.where((a == 2) & act, 0, old["pend"][..., 0]) + o["tok"]}  # fmt: skip
        for i in range(5):
            order = list(range(int(act[i].sum())))  # order[k]: the old slot of the row now in slot k
            for j in sorted(np.flatnonzero(o["end"][i]), reverse=True):
                tail = order.pop()
                if j < len(order):
                    order[j] = tail
                    moved += 1
            for k, j in enumerate(order):
                for name in names:
                    assert getattr(sim, name)[i, k] == want[name][i, j], (name, i, k)
                assert sim.pend[i, k, 0] == want["pend"][i, j]
            for q, k in enumerate(
                range(len(order), int(sim.active[i].sum()))
            ):  # admitted this step, in order
                fresh += 1
                assert sim.prompt[i, k] == sim.req_prompt[i, old["ptr"][i] + q]
                assert all(getattr(sim, name)[i, k] == 0 for name in names[1:]), i
                assert sim.pend[i, k, 0] == sim.prompt_len[sim.prompt[i, k]]
    assert moved > 0 and fresh > 0


def test_the_roofline_prices_a_heads_catch_up_by_its_products_past_the_ridge():
    c = load_batch_cost("roofline:h200/llama-3.1-8b")
    assert c.catch_up_s("eagle3", 16, 10) == 0.0  # hidden by the first level's weight read
    small, big, bigger = (c.catch_up_s("eagle3", 16, t) for t in (1000, 2000, 5000))
    assert 0 < small < big < bigger and bigger - big == pytest.approx(
        3 * (big - small)
    )  # linear past the ridge
    assert c.catch_up_s("early_exit", 16, 5000) > bigger  # its layers, not a layer's q/k/v
    assert c.catch_up_s("ngram", 16, 5000) == 0.0 and c.catch_up_s("eagle3", 0, 5000) == 0.0
    assert bigger < c.forward_s(16, 1, 512)  # five thousand tokens through q/k/v: less than a forward
    from env.serve_env import ServeSim

    sim = ServeSim(
        1, trace=_trace_with("eagle3"), arms=["none", "eagle3-d1"], cost=c, max_batch=4, loads=["4"]
    )
    assert sim._catch == [0]  # priced, though free below the ridge


def test_a_head_free_to_catch_up_at_one_row_is_still_priced_at_others():
    from env.serve_env import ServeSim

    head = dataclasses.replace(HEAD, catch_s=(0.0, 2e-5, 4e-5))
    sim = ServeSim(1, trace=_trace_with("eagle3"), arms=["none", "eagle3-d1"], cost=fitted(batched={"eagle3": head}),
                   max_batch=4, loads=["4"])  # fmt: skip
    assert sim._catch == [0]
    none = ServeSim(
        1, trace=_trace_with("eagle3"), arms=["none", "eagle3-d1"], cost=with_head(), max_batch=4, loads=["4"]
    )
    assert none._catch == [] and none.pend.shape == (1, 4, 0)


def test_the_calibrations_catch_up_price_is_the_extra_time_per_token_of_the_plain_steps(
    tmp_path, monkeypatch
):
    """A fake clock: a timed proposal takes 1 ms plus 10 us for every token the rows' plain steps committed since
    their last speculative step; the price read back is those 10 us at every row count."""
    import env.batch_calibrate as bcal
    from env.batch import BatchEngine
    from tests.drafters.tiny import random_head, tiny_loaded

    loaded = tiny_loaded()
    head = random_head("eagle3", loaded, tmp_path / "head")
    clock, plain = [0.0], [0]
    step, propose = BatchEngine.step, BatchEngine.propose

    def stepped(self, arms, *a, **k):
        plain[0] = plain[0] + len(arms) if all(x.drafter is None for x in arms) else 0
        return step(self, arms, *a, **k)

    def proposed(self, arms, *a, **k):
        clock[0] += 1e-3 + 1e-5 * plain[0]
        return propose(self, arms, *a, **k)

    monkeypatch.setattr(BatchEngine, "step", stepped)
    monkeypatch.setattr(BatchEngine, "propose", proposed)
    monkeypatch.setattr(bcal, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: clock[0])}))
    prompts = [list(range(3, 40)), list(range(5, 30))]
    got = bcal._time_batched(loaded, "eagle3", (1, 2, 4), prompts, 2, {"weights": str(head)})
    assert got.catch_s == pytest.approx((1e-5, 1e-5, 1e-5))


def test_a_rows_pending_tokens_move_with_it_when_rows_retire():
    sim = _twins("4", 4, 4, long=True)[0]
    assert sim.active[0].all() and sim.pend.shape == (1, 4, 1)
    sim.pos[0] = [10, 11, 12, 13]  # a mark per row, moved by the same permutation as the row's position
    sim.pend[0, :, 0] = sim.took[0] = [10, 11, 12, 13]
    sim._retire(np.array([[False, True, False, False]]))  # the last row takes the freed slot
    live = sim.active[0]
    assert live.sum() == 3 and list(sim.pos[0][live]) == [10, 13, 12]
    assert np.array_equal(sim.pend[0, live, 0], sim.pos[0][live]) and np.array_equal(
        sim.took[0][live], sim.pos[0][live]
    )


def test_an_observing_policys_match_head_reads_every_row_each_step_one_row_at_a_time():
    """With no table drafter in the menu the observation proposes with the head at every row, alone, each step
    (``ServeSim.price_policy``): those proposals read what the rows committed, and the arm's has nothing left."""
    from env.serve_env import ServeSim

    c, trace = fitted(batched={"eagle3": CAUGHT}), _trace_with("eagle3")
    sims = [ServeSim(1, trace=trace, arms=["none", "eagle3-d2"], cost=fitted(batched={"eagle3": h}), max_batch=4,
                     loads=["4"], requests=4, prompt_ids=trace.prompt_ids[:1], seed=5) for h in (CAUGHT, HEAD)]  # fmt: skip
    for s in sims:
        s.reset()
        s.price_policy(0.0)
    prompts = sims[0].prompt_len[sims[0].prompt[0]].sum()
    extra, _ = _extra(sims, [0, 0, 0, 0])  # plain steps, the observation's proposals read every prompt
    assert extra == pytest.approx(float(c.catch_up_s("eagle3", 1, prompts)))
    extra, _ = _extra(sims, [1, 1, 0, 0])
    assert extra == pytest.approx(0.0)
    unobserved = _twins("4", 4, 4, long=True)
    extra, _ = _extra(unobserved, [0, 0, 0, 0])  # served as a static arm: nothing proposes with the head
    assert extra == 0.0
