"""Live serving serves the drafters as the trace recorded them (``draftgym record --drafter-option``: the header's
options, checked like ``--drafter-option``), and a live stream that repeats prompts is noted where a menu drafter
keeps state across requests (the suffix cache finds a repeated prompt's answer; replay, recorded with each prompt
once, does not)."""

from __future__ import annotations

import dataclasses
import re
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


def _trained_with_options(tmp_path, options):
    """serve-train (no PPO) on a small trace whose n-gram drafter was recorded with ``options``."""
    from threadpoolctl import threadpool_limits

    from experiments.cli import main

    t = _with_options(options, trace=make_trace(seed=0, prompts=8, max_new=40))
    t.header["prompts"]["categories"] = ["a"] * 4 + ["b"] * 4
    path = t.save(tmp_path / "opts.npz")
    out = tmp_path / "st"
    with threadpool_limits(1):
        assert main(["serve-train", "--trace", str(path), "--batch-cost", "roofline:h200/llama-3.1-8b",
                     "--timesteps", "0", "--test-per-category", "1", "--requests", "4", "--max-new-tokens", "20",
                     "--out", str(out)]) == 0  # fmt: skip
    return path, out


def test_a_serving_policy_keeps_the_options_of_its_trace_and_evaluate_notes_other_ones(tmp_path, capsys):
    """serve-train keeps the trace's drafter options in every policy's meta; evaluating the policies on a trace
    recorded without them is noted (printed and in the JSON), on their own trace not; a hostile meta is one line."""
    import json

    from experiments.cli import main
    from policies.base import load_policy

    path, out = _trained_with_options(tmp_path, {"max_ngram": 3})
    for p in sorted(out.glob("*.zip")):
        assert load_policy(p).meta["drafter_options"] == {"ngram": {"max_ngram": 3}}, p.name
    plain = make_trace(seed=0, prompts=8, max_new=40)
    plain.header["prompts"]["categories"] = ["a"] * 4 + ["b"] * 4
    plain_path = plain.save(tmp_path / "plain.npz")
    pol = str(out / "smartspec.zip")
    for trace, noted in ((plain_path, True), (path, False)):
        capsys.readouterr()
        argv = ["evaluate", "--serve", pol, "--trace", str(trace), "--batch-cost", "roofline:h200/llama-3.1-8b",
                "--no-live", "--episodes", "1", "--requests", "4", "--loads", "1", "--out", str(tmp_path / "e"),
                "--json", str(tmp_path / "e.json")]  # fmt: skip
        assert main(argv) == 0
        printed = capsys.readouterr().out
        other = json.loads((tmp_path / "e" / "evaluate.json").read_text())[
            "trained_with_other_drafter_options"
        ]
        if noted:
            assert other == {"trace": {}, "policies": {"smartspec": {"ngram": {"max_ngram": 3}}}}
            assert (
                'note: smartspec was trained with the drafter options {"ngram": {"max_ngram": 3}}' in printed
            )
        else:
            assert other == {} and "trained with the drafter options" not in printed
    defaults = load_policy(pol)  # trained on a trace of default drafters ({}), evaluated on one with options
    defaults.meta["drafter_options"] = {}
    defaults.save(tmp_path / "plain-trained.zip")
    argv = ["evaluate", "--serve", str(tmp_path / "plain-trained.zip"), "--trace", str(path), "--no-live",
            "--batch-cost", "roofline:h200/llama-3.1-8b", "--episodes", "1", "--requests", "4", "--loads", "1",
            "--out", str(tmp_path / "e2")]  # fmt: skip
    assert main(argv) == 0
    other = json.loads((tmp_path / "e2" / "evaluate.json").read_text())["trained_with_other_drafter_options"]
    assert other == {"trace": {"ngram": {"max_ngram": 3}}, "policies": {"plain-trained": {}}}
    assert "note: plain-trained was trained with the drafter options {}" in capsys.readouterr().out
    for bad, needle in (([1], "meta.drafter_options is not an object"),
                        ({"ngram": {"max_ngram": 10**30}}, "outside TOML.s 64-bit range"),
                        ({"ngram": {"bogus": 1}}, "'bogus' is not an option of ngram"),
                        ({"nope": {}}, "not a drafter this draftgym has")):  # fmt: skip
        p = load_policy(pol)
        p.meta["drafter_options"] = bad
        p.save(tmp_path / "hostile.zip")
        capsys.readouterr()
        argv = ["evaluate", "--serve", str(tmp_path / "hostile.zip"), "--trace", str(path), "--no-live",
                "--batch-cost", "roofline:h200/llama-3.1-8b", "--out", str(tmp_path / "h")]  # fmt: skip
        assert main(argv) == 2
        err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
        assert len(err) == 1 and re.search(needle, err[0]) and "hostile.zip" in err[0], (bad, err)


def test_serve_bench_serves_the_options_its_policies_were_trained_with(capsys):
    """Every method of a serve-bench run serves one set of drafter options: its policies', drafter by drafter as
    whole tables (a policy trained on the defaults has ``{}``; one from before the key is not known), under
    --drafter-option (noted for each policy whose table it changes); policies that disagree are refused."""
    from experiments.args import served_drafter_options
    from experiments.errors import UserError

    def pol(opts, arms=("none", "ngram-d3")):
        return types.SimpleNamespace(
            meta={} if opts is None else {"drafter_options": opts}, arm_names=list(arms)
        )

    a, b = pol({"ngram": {"max_ngram": 3}}), pol({"ngram": {"min_ngram": 2}})
    plain, old = pol({}), pol(None)
    assert served_drafter_options({"policy:a": a, "policy:old": old}, {}) == {"ngram": {"max_ngram": 3}}
    # a drafter outside a policy's menu is not its concern: no note, no conflict
    other = pol({"suffix": {"cache_requests": 0}}, arms=("none", "suffix-d3"))
    got = served_drafter_options({"policy:a": a, "policy:s": other}, {})
    assert got == {"ngram": {"max_ngram": 3}, "suffix": {"cache_requests": 0}}
    assert capsys.readouterr().err == ""
    got = served_drafter_options(
        {"policy:a": a}, {"ngram": {"min_ngram": 2}, "suffix": {"cache_requests": 0}}
    )
    assert got == {"ngram": {"max_ngram": 3, "min_ngram": 2}, "suffix": {"cache_requests": 0}}
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and 'policy:a was trained with ngram options {"max_ngram": 3}' in err
    assert 'this run serves {"max_ngram": 3, "min_ngram": 2}' in err
    assert served_drafter_options({"policy:a": a}, {"ngram": {"max_ngram": 3}}) == {"ngram": {"max_ngram": 3}}
    assert capsys.readouterr().err == ""  # the same options: nothing changed, nothing noted
    for pair, needle in (((a, b), 'ngram options {"min_ngram": 2} and policy:x with {"max_ngram": 3}'),
                         ((a, plain), "ngram options {} and policy:x with"),
                         ((plain, a), 'ngram options {"max_ngram": 3} and policy:x with {}')):  # fmt: skip
        with pytest.raises(UserError, match=re.escape(needle)):
            served_drafter_options({"policy:x": pair[0], "policy:y": pair[1]}, {})
    with pytest.raises(UserError, match="the drafter options served for ngram"):
        served_drafter_options({"policy:a": a}, {"ngram": {"min_ngram": 5}})  # min above the policy's max


@pytest.mark.model
def test_serve_bench_policy_run_serves_and_records_the_trained_options(tmp_path, monkeypatch):
    """End to end on the embedded model: a policy trained on a trace recorded with an n-gram option makes
    serve-bench serve every method with it, and the run's settings record it."""
    import json

    import env.serving as serving
    from experiments.cli import main

    _, out = _trained_with_options(tmp_path, {"max_ngram": 3})
    seen, real = [], serving.serve

    def spy(*a, **k):
        seen.append(k.get("drafter_options"))
        return real(*a, **k)

    monkeypatch.setattr(serving, "serve", spy)
    run = tmp_path / "sb"
    argv = ["serve-bench", "--limit", "2", "--concurrency", "1", "--methods", "ngram-d2", "--max-new-tokens", "4",
            "--dtype", "fp32", "--policy", str(out / "fitted-table.zip"), "--out", str(run), "--json"]  # fmt: skip
    assert main(argv) == 0
    assert len(seen) >= 2 and all(x == {"ngram": {"max_ngram": 3}} for x in seen)  # (warm-ups too)
    assert json.loads((run / "settings.json").read_text())["drafter_options"] == {"ngram": {"max_ngram": 3}}


def test_evaluate_notes_a_cost_model_that_timed_the_drafters_with_other_options(tmp_path, capsys):
    """A cost model keeps the drafter options it was calibrated with (``calibrate --drafter-option``); evaluated
    on a trace recorded with others, that is noted (printed and in the JSON); with the same ones, not."""
    import json

    from env.batch_cost import default_batch_cost_path
    from experiments.cli import main

    path, out = _trained_with_options(tmp_path, {"max_ngram": 3})
    cost = json.loads(default_batch_cost_path().read_text())
    # (a drafter the cost model does not price is not compared: the shipped model prices ngram only)
    for timed, noted in (({"ngram": {"max_ngram": 2}}, True), ({"ngram": {"max_ngram": 3}}, False),
                         ({"ngram": {"max_ngram": 3}, "suffix": {"cache_requests": 0}}, False)):  # fmt: skip
        cost["meta"]["drafter_options"] = timed
        (tmp_path / "bc.json").write_text(json.dumps(cost))
        capsys.readouterr()
        argv = ["evaluate", "--serve", str(out / "smartspec.zip"), "--trace", str(path), "--batch-cost",
                str(tmp_path / "bc.json"), "--no-live", "--episodes", "1", "--requests", "4", "--loads", "1",
                "--out", str(tmp_path / "e")]  # fmt: skip
        assert main(argv) == 0
        printed = capsys.readouterr().out
        got = json.loads((tmp_path / "e" / "evaluate.json").read_text())["cost_timed_other_drafter_options"]
        if noted:
            assert got == {"cost": timed, "trace": {"ngram": {"max_ngram": 3}}}
            assert (
                'note: the cost model timed the drafters with the options {"ngram": {"max_ngram": 2}}'
                in printed
            )
        else:
            assert got == {} and "the cost model timed" not in printed
