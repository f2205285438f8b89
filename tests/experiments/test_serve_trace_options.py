"""Live serving serves the drafters as the trace recorded them (``draftgym record --drafter-option``: the header's
options, checked like ``--drafter-option``), and a live stream that repeats prompts is noted where a menu drafter
keeps state across requests (the suffix cache finds a repeated prompt's answer; replay, recorded with each prompt
once, does not)."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest

from env.engine import parse_arm
from env.trace import TraceError
from env.trace_record import recorded_drafter_options
from tests.env.conftest import make_trace


def _with_options(options, name="ngram", trace=None):
    t = trace or make_trace(seed=3, prompts=6, max_new=32)
    header = dict(t.header)
    header["drafters"] = {**header["drafters"], name: {**header["drafters"]["ngram"], "options": options}}
    return dataclasses.replace(t, header=header)


def test_the_options_a_trace_recorded_are_read_and_checked():
    assert recorded_drafter_options(_with_options({}), "t.npz") == {}
    assert recorded_drafter_options(_with_options({"max_ngram": 2}), "t.npz") == {"ngram": {"max_ngram": 2}}
    assert recorded_drafter_options(
        _with_options({"options": {"suffix": {"cache_requests": 0}}}, name="hybrid"), "t.npz"
    ) == {"hybrid": {"options": {"suffix": {"cache_requests": 0}}}}
    for bad, name, needle in (
        ({"bogus": 1}, "ngram", "'bogus' is not an option of ngram"),
        ({"x" * 5000: 1}, "ngram", "is not an option of ngram"),
        ({"max_ngram": -4}, "ngram", "recorded for 'ngram'"),
        ({"max_ngram": "x" * 5000}, "ngram", "recorded for 'ngram'"),
        ({"max_ngram": 10**30}, "ngram", "outside TOML.s 64-bit range"),
        ({"options": {"suffix": {"cache_requests": [10**40]}}}, "hybrid", "outside TOML.s 64-bit range"),
        ([1, 2], "ngram", "not a table of options"),
        ({"a": 1}, "y" * 5000, "not a drafter this draftgym has"),
    ):
        with pytest.raises(TraceError, match=needle) as err:
            recorded_drafter_options(_with_options(bad, name=name), "t.npz")
        assert str(err.value).startswith("t.npz") and "\n" not in str(err.value) and len(str(err.value)) < 400


def test_a_stream_that_repeats_prompts_is_noted_where_a_drafter_keeps_state_across_requests(capsys):
    from experiments.serve_live import repeated_prompts

    sim = types.SimpleNamespace(n_req=np.array([5]), req_prompt=np.array([[3, 1, 3, 2, 1, 9]]))
    got = repeated_prompts(sim, [parse_arm(a) for a in ("none", "ngram-d3", "hybrid-d3")])
    assert got == {"requests": 5, "distinct_prompts": 3, "cross_request_drafters": ["hybrid"]}
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "3 distinct in 5 requests" in err and "suffix.cache_requests=0" in err
    # n-gram proposals read only the request's own tokens, and so do a suffix drafter with its cache off and a
    # hybrid whose parts keep nothing across requests: nothing to note
    for arms, opts in ((("none", "ngram-d3"), None), (("suffix-d3",), {"suffix": {"cache_requests": 0}}),
                       (("hybrid-d3",), {"hybrid": {"options": {"suffix": {"cache_requests": 0}}}}),
                       (("hybrid-d3",), {"hybrid": {"parts": "ngram,eagle3"}})):  # fmt: skip
        got = repeated_prompts(sim, [parse_arm(a) for a in arms], opts)
        assert got["cross_request_drafters"] == [] and capsys.readouterr().err == "", (arms, opts)
    for name in ("suffix", "recycling"):
        assert repeated_prompts(sim, [parse_arm(f"{name}-d3")])["cross_request_drafters"] == [name]
        assert "3 distinct in 5 requests" in capsys.readouterr().err
    sim.req_prompt = np.array([[3, 1, 4, 2, 0, 3]])  # no repeat among the 5 requests
    assert repeated_prompts(sim, [parse_arm("suffix-d3")])["distinct_prompts"] == 5
    assert capsys.readouterr().err == ""


def test_live_runs_serve_the_drafter_options_they_are_given(tmp_path, monkeypatch):
    import experiments.serve_live as serve_live
    import experiments.serve_policies as sp
    from env.batch_cost import load_batch_cost
    from env.serve_sim import default_serve_trace
    from policies.base import load_policy

    seen = []

    def fake_stream(loaded, sim, policy, arms, max_batch, max_new, cost, log=None, drafter_options=None):
        seen.append(drafter_options)
        req = types.SimpleNamespace(arrival_s=0.0, finish_s=1.0, token_ids=[1, 2])
        return [req], 1.0

    monkeypatch.setattr(serve_live, "serve_stream", fake_stream)
    monkeypatch.setattr(sp, "warm_up", lambda *a, **k: seen.append(("warm", k.get("drafter_options"))))
    trace, cost = default_serve_trace(), load_batch_cost(None)
    pol = load_policy(next(p for p in sp.shipped_serve_policies() if p.stem == "trt-auto"))
    arms, split = list(pol.arm_names), sp._split(trace, 1, 0)
    opts = {"ngram": {"max_ngram": 2}}
    res = sp.evaluate_serve([("trt-auto", pol)], trace, cost, arms, split, loads=["2"], episodes=1, max_new=6,
                            requests=3, max_batch=16, seed=0, loaded=object(), repeats=1, out=tmp_path,
                            probe=False, drafter_options=opts)  # fmt: skip
    assert seen[0] == ("warm", opts) and len(seen) > 2 and all(x == opts for x in seen[1:])
    stream = res["live_streams"]["2"]
    assert stream["requests"] == 3 and 1 <= stream["distinct_prompts"] <= 3


def test_evaluate_serve_serves_the_options_its_trace_recorded(tmp_path, monkeypatch):
    """The command reads the trace's options and hands them to the evaluation, which serves them live."""
    import experiments.serve_policies as sp
    from env.serve_sim import default_serve_trace
    from experiments.cli import main

    path = _with_options({"max_ngram": 3}, trace=default_serve_trace()).save(tmp_path / "t.npz")
    seen = {}

    def stop(*a, **k):
        seen.update(k)
        raise KeyboardInterrupt

    monkeypatch.setattr(sp, "evaluate_serve", stop)
    main(["evaluate", "--serve", "--trace", str(path), "--no-live", "--out", str(tmp_path / "o")])
    assert seen["drafter_options"] == {"ngram": {"max_ngram": 3}}
    bad = _with_options({"max_ngram": 10**30}, trace=default_serve_trace()).save(tmp_path / "bad.npz")
    assert main(["evaluate", "--serve", "--trace", str(bad), "--no-live", "--out", str(tmp_path / "p")]) == 2
