"""The bad-input suite (``tests/experiments/bad_input.py``): ``train-drafter``, and the cases of every
command whose input is found bad only once the embedded model is loaded."""

from __future__ import annotations

import pytest

from tests.experiments.bad_input import check, expand

TRAIN_DRAFTER = [
    ("kind", ["train-drafter", "medusa"], "invalid choice"),
    ("eagle3-levels-zero", ["train-drafter", "eagle3", "--levels", "0"], "must be in [1, 64]"),
    ("eagle3-levels-huge", ["train-drafter", "eagle3", "--levels", "100000"], "must be in [1, 64]"),
    # unbounded, they ran past every timeout or failed after the data was made
    (
        "steps-huge",
        ["train-drafter", "eagle", "--steps", str(2**63 - 1)],
        "--steps: must be in [0, 16777216]",
    ),
    ("answer-repeat-huge", ["train-drafter", "eagle", "--answer-repeat", "10000"], "must be in [1, 1000]"),
    # a name the temporary file would take past 255 bytes: a traceback after the training
    (
        "out-name-too-long",
        ["train-drafter", "eagle", "--exclude-per-category", "0", "--out", "{tmp}/" + "a" * 240],
        "its file name is 252 bytes",
    ),
    ("eagle3-text-negative", ["train-drafter", "eagle3", "--text-tokens", "-5"], "must be >= 0"),
    ("cpu-minutes-zero", ["train-drafter", "eagle", "--cpu-minutes", "0"], "--cpu-minutes: must be in"),
    ("cpu-minutes-negative", ["train-drafter", "eagle", "--cpu-minutes", "-1"], "--cpu-minutes: must be in"),
    ("lr-zero", ["train-drafter", "eagle", "--lr", "0"], "--lr: must be in"),
    ("prompt-frac", ["train-drafter", "eagle", "--prompt-frac", "2"], "--prompt-frac: must be in"),
    ("answer-repeat", ["train-drafter", "eagle3", "--answer-repeat", "0"], "--answer-repeat: must be"),
    ("per-category-zero", ["train-drafter", "eagle", "--per-category", "0"], "must be >= 1"),
    ("exit-layer-zero", ["train-drafter", "early_exit", "--exit-layer", "0"], "must be >= 1"),
    ("capture-layers", ["train-drafter", "eagle", "--capture-layers", "a,b"], "--capture-layers must be"),
    (
        "out-under-a-file",
        ["train-drafter", "eagle", "--exclude-per-category", "0", "--out", "{blocker}/h"],
        "not a directory",
    ),
    (
        "work-under-a-file",
        ["train-drafter", "eagle", "--exclude-per-category", "0", "--work", "{blocker}/w"],
        "not a directory",
    ),
    ("workload-missing", ["train-drafter", "eagle", "--workload", "{tmp}/q.jsonl"], "Spec-Bench"),
    (
        "workload-empty",
        ["train-drafter", "eagle", "--workload", "{empty}", "--work", "{tmp}/w"],
        "has no prompts",
    ),
    ("builtin-all-excluded", ["train-drafter", "eagle", "--work", "{tmp}/w"], "pass --workload"),
    (
        "eagle3-window",
        ["train-drafter", "eagle3", "--window", "100"],
        "--window is for eagle and early_exit heads",
    ),
    (
        "eagle-batch",
        ["train-drafter", "eagle", "--batch", "4"],
        "--batch is for eagle3 heads; eagle does not",
    ),
]
# cases that load the embedded model before the input is found to be bad
BENCH_ONE = [
    "bench",
    "--limit",
    "1",
    "--dtype",
    "fp32",
    "--out",
    "{tmp}/run",
]  # one prompt, fp32, a fresh folder
MODEL = [
    (
        "train-drafter-new-tokens-past-context",  # eagle3's corpus refused it; eagle's generation ran on for ever
        [
            "train-drafter",
            "eagle",
            "--exclude-per-category",
            "0",
            "--max-new-tokens",
            "1048576",
            "--work",
            "{tmp}/w",
            "--out",
            "{tmp}/h",
        ],
        "leaves no room for a prompt in the target's 8192-token context",
    ),  # fmt: skip
    (
        "generate-prompt-longer-than-context",
        ["generate", "--prompt-file", "{long}", "--dtype", "fp32"],
        "context is",
    ),
    (
        "bench-prompt-longer-than-context",
        ["bench", "--workload", "{jsonl_long}", "--methods", "ar", "--dtype", "fp32", "--out", "{tmp}/run"],
        "context is",
    ),
    (
        "record-prompt-longer-than-context",
        ["record", "--workload", "{jsonl_long}", "--out", "{tmp}/t.npz"],
        "context is",
    ),
    (
        "serve-bench-kv-budget-too-small",
        ["serve-bench", "--kv-budget", "50", "--limit", "1", "--dtype", "fp32", "--out", "{tmp}/s"],
        "too small for one request",
    ),
    (
        "serve-bench-prompt-longer-than-context",
        ["serve-bench", "--workload", "{jsonl_long}", "--dtype", "fp32", "--out", "{tmp}/s"],
        "context is",
    ),
    # a head file that is not there (or not one) is found when the heads load: before the run folder holds anything
    (
        "bench-head-missing",
        [*BENCH_ONE, "--methods", "eagle3-d2", "--drafter-option", 'eagle3.weights="{tmp}/nohead"'],
        "no eagle3 head at",
    ),
    (
        "bench-hybrid-head-not-one",
        [
            *BENCH_ONE,
            "--methods",
            "hybrid-d2",
            "--drafter-option",
            'hybrid.options={eagle3={weights="{badhead}"}}',
        ],
        "badhead.json is not a draftgym head description",
    ),  # fmt: skip
]

CASES = [("train-drafter-" + i, a, n) for i, a, n in TRAIN_DRAFTER]


@pytest.mark.parametrize("argv, needle", [pytest.param(a, n, id=i) for i, a, n in CASES])
def test_bad_input_is_one_line_and_exit_2(argv, needle, files, tmp_path, capsys, monkeypatch):
    check(expand(argv, files, tmp_path), needle, files, tmp_path, capsys, monkeypatch)


@pytest.mark.model
@pytest.mark.parametrize("argv, needle", [pytest.param(a, n, id=i) for i, a, n in MODEL])
def test_bad_input_found_after_loading_the_model(argv, needle, files, tmp_path, capsys, monkeypatch):
    check(expand(argv, files, tmp_path), needle, files, tmp_path, capsys, monkeypatch, folders=True)
