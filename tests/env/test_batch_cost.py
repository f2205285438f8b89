"""Batch cost models (``env.batch_cost``): the fitted model is bilinear in (rows, nodes) on its grid and linear past
it and in context; its JSON round-trips (damaged and hostile files: ``test_batch_cost_files.py``);
the roofline model has the analytic answers (memory-bound at one token, compute-bound at many, monotone); a tiny
calibration on the embedded model gives a usable model."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

from env.batch_cost import (
    FORMAT,
    ROOFLINE_FORMAT,
    FittedBatchCost,
    bilinear,
    load_batch_cost,
    step_context,
    step_s,
)
from env.cost import CostModelError, Curve
from env.roofline import ACCELERATORS, MODELS, RooflineCost, roofline
from tests.env.batch_cost_cases import BASE, NODES, REF, ROWS, SLOPE, fitted

# ---- the fitted model ---------------------------------------------------------------------------------------------


def test_exact_at_every_grid_point():
    c = fitted()
    for i, r in enumerate(ROWS):
        for j, n in enumerate(NODES):
            assert c.forward_s(r, n, REF) == pytest.approx(BASE[i, j], rel=1e-12)
            assert c.forward_s(r, n, REF + 100) == pytest.approx(BASE[i, j] + 100 * SLOPE[i, j], rel=1e-12)


def test_bilinear_between_grid_points():
    c = fitted()
    # rows 3 is half way between 2 and 4, nodes 2 half way between 1 and 3
    want = 0.25 * (BASE[1, 0] + BASE[2, 0] + BASE[1, 1] + BASE[2, 1])
    assert c.forward_s(3, 2, REF) == pytest.approx(want, rel=1e-12)
    # a quarter of the way in rows (1 -> 2 at 1.25), on a node grid line
    assert c.forward_s(1.25, 9, REF) == pytest.approx(0.75 * BASE[0, 2] + 0.25 * BASE[1, 2], rel=1e-12)
    # vectorized: broadcast over arrays
    out = c.forward_s(np.array([1, 3, 4]), np.array([[1], [9]]), REF)
    assert out.shape == (2, 3)
    assert out[1, 2] == pytest.approx(BASE[2, 2]) and out[0, 0] == pytest.approx(BASE[0, 0])


def test_linear_past_the_grid():
    c = fitted()
    # rows 8: the last rows segment (2 -> 4) at this node column, extended by 4 more rows
    want = BASE[2, 1] + (BASE[2, 1] - BASE[1, 1]) / (4 - 2) * (8 - 4)
    assert c.forward_s(8, 3, REF) == pytest.approx(want, rel=1e-12)
    # nodes 15: the last nodes segment (3 -> 9) of this row extended
    want = BASE[0, 2] + (BASE[0, 2] - BASE[0, 1]) / (9 - 3) * (15 - 9)
    assert c.forward_s(1, 15, REF) == pytest.approx(want, rel=1e-12)
    # both at once: the corner plus each axis's extension
    want = BASE[2, 2] + (BASE[2, 2] - BASE[1, 2]) / 2 * (16 - 4) + (BASE[2, 2] - BASE[2, 1]) / 6 * (27 - 9)
    assert c.forward_s(16, 27, REF) == pytest.approx(want, rel=1e-12)


def test_past_the_grid_more_rows_or_nodes_never_cost_less():
    """A grid that never falls, whose row segment is steeper at a middle node column than at the last (as a
    measured one can be): extending each cell's own segments made 2 rows cheaper than 1 past the last node."""
    base = np.array([[0.010, 0.012, 0.020], [0.011, 0.030, 0.031], [0.013, 0.050, 0.052]])
    c = fitted(base=base)
    for ctx in (REF, REF + 500):
        grid = c.forward_s(np.arange(1, 40)[:, None], np.arange(1, 60)[None, :], ctx)
        assert (np.diff(grid, axis=0) >= -1e-15).all() and (np.diff(grid, axis=1) >= -1e-15).all()


def test_integer_points_read_from_the_table_are_the_interpolation_bit_for_bit(monkeypatch):
    """A replay step prices integer rows and nodes: those within the table are read from it, the rest (and any
    fraction) interpolated; both give the same numbers, bit for bit, in four integer dtypes, 2-D and 1-D."""
    from env.batch_cost import GRID_NODES, GRID_ROWS

    rng = np.random.default_rng(0)
    for c in (fitted(), load_batch_cost()):
        for dtype, hi in ((np.int64, 1), (np.int32, 1), (np.int16, 1), (np.uint8, 1), (np.int64, 3)):
            # hi 1: every point within the table; hi 3: some past it (the call interpolates them all)
            r = rng.integers(0, min(hi * GRID_ROWS, 256), size=(7, 40)).astype(dtype)
            n = rng.integers(0, min(hi * GRID_NODES, 256), size=(7, 40)).astype(dtype)
            ctx = rng.uniform(0, 3000, size=(7, 40))
            want = c.forward_s(r.astype(np.float64), n.astype(np.float64), ctx)
            assert np.array_equal(c.forward_s(r, n, ctx), want)
            assert np.array_equal(c.forward_s(r[0], n[0], ctx[0]), want[0])
        for rows, nodes in (
            ([0, 1, GRID_ROWS - 1], [0, GRID_NODES - 1, 1]),
            ([GRID_ROWS, 2], [1, GRID_NODES]),
        ):
            r, n = np.array(rows), np.array(nodes)
            assert np.array_equal(c.forward_s(r, n, 700), c.forward_s(r + 0.0, n + 0.0, 700))
        assert c.forward_s(np.zeros(0, np.int64), np.zeros(0, np.int64), 900).shape == (0,)
        # within the table nothing is interpolated once it is made
        monkeypatch.setattr(FittedBatchCost, "_bilinear", lambda *a: pytest.fail("interpolated"))
        r, n = np.arange(GRID_ROWS), np.arange(GRID_NODES)[:GRID_ROWS]
        assert np.array_equal(c.forward_s(r, n, 900), c.forward_s(r[::-1], n[::-1], 900)[::-1])
        monkeypatch.undo()


def test_linear_in_context_with_a_floor():
    c = fitted()
    xs = np.array([REF, REF + 1000, REF + 5000])
    ys = c.forward_s(4, 9, xs)
    assert np.allclose(np.diff(ys) / np.diff(xs), SLOPE[2, 2], rtol=1e-9)
    # below the shortest context measured it is not extrapolated: a step there costs what it costs at context_ref
    assert c.forward_s(4, 9, 0) == c.forward_s(4, 9, REF // 2) == c.forward_s(4, 9, REF) == BASE[2, 2]


def test_below_the_reference_context_a_larger_tree_never_costs_less():
    """base and slope are each monotone in nodes, yet base - slope * (context_ref - context) was not: the shipped
    model priced 4 nodes a row below 3 at one row and context 20."""
    from env.batch_cost import load_batch_cost

    for c in (fitted(), load_batch_cost()):
        rows, nodes = np.asarray(c.rows)[:, None, None], np.arange(1, 12)[None, :, None]
        grid = c.forward_s(rows, nodes, np.arange(0, 2 * c.context_ref, 7)[None, None, :])
        assert (np.diff(grid, axis=1) >= -1e-15).all() and (np.diff(grid, axis=2) >= -1e-15).all()


def test_bilinear_function_on_a_single_row_grid():
    vals = np.array([[1.0, 2.0, 4.0]])
    out = bilinear(np.array([1.0]), np.array([1.0, 2.0, 4.0]), vals, np.array([1, 7, 3]), np.array([1, 3, 8]))
    assert np.allclose(out, [1.0, 3.0, 8.0])  # rows ignored, linear past the node grid (slope 1 from 4)


def test_a_single_node_grid_is_usable():
    c = FittedBatchCost.from_json(
        fitted(nodes=(1,), base=BASE[:, :1].copy(), slope=SLOPE[:, :1].copy()).to_json()
    )
    assert c.forward_s(2, 1, REF) == pytest.approx(BASE[1, 0])


def test_draft_and_prefill_and_step():
    c = fitted()
    assert np.allclose(c.draft_s("ngram", np.array([0, 1, 5])), [0, 2e-4, 1e-3])
    assert np.all(c.draft_s(None, np.array([3, 4])) == 0)
    with pytest.raises(CostModelError, match="no calibration for drafter 'eagle'.*ngram"):
        c.draft_s("eagle", 2)
    assert c.prefill_s(40) == pytest.approx(0.02)
    assert c.prefill_s(512) == pytest.approx(0.1 + (0.1 - 0.03) / 192 * 256)  # linear past the last length
    s = step_s(c, 4, 3, REF, {"ngram": 3})
    assert s == pytest.approx(BASE[2, 1] + 3 * 2e-4)
    assert not c.simulated and "test cpu" in c.label


def test_a_step_is_priced_at_the_longest_row_on_our_engine_and_the_mean_on_a_paged_one(tmp_path):
    """Our engine attends every row of a ragged batch over the longest row's span, so a fitted model (measured
    on it) prices a step at the longest context; a roofline model (a paged-attention GPU engine) at the mean."""
    ctx = np.array([[100, 900, 0, 0], [300, 300, 300, 0], [0, 0, 0, 0]])
    active = np.array([[True, True, False, False], [True, True, True, False], [False] * 4])
    fit, roof = fitted(), roofline("h200", "llama-3.1-8b")
    assert fit.padded_context and not roof.padded_context
    assert step_context(fit, ctx, active).tolist() == [900, 300, 0]
    assert step_context(roof, ctx, active).tolist() == [500, 300, 0]
    back = load_batch_cost(fit.save(tmp_path / "b.json"))  # a file of our engine keeps the rule
    assert back.padded_context and step_context(back, ctx, active).tolist() == [900, 300, 0]
    data = fit.to_json()
    del data["padded_context"]  # a file from before the rule: measured on our engine
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert load_batch_cost(tmp_path / "old.json").padded_context
    data["padded_context"] = False  # a fitted model of a paged engine
    (tmp_path / "paged.json").write_text(json.dumps(data))
    assert step_context(load_batch_cost(tmp_path / "paged.json"), ctx, active).tolist() == [500, 300, 0]
    # the serving replay prices a ragged batch so: two rows of 100 and 900 tokens cost as two of 900
    assert fit.forward_s(2, 1, step_context(fit, ctx, active)[0]) == fit.forward_s(2, 1, 900)


def test_json_round_trip(tmp_path):
    c = fitted()
    path = c.save(tmp_path / "sub" / "bc.json")
    back = load_batch_cost(path)
    assert isinstance(back, FittedBatchCost)
    assert back.to_json() == c.to_json()
    assert json.loads(path.read_text())["format"] == FORMAT
    r, n, x = np.meshgrid([1, 3, 7], [1, 2, 5, 12], [0, 128, 900])
    assert np.array_equal(back.forward_s(r, n, x), c.forward_s(r, n, x))
    assert back.prefill_s(100) == c.prefill_s(100) and back.drafters == c.drafters
    assert not list(tmp_path.glob("sub/*.tmp"))  # written atomically


def test_the_policy_book_round_trips_and_prices_rows():
    c = fitted(policy_book=Curve((1, 4), (2e-4, 5e-4)))
    assert c.policy_book_s(0) == 0 and c.policy_book_s(1) == pytest.approx(2e-4)
    assert c.policy_book_s(4) == pytest.approx(5e-4) and c.policy_book_s(7) == pytest.approx(8e-4)  # extended
    back = FittedBatchCost.from_json(json.loads(json.dumps(c.to_json())))
    assert back.policy_book == c.policy_book and back.to_json() == c.to_json()
    old = fitted()  # a file from before it: no figure, nothing priced, the same JSON (and digest) as then
    assert "policy_book" not in old.to_json() and (old.policy_book_s(np.array([0, 3, 16])) == 0).all()
    assert (roofline("h200", "llama-3.1-8b").policy_book_s(np.array([1, 16])) == 0).all()


def test_an_object_passes_through_and_the_default_is_named():
    c = fitted()
    assert load_batch_cost(c) is c
    r = load_batch_cost("roofline:h200")  # the model size defaults to llama-3.1-8b
    assert isinstance(r, RooflineCost) and r.model == "llama-3.1-8b" and r.accelerator == "h200"


# ---- the roofline model -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("acc", sorted(ACCELERATORS))
@pytest.mark.parametrize("model", ["llama-3.1-8b", "qwen2.5-7b"])
def test_one_token_is_memory_bound(acc, model):
    c = roofline(acc, model)
    a, s = ACCELERATORS[acc], MODELS[model]
    # the weights a step multiplies by: all but the untied input embedding table, of which it gathers one row
    dense = s["params"] - s["embed_params"]
    assert 0.06 < s["embed_params"] / s["params"] < 0.08  # vocabulary x hidden of an untied 7-8B model
    want = a["overhead_s"] + 2 * dense / (a["bytes_s"] * c.bw_efficiency)
    assert c.forward_s(1, 1, 0) == pytest.approx(want, rel=1e-4)  # the KV of one token is next to nothing
    # exactly: the weights plus the KV of the one position read once
    kv = 2 * s["layers"] * s["kv_heads"] * s["head_dim"] * 2
    exact = a["overhead_s"] + (2 * dense + kv) / (a["bytes_s"] * c.bw_efficiency)
    assert c.forward_s(1, 1, 0) == pytest.approx(exact, rel=1e-12)
    assert c.simulated and c.label == f"roofline:{acc}/{model} (simulated)"


def test_many_tokens_are_compute_bound_and_linear():
    c = roofline("h200", "llama-3.1-8b")
    a, s = ACCELERATORS["h200"], MODELS["llama-3.1-8b"]
    n = np.array([4096, 8192, 16384])
    t = c.forward_s(n, 1, 0) - a["overhead_s"]
    assert np.allclose(t[1:] / t[:-1], 2.0, rtol=1e-9)  # twice the tokens, twice the time
    per_token = 2 * (s["params"] - s["embed_params"]) + 4 * s["layers"] * s["heads"] * s["head_dim"] * 0.5
    assert np.allclose(t, n * per_token / (a["flops"] * c.flop_efficiency), rtol=1e-12)
    # while at one token the same model is memory-bound: far below the compute line's 1/4096 share
    assert c.forward_s(1, 1, 0) - a["overhead_s"] > 50 * t[0] / 4096


@pytest.mark.parametrize("acc", ["h200", "l4"])
def test_roofline_is_monotone_in_rows_nodes_and_context(acc):
    c = roofline(acc, "llama-3.1-8b")
    r = np.array([1, 2, 3, 4, 8, 16, 32, 64, 256])[:, None, None]
    n = np.array([1, 2, 3, 5, 9, 17, 64])[None, :, None]
    x = np.array([0, 1, 100, 1000, 8000, 32000])[None, None, :]
    t = c.forward_s(r, n, x)
    assert t.shape == (9, 7, 6) and np.isfinite(t).all()
    for axis in range(3):
        assert (np.diff(t, axis=axis) >= 0).all(), axis
    assert (np.diff(c.prefill_s(np.array([1, 16, 64, 512, 4096]))) > 0).all()
    assert np.allclose(c.draft_s("ngram", np.array([0, 2])), [0, 6e-5]) and c.draft_s(None, 3) == 0
    assert c.draft_s("some-drafter", 1) > 0  # an unlisted drafter is priced, not refused


def test_unknown_accelerator_or_model_is_refused():
    with pytest.raises(CostModelError, match="unknown accelerator 'tpu-v9'.*h200"):
        roofline("tpu-v9", "llama-3.1-8b")
    with pytest.raises(CostModelError, match="unknown model size 'gpt-9'.*llama-3.1-8b"):
        roofline("h200", "gpt-9")
    with pytest.raises(CostModelError, match="unknown accelerator"):
        load_batch_cost("roofline:tpu-v9/llama-3.1-8b")
    with pytest.raises(CostModelError, match="unknown model size"):
        load_batch_cost("roofline:h200/gpt-9")
    with pytest.raises(
        CostModelError, match="roofline:h200/ names no model after '/'"
    ):  # was the 8B, silently
        load_batch_cost("roofline:h200/")
    assert load_batch_cost("roofline:h200").label == load_batch_cost("roofline:h200/llama-3.1-8b").label


def test_roofline_json_round_trip(tmp_path):
    c = roofline("a100-80gb", "llama-3.2-1b")
    path = tmp_path / "rl.json"
    path.write_text(json.dumps(c.to_json()))
    back = load_batch_cost(path)
    assert isinstance(back, RooflineCost) and back.to_json()["format"] == ROOFLINE_FORMAT
    assert back.to_json() == c.to_json()
    r, n, x = np.meshgrid([1, 5], [1, 9], [10, 3000])
    assert np.array_equal(back.forward_s(r, n, x), c.forward_s(r, n, x))
    # a changed figure is read, not replaced by the named accelerator's
    d = copy.deepcopy(c.to_json())
    d["acc"]["bytes_s"] *= 2
    path.write_text(json.dumps(d))
    faster = load_batch_cost(path)
    assert faster.forward_s(1, 1, 0) < c.forward_s(1, 1, 0)


def test_the_monotone_fit_pools_an_outlier_instead_of_lifting_everything_after_it():
    from env.batch_calibrate import monotone_fit

    clean = np.array([[20.0, 22.0, 25.0], [21.0, 24.0, 30.0], [30.0, 36.0, 45.0]])
    assert np.array_equal(monotone_fit(clean), clean)  # a monotone grid stays as it is
    noisy = clean.copy()
    noisy[0, 0] = 38.0  # one slow measurement at the smallest cell
    fit = monotone_fit(noisy)
    assert (np.diff(fit, axis=0) >= 0).all() and (np.diff(fit, axis=1) >= 0).all()
    # a running maximum would put 38 in every cell of the first row and column; pooling averages it away
    assert fit[2, 0] == 30.0 and fit[0, 2] < 38.0 and fit[0, 0] < 38.0
    rising = np.maximum.accumulate(np.maximum.accumulate(noisy, axis=0), axis=1)
    assert np.abs(fit - clean).sum() < np.abs(rising - clean).sum() / 2


# ---- calibration on the embedded model ----------------------------------------------------------------------------


@pytest.mark.model
def test_a_tiny_calibration_gives_a_usable_model(fp32_model, tmp_path):
    from env.batch_calibrate import calibrate_batch

    # the prefill timed at the lengths given, sorted, those past the model's context left out; none, or a length
    # below 1 or not an integer, refused before any timing
    for bad in ((), (16, 0), (16.5,), (True,)):
        with pytest.raises(ValueError, match="prefill_tokens must be prompt lengths >= 1"):
            calibrate_batch(fp32_model, prefill_tokens=bad)
    c = calibrate_batch(fp32_model, rows=(1, 2), nodes=(1, 2), reps=1, prefill_tokens=(64, 16, 10**6))
    assert c.prefill.nodes == (16, 64) and len(c.meta["prefill_measured"]) == 2
    assert c.rows == (1, 2) and c.nodes == (1, 2) and c.base.shape == c.slope.shape == (2, 2)
    assert (c.base > 0).all() and (c.slope >= 0).all() and np.isfinite(c.base).all()
    assert (np.diff(c.base, axis=0) >= 0).all() and (np.diff(c.base, axis=1) >= 0).all()  # made monotone
    assert c.drafters.get("ngram", 0) > 0 and (np.asarray(c.prefill.seconds) > 0).all()
    assert c.model_id == fp32_model.model_id and c.dtype == "float32" and c.context_ref == 128
    assert len(c.meta["measurements"]) == 2 * 2 * 2
    assert c.policy_book.nodes == (1, 2) and 0 < c.policy_book_s(1) <= c.policy_book_s(2) < 0.05
    path = c.save(tmp_path / "bc.json")
    back = load_batch_cost(Path(path))
    assert back.to_json() == json.loads(json.dumps(c.to_json()))
    assert back.forward_s(2, 2, 128) == pytest.approx(c.base[1, 1])
