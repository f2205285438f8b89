"""The bad-input suite (``tests/experiments/bad_input.py``): ``serve-bench`` and the serving policies'
commands (``serve-train``, ``evaluate --serve``), and serving policies whose training record is malformed."""

from __future__ import annotations

import pytest

from tests.experiments.bad_input import ROOT, check, expand

SERVE = [
    ("concurrency-zero", ["serve-bench", "--concurrency", "0"], "levels must be in [1, 4096]"),
    ("concurrency-huge", ["serve-bench", "--concurrency", "1000000"], "levels must be in [1, 4096]"),
    (
        "hf-batch-open-loop",
        ["serve-bench", "--methods", "ar,hf_batch", "--rate", "2"],
        "cannot follow arrivals",
    ),
    ("serve-bench-arm-too-deep", ["serve-bench", "--methods", "ngram-d100000"], "tree depth must be <= 256"),
    ("serve-bench-seed-negative", ["serve-bench", "--rate", "2", "--seed", "-1"], "--seed: must be in"),
    ("serve-train-seed-negative", ["serve-train", "--seed", "-1"], "--seed: must be in"),
    (
        "evaluate-serve-no-loads",
        ["evaluate", "--serve", "--no-live", "--loads", ","],
        "--loads names no load",
    ),
    (
        "evaluate-serve-load-twice",  # both were evaluated, as two columns of one load
        ["evaluate", "--serve", "--no-live", "--loads", "4,poisson@1,04"],
        "--loads names one load twice ('4' and '04')",
    ),
    (
        "evaluate-serve-rate-twice",
        ["evaluate", "--serve", "--no-live", "--loads", "poisson@1,poisson@1.0"],
        "names one load twice ('poisson@1' and 'poisson@1.0')",
    ),
    (
        "serve-bench-cost-without-policy",
        ["serve-bench", "--batch-cost", "{tmp}/bc.json"],
        "it needs --policy",
    ),
    ("serve-train-timesteps-negative", ["serve-train", "--timesteps", "-1"], "must be >= 0"),
    ("serve-train-row-timesteps-negative", ["serve-train", "--row-timesteps", "-5"], "must be >= 0"),
    (
        "serve-train-predictor-episodes-negative",
        ["serve-train", "--predictor-episodes", "-1"],
        "must be in [0, 4096]",
    ),
    (
        "serve-train-rows-not-a-grid",
        ["serve-train", "--arms", "none,ngram-d2,suffix-d3", "--row-timesteps", "100", "--out", "{tmp}/st"],
        "suffix-d2 is missing",
    ),
    (
        "evaluate-serve-live-unknown",
        ["evaluate", "--serve", "--live-policies", "nope"],
        "--live-policies names nope",
    ),
    ("concurrency-negative", ["serve-bench", "--concurrency", "1,-2"], "levels must be in [1, 4096]"),
    ("concurrency-garbage", ["serve-bench", "--concurrency", "1,x"], "comma list of integers"),
    ("rate-zero", ["serve-bench", "--rate", "0"], "--rate: must be in"),
    ("rate-negative", ["serve-bench", "--rate", "-3"], "--rate: must be in"),
    ("max-batch-zero", ["serve-bench", "--max-batch", "0"], "--max-batch: must be >= 1"),
    ("kv-budget-zero", ["serve-bench", "--kv-budget", "0"], "--kv-budget: must be >= 1"),
    (
        "serve-drafter-option-unknown",
        ["serve-bench", "--drafter-option", "ngram.nope=1"],
        "not an option of ngram",
    ),
    ("prefill-chunk-zero", ["serve-bench", "--prefill-chunk", "0"], "--prefill-chunk: must be >= 1"),
    ("arrivals-missing", ["serve-bench", "--arrivals", "{tmp}/none.txt"], "--arrivals"),
    ("arrivals-garbage", ["serve-bench", "--arrivals", "{garbage}"], "is not a time in seconds"),
    ("arrivals-binary", ["serve-bench", "--arrivals", "{bin}"], "not UTF-8"),
    ("arrivals-too-few", ["serve-bench", "--arrivals", "{arrivals_few}"], "2 arrival times for 12 requests"),
    ("arrivals-backwards", ["serve-bench", "--arrivals", "{arrivals_back}"], "non-decreasing"),
    ("arrivals-days", ["serve-bench", "--arrivals", "{arrivals_far}"], "a served trace spans at most 3600 s"),
    ("rate-and-arrivals", ["serve-bench", "--rate", "2", "--arrivals", "{arrivals_few}"], "give one"),
    ("unknown-method", ["serve-bench", "--methods", "ar,bogus-d3"], "unknown drafter 'bogus'"),
    ("empty-mix", ["serve-bench", "--methods", "mix()"], "a mix needs at least one arm"),
    ("bad-mix", ["serve-bench", "--methods", "mix(ngram-d2"], "cannot read method"),
    ("method-twice", ["serve-bench", "--methods", "ar,ar"], "each method once"),
    ("workload-missing", ["serve-bench", "--workload", "{tmp}/q.jsonl"], "Spec-Bench"),
    ("out-under-a-file", ["serve-bench", "--out", "{blocker}/s"], "not a directory"),
]
SERVE_POLICIES = [
    (
        "serve-train-unknown-accelerator",
        ["serve-train", "--batch-cost", "roofline:tpu9/llama-3.1-8b"],
        "unknown accelerator",
    ),
    (
        "serve-train-unknown-model-size",
        ["serve-train", "--batch-cost", "roofline:h200/llama-99b"],
        "unknown model size",
    ),
    ("serve-train-cost-missing", ["serve-train", "--batch-cost", "{tmp}/none.json"], "does not exist"),
    # sizes each within its flag's range whose product the simulator cannot draw: refused before the folder
    (
        "serve-train-streams-too-many",
        ["serve-train", "--predictor-episodes", "4096", "--requests", "65536"],
        "--predictor-episodes x --requests: 4096 servers x 65536 requests each",
    ),
    (
        "serve-train-arm-twice",
        ["serve-train", "--arms", "none,ngram-d2,ngram-d2"],
        "lists ngram-d2 more than once",
    ),
    (
        "evaluate-serve-streams-too-many",
        [
            "evaluate",
            "--serve",
            "--no-live",
            "--episodes",
            "65536",
            "--requests",
            "65536",
            "--out",
            "{tmp}/e",
        ],
        "--episodes x --requests: 65536 servers",
    ),
    ("serve-train-cost-garbage", ["serve-train", "--batch-cost", "{garbage}"], "is not JSON"),
    ("serve-train-cost-pickle", ["serve-train", "--batch-cost", "{pickle}"], "is not JSON"),
    ("serve-train-unknown-arm", ["serve-train", "--arms", "none,bogus-d3"], "unknown drafter 'bogus'"),
    ("serve-train-no-arm", ["serve-train", "--arms", ","], "--arms names no arm"),
    (
        "evaluate-serve-poisson-inf",
        ["evaluate", "--serve", "--no-live", "--loads", "poisson@inf"],
        "the rate is a multiple of the unit rate in",
    ),
    (
        "evaluate-serve-poisson-tiny",
        ["evaluate", "--serve", "--no-live", "--loads", "poisson@1e-300"],
        "the rate is a multiple of the unit rate in",
    ),
    ("serve-train-trace-garbage", ["serve-train", "--trace", "{garbage}"], "trace"),
    (
        "evaluate-serve-unknown-load",
        ["evaluate", "--serve", "--no-live", "--loads", "1,huge"],
        "unknown load",
    ),
    (
        "evaluate-serve-load-too-big",
        ["evaluate", "--serve", "--no-live", "--loads", "64"],
        "concurrency must be in",
    ),
    ("evaluate-serve-policy-garbage", ["evaluate", "--serve", "--no-live", "{garbage}"], "garbage"),
    (
        "evaluate-serve-policy-stem-twice",
        ["evaluate", "--serve", "--no-live", "{tmp}/a/ppo.zip", "{tmp}/b/ppo.zip"],
        "would be named 'ppo'",
    ),
    (
        "evaluate-serve-policy-oracle",
        ["evaluate", "--serve", "--no-live", "{tmp}/oracle.zip"],
        "named 'oracle'",
    ),
    (
        "evaluate-json-over-a-policy",
        ["evaluate", "--no-live", "--json", "{policy_truncated}"],
        "not a JSON file",
    ),
    (
        "evaluate-json-is-an-input",
        ["evaluate", "--no-live", "{garbage}", "--json", "{garbage}"],
        "also an input",
    ),
    ("serve-train-max-batch-huge", ["serve-train", "--max-batch", "1000000000000"], "must be in [1, 4096]"),
    ("generate-policy-device", ["generate", "hi", "--policy", "/dev/zero"], "not a regular file"),
    ("serve-bench-arrivals-device", ["serve-bench", "--arrivals", "/dev/zero"], "not a regular file"),
    (
        "evaluate-serve-cost-garbage",
        ["evaluate", "--serve", "--no-live", "--batch-cost", "{garbage}"],
        "is not JSON",
    ),
    ("serve-bench-policy-garbage", ["serve-bench", "--policy", "{garbage}"], "garbage"),
    (
        "serve-bench-policy-typed",
        ["serve-bench", "--methods", "ar,policy:nothere"],  # a ZeroDivisionError mid-run
        "--methods policy:nothere: a serving policy is served through --policy FILE",
    ),
    (
        "serve-bench-policy-twice",
        [
            "serve-bench",
            "--policy",
            str(ROOT / "policies/data/serve/smartspec.zip"),
            "--policy",
            str(ROOT / "policies/data/serve/smartspec.zip"),
        ],
        "another --policy file is named policy:smartspec too",
    ),
]
CASES = [*(("serve-bench-" + i, a, n) for i, a, n in SERVE), *SERVE_POLICIES]


@pytest.mark.parametrize("argv, needle", [pytest.param(a, n, id=i) for i, a, n in CASES])
def test_bad_input_is_one_line_and_exit_2(argv, needle, files, tmp_path, capsys, monkeypatch):
    check(expand(argv, files, tmp_path), needle, files, tmp_path, capsys, monkeypatch)


@pytest.mark.parametrize("value", ["x", [16], 0])
def test_a_serving_policy_whose_max_batch_is_malformed_is_refused(tmp_path, capsys, value):
    """``serve-bench --policy`` reads the batch size a serving policy was trained for from its meta: checked as
    ``evaluate --serve`` checks it, one line and exit 2, not an int() traceback."""
    from experiments.cli import main
    from policies import load_policy

    pol = load_policy(ROOT / "policies" / "data" / "serve" / "smartspec.zip")
    pol.meta = {**pol.meta, "max_batch": value}
    pol.save(tmp_path / "p.zip")
    assert main(["serve-bench", "--policy", str(tmp_path / "p.zip"), "--out", str(tmp_path / "o")]) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and "meta.max_batch is not a positive integer" in err[0], err


def test_serving_policies_of_two_max_batches_are_refused_together(tmp_path, capsys):
    from experiments.cli import main
    from policies import load_policy

    for name, size in (("a", 16), ("b", 8)):
        pol = load_policy(ROOT / "policies" / "data" / "serve" / "smartspec.zip")
        pol.meta = {**pol.meta, "max_batch": size}
        pol.save(tmp_path / f"{name}.zip")
    argv = ["evaluate", "--serve", "--no-live", str(tmp_path / "a.zip"), str(tmp_path / "b.zip")]
    assert main([*argv, "--out", str(tmp_path / "o")]) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and "b: trained for a max batch of 8, a for 16" in err[0], err
    assert not (tmp_path / "o").exists()
