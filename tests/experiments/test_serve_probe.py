"""The speed probe of ``draftgym evaluate --serve`` (``env.batch_calibrate.speed_probe``): a fitted cost model's own
calibration cells timed again around each load's live runs, so that the fidelity summary tells the cost model's
error from the machine's drift since calibration. Unit tests of the arithmetic (the timing replaced by fixed
numbers), then live on the embedded model: ``evaluate_serve`` serving the bundled trace's held-out prompts, its
probes, its fidelity summary and its resume."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import env.batch_calibrate as bc
from env.batch_cost import FittedBatchCost
from env.cost import Curve
from experiments.serve_policies import fidelity, format_table, paired


def _cost(probe) -> FittedBatchCost:
    one = np.ones((2, 2))
    return FittedBatchCost("m", "float32", "dense", (1, 2), (1, 2), 128, one, 0 * one, Curve((16,), (1.0,)),
                           meta={"probe": probe})  # fmt: skip


REF = [[1, 128, 0.02], [1, 512, 0.03], [2, 128, 0.025], [2, 512, 0.04]]


def test_the_probe_reference_is_read_and_junk_is_skipped():
    junk = [[1, 128], "x", [1, 128, -1.0], [1, 128, float("nan")], [True, 128, 0.1], [1.5, 128, 0.1],
            [0, 128, 0.1], [1, "128", 0.1]]  # fmt: skip
    assert bc.probe_reference(_cost(REF + junk)) == {(r, c): s for r, c, s in REF}
    assert bc.probe_reference(_cost("not a list")) == {} and bc.probe_reference(object()) == {}


@pytest.mark.parametrize(
    "load, rows", [("1", [1]), ("2", [2]), ("3", [2]), ("16", [2]), ("mixed", [1, 2]), ("bursty", [1, 2])]
)
def test_the_probe_times_the_rows_of_the_load(load, rows):
    assert bc.probe_rows(_cost(REF), load) == rows
    assert bc.probe_rows(_cost([]), load) == []


def test_the_factor_is_the_geometric_mean_of_now_over_then(monkeypatch):
    calls = []
    then = {(r, c): s for r, c, s in REF}

    def fake_grid(loaded, rows, nodes, contexts, reps, progress, engines=None):
        calls.append((rows, nodes, contexts))
        slow = {128: 1.5, 512: 1.2}  # the machine is slower now: 1.5x at the short context, 1.2x at the long
        return {(r, 1, c): then[(r, c)] * slow[c] for r in rows for c in contexts}

    monkeypatch.setattr(bc, "_time_grid", fake_grid)
    p = bc.speed_probe(None, _cost(REF), [2])
    assert calls == [([2], [1], [128, 512])]  # one row count at a time, one node, the calibrated contexts
    assert p["factor"] == pytest.approx(math.sqrt(1.5 * 1.2))
    assert [c[:2] for c in p["cells"]] == [[2, 128], [2, 512]] and p["cells"][0][3] == 0.025
    assert bc.speed_probe(None, _cost([]), [1]) is None  # nothing to compare with: no probe


def _rows(load, cells):
    return [{"policy": f"p{i}", "kind": "static", "load": load, "replay_goodput": 1.0, "live_goodput": live,
             "replay_goodput_live_stream": replay} for i, (replay, live) in enumerate(cells)]  # fmt: skip


def test_the_fidelity_summary_takes_out_the_probed_drift():
    # replay overstates live by 25% in every cell, and the probe says the machine is 1.25x slower than calibrated
    rows = _rows("1", [(125.0, 100.0), (250.0, 200.0), (62.5, 50.0)]) + _rows(
        "2", [(110.0, 100.0), (90.0, 100.0)]
    )
    rows.append({"policy": "oracle", "kind": "oracle", "load": "1", "replay_goodput": 3.0, "live_goodput": None,
                 "replay_goodput_live_stream": None})  # fmt: skip
    rows += _rows("mixed", [(10.0, None)])  # replay only: no fidelity
    fid = fidelity(rows, {"1": {"factor": 1.25}})
    assert set(fid) == {"1", "2"}
    assert fid["1"]["policies"] == 3 and fid["1"]["median_abs_error"] == pytest.approx(0.25)
    assert fid["1"]["median_abs_error_at_probe"] == pytest.approx(0.0) and fid["1"]["speed_factor"] == 1.25
    assert (
        fid["2"]["median_abs_error"] == pytest.approx(0.10) and fid["2"]["median_abs_error_at_probe"] is None
    )
    text = format_table(
        {"rows": rows, "best_static_per_load": {}, "best_static_overall": "none", "fidelity": fid}
    )
    assert "load 1" in text and "25.0%" in text and "1.25x" in text and "0.0% with replay rescaled" in text


def test_live_runs_are_paired_run_by_run_against_the_static_arms():
    def row(name, load, runs):
        return {"policy": name, "kind": "static" if name.startswith("static:") else "rl", "load": load,
                "replay_goodput": 1.0, "live_goodput": None if runs is None else float(np.median(runs)),
                "live_runs": runs, "replay_goodput_live_stream": 1.0}  # fmt: skip

    # the machine drifts from pass to pass: the medians say the policy loses (96 against 100), the passes that it
    # wins two of three, by a median 1.1x
    rows = [row("static:none", "mixed", [100.0, 80.0, 120.0]), row("p", "mixed", [90.0, 96.0, 132.0]),
            row("static:ngram-d1", "mixed", [50.0, 40.0, 60.0]), row("q", "mixed", None),
            row("static:none", "16", None), row("p", "16", None)]  # fmt: skip
    got = paired(rows, {"mixed": "none", "16": "none"}, "ngram-d1")
    assert set(got) == {"mixed"}  # no live runs at 16 rows; q was replayed only
    p = got["mixed"]["p"]
    assert set(p) == {"static:none", "static:ngram-d1"}
    assert p["static:none"] == pytest.approx({"median": 1.1, "min": 0.9, "max": 1.2, "runs": 3})
    assert p["static:ngram-d1"]["median"] == pytest.approx(2.2)
    # each static arm is paired with the other, never with itself
    assert got["mixed"]["static:ngram-d1"]["static:none"]["median"] == pytest.approx(0.5)
    assert "static:none" not in got["mixed"]["static:none"]
    text = format_table(
        {"rows": rows, "best_static_per_load": {}, "best_static_overall": "none", "paired": got}
    )
    assert "1.100x static:none [0.900, 1.200]" in text
    # a run that is not a finite positive number pairs with nothing
    rows[0]["live_runs"], rows[1]["live_runs"] = (
        [float("nan"), 80.0, 0.0, 120.0],
        [90.0, float("inf"), 5.0, 132.0],
    )
    assert paired(rows, {"mixed": "none"}, "none")["mixed"]["p"]["static:none"] == pytest.approx(
        {"median": 1.1, "min": 1.1, "max": 1.1, "runs": 1}
    )
    # tagged with their passes, runs pair only within a pass: a kill cut pass 1 in two (the policy's run 1 made
    # before it, the arm's after, in a resumed session "b"), so pass 1 pairs with nothing
    rows[0]["live_runs"], rows[1]["live_runs"] = [100.0, 80.0, 120.0], [90.0, 96.0, 132.0]
    rows[0]["live_passes"], rows[1]["live_passes"] = ["a/0", "b/1", "b/2"], ["a/0", "a/1", "b/2"]
    assert paired(rows, {"mixed": "none"}, "none")["mixed"]["p"]["static:none"] == pytest.approx(
        {"median": 1.0, "min": 0.9, "max": 1.1, "runs": 2}
    )
    rows[1]["live_passes"] = ["b/2", "a/1", "a/0"]  # by tag, not by position
    assert paired(rows, {"mixed": "none"}, "none")["mixed"]["p"]["static:none"]["median"] == pytest.approx(
        (132 / 100 + 90 / 120) / 2
    )
    # a policy served in another session than the static arm (added to a finished --out): said, with no ratio
    rows[1]["live_passes"] = ["c/0", "c/1", "c/2"]
    got = paired(rows, {"mixed": "none"}, "none")
    assert got["mixed"]["p"]["static:none"] == {"median": None, "min": None, "max": None, "runs": 0}
    text = format_table(
        {"rows": rows, "best_static_per_load": {}, "best_static_overall": "none", "paired": got}
    )
    assert "static:none: no pass in common" in text


# ---- live, on the embedded model ---------------------------------------------------------------------------------


@pytest.mark.model
def test_live_evaluation_brackets_each_load_with_a_probe_and_resumes(fp32_model, tmp_path, monkeypatch):
    import experiments.serve_policies as sp
    from env.serve_sim import default_serve_trace
    from policies.base import load_policy

    # short contexts and prefills: the prefills were most of this test's time at the defaults
    cost = bc.calibrate_batch(
        fp32_model, rows=(1, 2), nodes=(1, 2), contexts=(32, 96), reps=1, prefill_tokens=(16, 64)
    )
    assert sorted(bc.probe_reference(cost)) == [(1, 32), (1, 96), (2, 32), (2, 96)]  # timed at calibration
    trace = default_serve_trace()
    path = next(p for p in sp.shipped_serve_policies() if p.stem == "trt-auto")
    pol = load_policy(path)
    arms = list(pol.arm_names)
    kw = dict(loads=["1", "2"], episodes=2, max_new=6, requests=2, max_batch=16, seed=0, loaded=fp32_model,
              repeats=1, live_policies={"trt-auto", "static:ngram-d1", "static:none"}, out=tmp_path)  # fmt: skip
    split = sp._split(trace, 1, 0)
    res = sp.evaluate_serve([("trt-auto", pol)], trace, cost, arms, split, **kw)
    live = [r for r in res["rows"] if r["live_goodput"] is not None]
    assert {r["load"] for r in live} == {"1", "2"} and all(r["live_goodput"] > 0 for r in live)
    # the static arms named are served live too, beside the best static arms
    assert {r["policy"] for r in live} >= {"trt-auto", "static:ngram-d1", "static:none"}
    fid = res["fidelity"]
    assert set(fid) == {"1", "2"}
    for load, rows in (("1", [1]), ("2", [2])):
        f = fid[load]
        assert f["probe"]["rows"] == rows
        # the factor is the probes' arithmetic (each: the geometric mean of now / then over its cells; the load's:
        # the geometric mean of the two), not a bound on how fast this machine was
        for side in ("before", "after"):
            ratios = [now / then for _, _, now, then in f["probe"][side]["cells"]]
            assert all(r > 0 for r in ratios)
            assert f["probe"][side]["factor"] == pytest.approx(float(np.exp(np.mean(np.log(ratios)))))
        both = f["probe"]["before"]["factor"] * f["probe"]["after"]["factor"]
        assert f["speed_factor"] == pytest.approx(float(np.sqrt(both)))
        assert [c[:2] for c in f["probe"]["before"]["cells"]] == [[rows[0], 32], [rows[0], 96]]
        assert f["median_abs_error_at_probe"] is not None and f["policies"] == sum(
            r["load"] == load for r in live
        )
    lines = [json.loads(x) for x in (tmp_path / "live.jsonl").read_text().splitlines()]
    runs = [x for x in lines if "run" in x]
    lines = [x for x in lines if "run" not in x]
    assert sorted(x["run"] for x in runs) == sorted(r["live_goodput"] for r in live)  # one run per cell here
    assert len(lines) == len(live) and all(
        x["probe"]["factor"] == fid[x["load"]]["speed_factor"] for x in lines
    )

    def no_live(*a, **k):
        raise AssertionError("a resumed evaluation served a cell again")

    monkeypatch.setattr(sp, "_live", no_live)
    monkeypatch.setattr(bc, "_time_grid", no_live)
    again = sp.evaluate_serve([("trt-auto", pol)], trace, cost, arms, split, **kw)
    assert again["fidelity"] == fid and again["rows"] == res["rows"] and again["paired"] == res["paired"]
    # the rows each arm served live, from the engine's log, kept with the cells
    rows_by = res["live_arm_rows"]
    assert again["live_arm_rows"] == rows_by and set(rows_by) == {"1", "2"}
    assert set(rows_by["1"]["static:none"]) == {"none"} and rows_by["1"]["static:ngram-d1"]["ngram-d1"] > 0
    assert set(rows_by["2"]["trt-auto"]) <= {"ngram-d5", "ngram-d3", "none"} and sum(
        rows_by["2"]["trt-auto"].values()
    )
    for load in ("1", "2"):  # run by run against the load's best static arm, served in the same pass
        best = f"static:{res['best_static_per_load'][load]}"
        cell = {r["policy"]: r for r in live if r["load"] == load}
        q = res["paired"][load]["trt-auto"][best]
        assert q["runs"] == 1 and q["median"] == pytest.approx(
            cell["trt-auto"]["live_goodput"] / cell[best]["live_goodput"]
        )


@pytest.mark.model
def test_live_cells_of_other_settings_are_not_resumed(tmp_path, capsys):
    """``evaluate --serve`` keeps live cells in ``OUT/live.jsonl``; a rerun with another answer length (or model,
    cost model, prompts, policies ...) in that folder is refused in one line before anything is served, and the
    cells stay as they were."""
    from experiments.cli import main

    out = tmp_path / "ev"
    argv = ["evaluate", "--serve", "--loads", "1", "--requests", "1", "--episodes", "1", "--repeats", "1",
            "--live-policies", "trt-auto", "--dtype", "fp32", "--out", str(out)]  # fmt: skip
    out.mkdir()
    (out / "settings.json").write_text(json.dumps({"max_new_tokens": 99}))
    cell = json.dumps({"policy": "trt-auto", "load": "1", "live_goodput": 1.0, "runs": [1.0], "probe": None})
    (out / "live.jsonl").write_text(cell + "\n")
    assert main(argv) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and "other settings" in err[0] and "max_new_tokens" in err[0], err
    assert (out / "live.jsonl").read_text() == cell + "\n"


def _killed_live_setup(monkeypatch, kill_at: int):
    """A live evaluation without a model: run n serves n tok/s, and run ``kill_at`` is killed (a KeyboardInterrupt);
    ``calls``: the runs served, and the one to kill (set it to -1 for none)."""
    import experiments.serve_policies as sp
    from env.batch_cost import load_batch_cost
    from env.serve_sim import default_serve_trace
    from policies.base import load_policy

    trace, cost = default_serve_trace(), load_batch_cost(None)
    pol = load_policy(next(p for p in sp.shipped_serve_policies() if p.stem == "bucket-ucb"))
    arms, split = list(pol.arm_names), sp._split(trace, 1, 0)
    calls = {"n": 0, "kill_at": kill_at}

    def fake_live(loaded, sim, policy, *a):
        calls["n"] += 1
        if calls["n"] == calls["kill_at"]:
            raise KeyboardInterrupt
        a[-1].arm_rows[arms[0]] += 2  # the log: two rows of the menu's first arm a run
        return float(calls["n"])

    monkeypatch.setattr(sp, "_live", fake_live)
    monkeypatch.setattr(sp, "warm_up", lambda *a, **k: None)  # (no model here)
    return sp, trace, cost, pol, arms, split, calls


def test_live_runs_are_kept_as_they_finish_and_a_killed_load_resumes_from_them(tmp_path, monkeypatch):
    """Each live run is appended as it finishes; killed inside a load, the rerun serves only the runs not yet
    measured, and each cell's median is over all of its runs. An online policy serves every run from its state
    as loaded (a copy)."""
    sp, trace, cost, pol, arms, split, calls = _killed_live_setup(monkeypatch, kill_at=5)
    kw = dict(loads=["1", "2"], episodes=2, max_new=6, requests=2, max_batch=16, seed=0, loaded=object(),
              repeats=3, live_policies={"bucket-ucb"}, out=tmp_path, probe=False)  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        sp.evaluate_serve([("bucket-ucb", pol)], trace, cost, arms, split, **kw)
    kept = [json.loads(x) for x in (tmp_path / "live.jsonl").read_text().splitlines()]
    assert [x["run"] for x in kept] == [1.0, 2.0, 3.0, 4.0] and all(x["load"] == "1" for x in kept)
    assert all(x["arm_rows"] == {arms[0]: 2} for x in kept)
    kept[1]["arm_rows"] = {"bogus-d3": 1}  # not an arm of the menu: that cell's rows per arm are not known
    (tmp_path / "live.jsonl").write_text("".join(json.dumps(x) + "\n" for x in kept))
    calls["n"], calls["kill_at"] = 100, -1
    res = sp.evaluate_serve([("bucket-ucb", pol)], trace, cost, arms, split, **kw)
    live = [r for r in res["rows"] if r["live_goodput"] is not None]
    assert calls["n"] - 100 == 3 * len(live) - 4  # the four kept runs were not served again
    first = kept[0]["policy"]
    cell = next(r for r in live if r["load"] == "1" and r["policy"] == first)
    assert [x["run"] for x in kept if x["policy"] == first] == [1.0, 4.0]  # its first two rounds
    assert cell["live_goodput"] == 4.0  # the median of the kept 1 and 4 and a third run served after the kill
    assert cell["live_runs"][:2] == [1.0, 4.0] and len(cell["live_runs"]) == 3  # the runs it was taken of
    # the rows each arm served, summed over the cell's runs: the two kept from before the kill and the third
    assert res["live_arm_rows"]["1"] == {
        r["policy"]: {arms[0]: 6} for r in live if r["load"] == "1" and r["policy"] != kept[1]["policy"]
    }
    # every run carries its pass: this invocation's tag and the pass; the pass the kill cut in two pairs only the
    # runs made on the same side of it
    s1 = kept[0]["pass"].split("/")[0]
    assert [x["pass"] for x in kept] == [f"{s1}/0"] * 3 + [f"{s1}/1"]
    s2 = cell["live_passes"][2].split("/")[0]
    assert s2 != s1 and cell["live_passes"] == [f"{s1}/0", f"{s1}/1", f"{s2}/2"]
    tags = {r["policy"]: r["live_passes"] for r in live if r["load"] == "1"}
    assert all(t == [f"{s1}/0", f"{s2}/1", f"{s2}/2"] for n, t in tags.items() if n != first)
    assert all(r["live_passes"] == [f"{s2}/{i}" for i in range(3)] for r in live if r["load"] == "2")
    pairs = [(n, ref, q) for n, per in res["paired"]["1"].items() for ref, q in per.items()]
    assert pairs and all(q["runs"] == (2 if first in (n, ref) else 3) for n, ref, q in pairs)
    # a finished cell whose runs are junk is skipped whole and served again; the others keep their runs
    lines = [json.loads(x) for x in (tmp_path / "live.jsonl").read_text().splitlines()]
    cells = [x for x in lines if "live_goodput" in x]
    cells[0]["runs"] = "123"  # not a list (it once read as [1, 2, 3])
    cells[1]["runs"] = [x + 1 for x in cells[1]["runs"]]  # not the runs of its median
    cells[2]["runs"][0] = float("nan")
    cells[3]["passes"] = cells[3]["passes"][:2]  # not one pass per run
    cells[4]["passes"] = [None] * len(cells[4]["runs"])  # not strings
    junk = ["[1]", '"x"', "{"]  # lines that are not a cell at all
    (tmp_path / "live.jsonl").write_text(
        "".join(json.dumps(x) + "\n" for x in cells) + "\n".join(junk) + "\n"
    )
    calls["n"] = 1000
    again = sp.evaluate_serve([("bucket-ucb", pol)], trace, cost, arms, split, **kw)
    assert calls["n"] - 1000 == 15  # the five bad cells, three runs each
    got = {(r["policy"], r["load"]): r["live_runs"] for r in again["rows"] if r["live_runs"]}
    served = sorted(v for x in cells[:5] for v in got[(x["policy"], x["load"])])
    assert served == [1001.0 + i for i in range(15)]  # served again, all five
    assert cells[5:] and all(got[(x["policy"], x["load"])] == x["runs"] for x in cells[5:])


def test_runs_kept_by_an_older_file_pair_by_their_order_and_a_bad_pass_is_served_again(tmp_path, monkeypatch):
    """Run lines without a pass (a file from before passes were kept) are pass i of their cell, as they were
    served; a run line whose pass is no string is skipped and its run served again."""
    sp, trace, cost, pol, arms, split, calls = _killed_live_setup(monkeypatch, kill_at=4)
    kw = dict(loads=["1"], episodes=2, max_new=6, requests=2, max_batch=16, seed=0, loaded=object(),
              repeats=3, live_policies={"bucket-ucb"}, out=tmp_path, probe=False)  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        sp.evaluate_serve([("bucket-ucb", pol)], trace, cost, arms, split, **kw)
    kept = [json.loads(x) for x in (tmp_path / "live.jsonl").read_text().splitlines()]
    assert len(kept) == 3 and kept[2]["policy"] == kept[0]["policy"]  # pass 0, and the first cell's pass 1
    for x in kept:
        del x["pass"]
    kept[2]["pass"] = 7
    (tmp_path / "live.jsonl").write_text("".join(json.dumps(x) + "\n" for x in kept))
    calls["n"], calls["kill_at"] = 100, -1
    res = sp.evaluate_serve([("bucket-ucb", pol)], trace, cost, arms, split, **kw)
    live = [r for r in res["rows"] if r["live_goodput"] is not None]
    assert len(live) == 2 and calls["n"] - 100 == 4  # the bad line's run was served again
    s2 = next(t for t in live[0]["live_passes"] if not t.startswith("legacy/")).split("/")[0]
    assert all(r["live_passes"] == ["legacy/0", f"{s2}/1", f"{s2}/2"] for r in live)
    assert sorted(r["live_runs"][0] for r in live) == [1.0, 2.0] and all(
        3.0 not in r["live_runs"] for r in live
    )
    pairs = [q for per in res["paired"]["1"].values() for q in per.values()]
    assert pairs and all(q["runs"] == 3 for q in pairs)


def test_an_online_policy_serves_each_live_stream_from_its_state_as_loaded():
    import experiments.serve_live as sl
    import experiments.serve_policies as sp
    from policies.base import load_policy

    pol = load_policy(next(p for p in sp.shipped_serve_policies() if p.stem == "bucket-ucb"))
    a, b = sl.fresh(pol), sl.fresh(pol)
    assert a is not pol and b is not a and type(a) is type(pol)


@pytest.mark.model
def test_the_warm_up_serves_every_arm_of_the_menu_before_the_first_timed_run(fp32_model, monkeypatch):
    """A live evaluation first serves two short requests, every arm in turn (a model head's one-time costs are
    paid there, not in the first timed run), once: not again for a second load."""
    import experiments.serve_live as sl
    import experiments.serve_policies as sp
    from env.engine import parse_arm
    from env.serve_sim import ServeSim, default_serve_trace
    from env.serving import ServeLog

    trace = default_serve_trace()
    arms = ["none", "ngram-d1", "ngram-d3"]
    sim = ServeSim(1, trace=trace, arms=arms, max_batch=4, loads=["2"], requests=3, seed=0)
    sim.reset()
    log = ServeLog()
    sl.warm_up(fp32_model, sim, [parse_arm(a) for a in arms], 4, sim.cost, log=log)
    assert set(log.arm_rows) == set(arms) and log.prefills == 2
    calls = []
    monkeypatch.setattr(sp, "warm_up", lambda *a, **k: calls.append(a))
    path = next(p for p in sp.shipped_serve_policies() if p.stem == "trt-auto")
    from policies.base import load_policy

    pol = load_policy(path)
    sp.evaluate_serve([("trt-auto", pol)], trace, sim.cost, list(pol.arm_names), sp._split(trace, 1, 0),
                      loads=["1", "2"], episodes=1, max_new=4, requests=1, max_batch=16, seed=0, loaded=fp32_model,
                      repeats=1, live_policies={"trt-auto"}, probe=False)  # fmt: skip
    assert len(calls) == 1


@pytest.mark.model
def test_a_static_arm_is_served_live_without_a_serving_policy(fp32_model):
    """A static arm runs live as an engine configured with it runs: no observation, no act (``policy_s`` 0), only
    its drafter — and commits what the same arm chosen by a policy every step commits."""
    import experiments.serve_live as sl
    import experiments.serve_policies as sp
    from env.engine import parse_arm
    from env.serve_sim import ServeSim, default_serve_trace
    from env.serving import POLICY_ARM, ServeLog

    trace = default_serve_trace()
    names = ["none", "ngram-d1", "ngram-d3"]
    arms = [parse_arm(a) for a in names]

    class Always:  # the same choice through the policy path
        def act(self, obs):
            return 2

    out = {}
    for label, pol in (("static", sp._Static(2, "ngram-d3")), ("policy", Always())):
        sim = ServeSim(1, trace=trace, arms=names, max_batch=4, loads=["2"], requests=3, seed=0)
        sim.reset()
        log = ServeLog()
        served, _ = sl.serve_stream(fp32_model, sim, pol, arms, 4, 8, sim.cost, log=log)
        out[label] = (served, log)
    (st, st_log), (po, po_log) = out["static"], out["policy"]
    assert [s.token_ids for s in st] == [s.token_ids for s in po] and st_log.steps == po_log.steps > 0
    assert st_log.policy_s == 0 < po_log.policy_s
    assert {s.arm for s in st} == {"ngram-d3"} and {s.arm for s in po} == {POLICY_ARM}
    assert dict(st_log.arm_rows) == dict(po_log.arm_rows) == {"ngram-d3": st_log.row_steps}
    from policies.static import StaticPolicy

    assert StaticPolicy(names, arm="ngram-d1").static_arm == 1  # a static policy file is served the same way


def test_a_kept_cell_whose_goodput_is_nan_or_negative_is_served_again(tmp_path, monkeypatch):
    """A finished cell's ``live_goodput`` of NaN or -5 (its runs removed, as an older file has none) was shown in
    the table and written to --json on the resume."""
    sp, trace, cost, pol, arms, split, calls = _killed_live_setup(monkeypatch, kill_at=-1)
    kw = dict(loads=["1"], episodes=2, max_new=6, requests=2, max_batch=16, seed=0, loaded=object(),
              repeats=3, live_policies={"bucket-ucb"}, out=tmp_path, probe=False)  # fmt: skip
    sp.evaluate_serve([("bucket-ucb", pol)], trace, cost, arms, split, **kw)
    lines = [json.loads(x) for x in (tmp_path / "live.jsonl").read_text().splitlines()]
    cells = [x for x in lines if "live_goodput" in x]
    for cell, bad in zip(cells, (float("nan"), -5.0, "7")):
        cell["live_goodput"] = bad
        del cell["runs"], cell["passes"]
    (tmp_path / "live.jsonl").write_text("".join(json.dumps(x) + "\n" for x in cells))
    calls["n"] = 1000
    again = sp.evaluate_serve([("bucket-ucb", pol)], trace, cost, arms, split, **kw)
    assert calls["n"] - 1000 == 3 * min(3, len(cells))  # each bad cell served again, three runs
    assert all(r["live_goodput"] is None or r["live_goodput"] >= 0 for r in again["rows"])
