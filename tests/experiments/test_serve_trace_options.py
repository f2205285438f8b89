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
from experiments.args import trace_drafter_options
from experiments.errors import UserError
from tests.env.conftest import make_trace


def _with_options(options):
    t = make_trace(seed=3, prompts=6, max_new=32)
    header = dict(t.header)
    header["drafters"] = {**header["drafters"], "ngram": {**header["drafters"]["ngram"], "options": options}}
    return dataclasses.replace(t, header=header)


def test_the_options_a_trace_recorded_are_read_and_checked():
    assert trace_drafter_options(_with_options({}), "t.npz") == {}
    assert trace_drafter_options(_with_options({"max_ngram": 2}), "t.npz") == {"ngram": {"max_ngram": 2}}
    for bad, needle in (({"bogus": 1}, "'bogus' is not an option of ngram"), ({"max_ngram": -4}, "ngram"),
                        ({"max_ngram": "x" * 99}, "ngram"), ([1, 2], "not a drafter's options")):  # fmt: skip
        with pytest.raises(UserError, match=needle) as err:
            trace_drafter_options(_with_options(bad), "t.npz")
        assert str(err.value).startswith("t.npz") and "\n" not in str(err.value) and len(str(err.value)) < 300


def test_a_stream_that_repeats_prompts_is_noted_where_a_drafter_keeps_state_across_requests(capsys):
    from experiments.serve_live import repeated_prompts

    sim = types.SimpleNamespace(n_req=np.array([5]), req_prompt=np.array([[3, 1, 3, 2, 1, 9]]))
    got = repeated_prompts(sim, [parse_arm(a) for a in ("none", "ngram-d3", "hybrid-d3")])
    assert got == {"requests": 5, "distinct_prompts": 3, "cross_request_drafters": ["hybrid"]}
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "3 distinct in 5 requests" in err and "suffix.cache_requests=0" in err
    # n-gram proposals read only the request's own tokens: nothing to note
    got = repeated_prompts(sim, [parse_arm(a) for a in ("none", "ngram-d3")])
    assert got["cross_request_drafters"] == [] and capsys.readouterr().err == ""
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
