"""The bad-input suite (``tests/experiments/bad_input.py``): the config commands (``run``, ``sweep``,
``train``), the readers of results (``report``, ``agreement``) and the commands that read policy files
(``evaluate``, ``oracle-gap``)."""

from __future__ import annotations

import pytest

from tests.experiments.bad_input import CONFIGS, ROOT, check, expand

CONFIG_COMMANDS = [
    (f"{cmd}-{name}", [cmd, *args], needle)
    for cmd in ("run", "sweep", "train")
    for name, args, needle in [
        ("missing", ["{tmp}/nope.toml"], "does not exist"),
        ("directory", ["{dir}"], "is a directory"),
        ("not-utf8", ["{bin}"], "not UTF-8"),
        ("garbage", ["{toml_garbage}"], "not valid TOML"),
        ("unknown-key", ["{toml_unknown}"], "did you mean 'max_new_tokens'"),
        ("wrong-type", ["{toml_type}"], "decode.max_new_tokens must be"),
        ("set-unknown-key", [str(CONFIGS / "bandit.toml"), "--set", "decode.nope=1"], "nope"),
        ("set-seed-negative", [str(CONFIGS / "bandit.toml"), "--set", "seed=-1"], "seed"),
        (
            "set-nested-too-deep",
            [str(CONFIGS / "bandit.toml"), "--set", "decode.max_new_tokens=" + "{a=" * 400 + "1" + "}" * 400],
            "--set decode.max_new_tokens: the value nests too deep",
        ),
        (
            "set-temperature-tiny",
            [str(CONFIGS / "bandit.toml"), "--set", "decode.temperature=1e-39"],
            "temperature",
        ),
        ("set-no-equals", [str(CONFIGS / "bandit.toml"), "--set", "decode.max_new_tokens"], "KEY=VALUE"),
        (  # the second key past the line break was dropped unread
            "set-two-values",
            [str(CONFIGS / "bandit.toml"), "--set", "decode.max_new_tokens=16\nseed=3"],
            "more than one TOML value",
        ),
        (
            "set-out-of-range",
            [str(CONFIGS / "bandit.toml"), "--set", "decode.max_new_tokens=-4"],
            "max_new_tokens",
        ),
    ]
]
RUN_SWEEP_TRAIN = [
    (
        "run-out-under-a-file",
        ["run", str(CONFIGS / "bandit.toml"), "--out", "{blocker}/r"],
        "not a directory",
    ),
    ("run-unknown-method", ["run", "{toml_nopolicy}", "--set", 'methods=["bogus-d2"]'], "unknown drafter"),
    (
        "sweep-out-under-a-file",
        ["sweep", str(CONFIGS / "tree_sweep.toml"), "--out", "{blocker}/s"],
        "not a directory",
    ),
    (
        "sweep-workers-zero",
        ["sweep", str(CONFIGS / "tree_sweep.toml"), "--workers", "0"],
        "--workers: must be >= 1",
    ),
    (
        "sweep-workers-huge",  # one process each: 999999 of them hung the machine
        ["sweep", str(CONFIGS / "tree_sweep.toml"), "--workers", "999999"],
        "per CPU core",
    ),
    (
        "sweep-workers-negative",
        ["sweep", str(CONFIGS / "tree_sweep.toml"), "--workers", "-3"],
        "must be >= 1",
    ),
    (
        "sweep-storage",
        ["sweep", str(CONFIGS / "tree_sweep.toml"), "--storage", "bogus://x", "--out", "{tmp}/s"],
        "storage",
    ),
    ("train-live-backend", ["train", "{toml_live}", "--out", "{tmp}/t"], "backend"),
    ("train-no-policies", ["train", "{toml_nopolicy}", "--out", "{tmp}/t"], "no [policies.NAME]"),
    ("train-empty-config", ["train", "{empty}", "--out", "{tmp}/t"], "no [policies.NAME]"),
    (
        "train-timesteps-huge",  # it never ended
        [
            "train",
            str(CONFIGS / "bandit.toml"),
            "--set",
            "policies.ucb1.train.total_timesteps=9223372036854775807",
            "--out",
            "{tmp}/t",
        ],
        "total_timesteps must be <= 1099511627776",
    ),  # fmt: skip
    (
        "train-unknown-policy",
        ["train", str(CONFIGS / "bandit.toml"), "--policy", "nope", "--out", "{tmp}/t"],
        "no [policies.nope]",
    ),
    (
        "train-out-under-a-file",
        ["train", str(CONFIGS / "bandit.toml"), "--out", "{blocker}/t"],
        "not a directory",
    ),
    (
        "run-workload-missing",
        [
            "run",
            str(CONFIGS / "bandit.toml"),
            "--set",
            'workload.path="{tmp}/nope.jsonl"',
            "--out",
            "{tmp}/r",
        ],
        "does not exist",
    ),
    (
        "sweep-trace-missing",
        [
            "sweep",
            str(CONFIGS / "tree_sweep.toml"),
            "--set",
            'sweep.backend="replay"',
            "--set",
            'sweep.trace="{tmp}/nope.npz"',
            "--out",
            "{tmp}/s",
        ],
        "does not exist",
    ),  # fmt: skip
    ("train-two-policies-one-file", ["train", "{toml_twoout}", "--out", "{tmp}/t"], "both be saved to"),
    (
        "train-ppo-batch-size-one",
        ["train", str(CONFIGS / "ppo.toml"), "--set", "policies.ppo.params.batch_size=1", "--out", "{tmp}/t"],
        "batch_size must be an integer in [2",
    ),
    (
        "train-predictor-hidden-negative",
        [
            "train",
            str(CONFIGS / "policies.toml"),
            "--policy",
            "predictor",
            "--set",
            "policies.predictor.params.hidden=-1",
            "--out",
            "{tmp}/t",
        ],
        "predictor hidden",
    ),  # fmt: skip
    (
        "train-name-nul",
        ["train", str(CONFIGS / "bandit.toml"), "--set", 'name="a\\u0000b"', "--out", "{tmp}/t"],
        "NUL character",
    ),
]
READERS = [
    ("report-missing", ["report", "{tmp}/none"], "is not a directory"),
    ("report-default-out-missing-dir", ["report", "{tmp}/none", "{tmp}/other"], "is not a directory"),
    ("report-file", ["report", "{garbage}"], "is not a directory"),
    ("report-empty-dir", ["report", "{tmp}"], "is not a run directory"),
    ("agreement-missing", ["agreement", "{tmp}/none"], "no bench.json"),
    ("agreement-empty-dir", ["agreement", "{tmp}"], "no bench.json"),
    ("agreement-eps-negative", ["agreement", "{tmp}", "--eps", "-1"], "--eps: must be in"),
    ("report-summary-garbage", ["report", "{run_garbage}"], "is not readable JSON"),
    ("report-summary-list", ["report", "{run_list}"], "not a draftgym result (no valid name"),
    ("report-summary-no-settings", ["report", "{run_nosettings}"], "no valid settings"),
    ("report-sweep-not-utf8", ["report", "{sweep_garbage}"], "is not readable JSON"),
    ("report-sweep-no-best", ["report", "{sweep_nobest}"], "not a draftgym result this report can read"),
    ("agreement-bench-garbage", ["agreement", "{bench_garbage}"], "is not a bench result"),
    ("agreement-bench-no-settings", ["agreement", "{bench_nosettings}"], "is not a bench result"),
    # it said "has no hf_greedy records to compare with"
    ("agreement-no-records", ["agreement", "{bench_norecords}"], "records.jsonl does not exist"),
]
POLICY_FILES = [
    ("evaluate-policy-missing", ["evaluate", "{tmp}/p.zip", "--no-live"], "does not exist"),
    ("evaluate-policy-not-zip", ["evaluate", "{bin}", "--no-live"], "not a readable draftgym policy"),
    ("evaluate-policy-pickle", ["evaluate", "{pickle}", "--no-live"], "not a readable draftgym policy"),
    ("evaluate-policy-hostile", ["evaluate", "{policy_pickle}", "--no-live"], "cannot restore"),
    ("evaluate-trace-not-npz", ["evaluate", "--trace", "{bin}", "--no-live"], "not a draftgym trace"),
    ("evaluate-trace-pickle", ["evaluate", "--trace", "{pickle}", "--no-live"], "not a draftgym trace"),
    ("evaluate-trace-hostile", ["evaluate", "--trace", "{npzpickle}", "--no-live"], "not a readable trace"),
    ("evaluate-trace-truncated", ["evaluate", "--trace", "{trace_truncated}", "--no-live"], "trace"),
    ("evaluate-cost-not-utf8", ["evaluate", "--cost-model", "{bin}", "--no-live"], "is not JSON"),
    ("evaluate-cost-pickle", ["evaluate", "--cost-model", "{pickle}", "--no-live"], "is not JSON"),
    ("evaluate-cost-truncated", ["evaluate", "--cost-model", "{cost_truncated}", "--no-live"], "is not JSON"),
    (
        "evaluate-cost-json-list",
        ["evaluate", "--cost-model", "{jsonlist}", "--no-live"],
        "not a draftgym cost model",
    ),
    ("evaluate-test-zero", ["evaluate", "--test-per-category", "0", "--no-live"], "must be >= 1"),
    ("evaluate-limit-zero", ["evaluate", "--limit", "0"], "--limit: must be >= 1"),
    (
        "evaluate-json-under-a-file",
        ["evaluate", "--no-live", "--json", "{blocker}/e.json"],
        "not a directory",
    ),
    ("oracle-gap-trace-empty", ["oracle-gap", "--trace", "{empty}"], "not a draftgym trace"),
    ("oracle-gap-trace-hostile", ["oracle-gap", "--trace", "{npzpickle}"], "not a readable trace"),
    ("oracle-gap-cost-empty", ["oracle-gap", "--cost-model", "{empty}"], "is not JSON"),
    ("oracle-gap-cost-pickle", ["oracle-gap", "--cost-model", "{pickle}"], "is not JSON"),
    ("oracle-gap-unknown-arm", ["oracle-gap", "--arms", "none,bogus-d3"], "unknown drafter"),
    ("oracle-gap-no-arm", ["oracle-gap", "--arms", ","], "names no drafting arm"),
    ("oracle-gap-none-only", ["oracle-gap", "--arms", "none"], "names no drafting arm"),
    ("oracle-gap-test-zero", ["oracle-gap", "--test-per-category", "0"], "must be >= 1"),
    ("oracle-gap-json-under-a-file", ["oracle-gap", "--json", "{blocker}/o.json"], "not a directory"),
]
CASES = [*CONFIG_COMMANDS, *RUN_SWEEP_TRAIN, *READERS, *POLICY_FILES]


@pytest.mark.parametrize("argv, needle", [pytest.param(a, n, id=i) for i, a, n in CASES])
def test_bad_input_is_one_line_and_exit_2(argv, needle, files, tmp_path, capsys, monkeypatch):
    check(expand(argv, files, tmp_path), needle, files, tmp_path, capsys, monkeypatch)


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [("split", "x", "meta.split is not an object"), ("trace", 7, "meta.trace is not a string"),
     ("cost_model", ["a"], "meta.cost_model is not a string"), ("max_batch", 0, "meta.max_batch"),
     ("split", {"train": [], "test": "p1"}, "meta.split.test is not a list"),
     ("split", {"train": [], "test": [], "seed": "1"}, "meta.split.seed")],
)  # fmt: skip
def test_a_policy_whose_training_record_is_malformed_is_refused(tmp_path, capsys, field, value, needle):
    """``evaluate`` reads the trace, cost model and prompt split a policy was trained with from its meta: a wrong
    type there is one line and exit 2, not a traceback."""
    from experiments.cli import main
    from policies import load_policy

    pol = load_policy(ROOT / "policies" / "data" / "ucb1.zip")
    pol.meta = {**pol.meta, field: value}
    pol.save(tmp_path / "p.zip")
    assert main(["evaluate", str(tmp_path / "p.zip"), "--no-live"]) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and needle in err[0], err
