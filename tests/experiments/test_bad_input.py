"""The bad-input suite (``tests/experiments/bad_input.py``): ``generate``, ``bench``, ``record`` and
``calibrate`` given missing, garbage and out-of-range arguments and damaged or hostile files, outputs that are no
regular file, and the command line itself; and the check that every command has cases in one of the suite's files."""

from __future__ import annotations

import pytest

from tests.experiments.bad_input import CONFIGS, MARKER, ROOT, check, expand, payload

# (case id, arguments, needle). Arguments may name {file keys}; {tmp} is the case's own empty folder.
GENERATE = [
    ("empty-prompt", ["generate", ""], "prompt is empty"),
    ("blank-prompt", ["generate", "   \n"], "prompt is empty"),
    ("no-prompt-stdin-empty", ["generate", "-"], "prompt is empty"),
    ("temperature-negative", ["generate", "hi", "--temperature", "-1"], "--temperature: must be in"),
    ("temperature-nan", ["generate", "hi", "--temperature", "nan"], "--temperature: must be in"),
    ("temperature-huge", ["generate", "hi", "--temperature", "1e300"], "--temperature: must be in"),
    ("temperature-garbage", ["generate", "hi", "--temperature", "hot"], "expected a number"),
    ("top-p-zero", ["generate", "hi", "--top-p", "0"], "--top-p: must be in (0, 1]"),
    ("top-p-above-one", ["generate", "hi", "--top-p", "1.5"], "--top-p: must be in (0, 1]"),
    ("top-k-negative", ["generate", "hi", "--top-k", "-2"], "--top-k: must be >= 0"),
    ("depth-zero", ["generate", "hi", "--depth", "0"], "--depth: must be >= 1"),
    # Python's int() reads "4_0" as 40 and other scripts' digits as digits
    ("max-new-underscore", ["generate", "hi", "--max-new-tokens", "4_0"], "expected an integer, got '4_0'"),
    ("max-new-arabic-indic", ["generate", "hi", "--max-new-tokens", "\u0664"], "expected an integer"),
    ("seed-underscore", ["generate", "hi", "--seed", "1_000"], "expected an integer, got '1_000'"),
    ("depth-negative", ["generate", "hi", "--depth", "-5"], "--depth: must be >= 1"),
    ("depth-garbage", ["generate", "hi", "--depth", "deep"], "expected an integer"),
    ("topk-zero", ["generate", "hi", "--topk", "0"], "--topk: must be >= 1"),
    ("budget-negative", ["generate", "hi", "--budget", "-1"], "--budget: must be >= 0"),
    # a k-ary tree's drafter sizes its buffers by the budget: eagle asked for 150 TB
    (
        "budget-huge",
        ["generate", "hi", "--drafter", "eagle", "--budget", "99999999999"],
        "budget must be <= 4096",
    ),
    ("max-new-zero", ["generate", "hi", "--max-new-tokens", "0"], "--max-new-tokens: must be >= 1"),
    ("max-new-huge", ["generate", "hi", "--max-new-tokens", "99999999999"], "--max-new-tokens: must be <="),
    ("seed-garbage", ["generate", "hi", "--seed", "x"], "--seed"),
    ("seed-negative", ["generate", "hi", "--seed", "-1"], "--seed: must be in [0, 2**32 - 1]"),
    ("seed-huge", ["generate", "hi", "--seed", str(2**32)], "--seed: must be in [0, 2**32 - 1]"),
    ("temperature-tiny", ["generate", "hi", "--temperature", "1e-39"], "must be 0 (greedy) or >= 0.001"),
    (
        "depth-huge",
        ["generate", "hi", "--drafter", "ngram", "--depth", "100000000"],
        "tree depth must be <= 256",
    ),
    (
        "topk-huge",
        ["generate", "hi", "--drafter", "ngram", "--depth", "2", "--topk", "1000"],
        "tree topk must be <= 64",
    ),
    ("generate-policy-missing", ["generate", "hi", "--policy", "{tmp}/p.zip"], "does not exist"),
    ("unknown-drafter", ["generate", "hi", "--drafter", "bogus"], "known drafters:"),
    (
        "none-with-depth",
        ["generate", "hi", "--drafter", "none", "--depth", "3"],
        "--drafter none drafts nothing",
    ),
    ("dtype", ["generate", "hi", "--dtype", "fp16"], "invalid choice"),
    ("abbreviated-option", ["generate", "--prompt", "a" * 5000], "unrecognized arguments: --prompt"),
    ("prompt-and-file", ["generate", "hi", "--prompt-file", "{garbage}"], "not both"),
    ("prompt-file-missing", ["generate", "--prompt-file", "{tmp}/nope.txt"], "does not exist"),
    ("prompt-file-empty", ["generate", "--prompt-file", "{empty}"], "prompt is empty"),
    ("prompt-file-not-utf8", ["generate", "--prompt-file", "{bin}"], "not UTF-8"),
    ("prompt-file-directory", ["generate", "--prompt-file", "{dir}"], "is a directory"),
    (
        "prompt-file-fifo",
        ["generate", "--prompt-file", "{fifo}"],
        "is not a regular file",
    ),  # "does not exist"
    (
        "prompt-file-too-long",
        ["generate", "--prompt-file", "{long_prompt}"],
        "is 1,048,577 characters or more",
    ),
    # --topk or --budget alone shape the default drafter's tree: they were dropped unchecked
    ("topk-alone-huge", ["generate", "hi", "--topk", "100000"], "tree topk must be <= 64"),
    ("budget-alone-huge", ["generate", "hi", "--budget", "99999999999"], "tree budget must be <= 4096"),
    ("prompt-file-name-too-long", ["generate", "--prompt-file", "x" * 5000], "File name too long"),
    ("model-missing", ["generate", "hi", "--model", "{tmp}/no-model"], "does not exist"),
    ("model-not-a-model", ["generate", "hi", "--model", "{dir}"], "config.json"),
    ("model-config-str", ["generate", "hi", "--model", "{model_hidden_str}"], "hidden_size is '576'"),
    (
        "model-config-zero-heads",
        ["generate", "hi", "--model", "{model_heads_zero}"],
        "num_attention_heads is 0",
    ),
    (
        "model-config-layers",
        ["generate", "hi", "--model", "{model_layers_negative}"],
        "num_hidden_layers is -1",
    ),
    ("model-config-eps", ["generate", "hi", "--model", "{model_eps_str}"], "rms_norm_eps is 'x'"),
    ("model-config-kv", ["generate", "hi", "--model", "{model_kv_split}"], "do not split into 3 KV heads"),
    ("policy-missing", ["generate", "hi", "--policy", "{tmp}/p.zip"], "does not exist"),
    ("policy-directory", ["generate", "hi", "--policy", "{dir}"], "is a directory, not a file"),
    ("policy-not-zip", ["generate", "hi", "--policy", "{bin}"], "not a readable draftgym policy"),
    ("policy-empty", ["generate", "hi", "--policy", "{empty}"], "not a readable draftgym policy"),
    ("policy-truncated", ["generate", "hi", "--policy", "{policy_truncated}"], "policy"),
    ("policy-pickle", ["generate", "hi", "--policy", "{pickle}"], "not a readable draftgym policy"),
    ("policy-hostile-member", ["generate", "hi", "--policy", "{policy_pickle}"], "cannot restore"),
    ("device", ["generate", "hi", "--device", "tpu:7"], "device"),
    ("device-cuda-absent", ["generate", "hi", "--device", "cuda:99"], "CUDA device"),
    ("device-unsupported", ["generate", "hi", "--device", "meta"], "is not supported"),
]
BENCH = [
    ("per-category-zero", ["bench", "--per-category", "0"], "--per-category: must be >= 1"),
    ("per-category-negative", ["bench", "--per-category", "-1"], "--per-category: must be >= 1"),
    ("limit-zero", ["bench", "--limit", "0"], "--limit: must be >= 1"),
    ("max-new-zero", ["bench", "--max-new-tokens", "0"], "--max-new-tokens: must be >= 1"),
    ("unknown-arm-drafter", ["bench", "--methods", "bogus-d3"], "unknown drafter 'bogus'"),
    ("unreadable-arm", ["bench", "--methods", "ngram-dX"], "cannot read arm"),
    ("arm-without-depth", ["bench", "--methods", "ngram-k2"], "has no depth"),
    ("arm-too-wide", ["bench", "--methods", "ngram-d256-k64"], "tree nodes must be <= 4096, got 16384"),
    (
        "policies-of-one-name",
        [
            "bench",
            "--methods",
            "ar",
            "--policy",
            str(ROOT / "policies/data/ppo.zip"),
            "--policy",
            "{tmp}/ppo.zip",
        ],
        "two methods would be named policy:ppo",
    ),
    ("arm-depth-zero", ["bench", "--methods", "ngram-d0"], "depth must be >= 1"),
    ("arm-budget-huge", ["bench", "--methods", "eagle-d3-b99999999"], "tree budget must be <= 4096"),
    ("method-twice", ["bench", "--methods", "ar,ar"], "lists a method twice"),
    ("device-arm-unknown", ["bench", "--methods", "device:ngram-d3"], "unknown device-loop arm 'ngram-d3'"),
    ("no-method", ["bench", "--methods", ",,"], "names no method"),
    ("methods-empty", ["bench", "--methods", ""], "--methods is given an empty value ('')"),
    # a blank value read as "left out" would start a fresh default run folder or drop a policy silently
    ("out-empty", ["bench", "--out", "", "--methods", "ar"], "--out is given an empty value ('')"),
    ("out-blank", ["bench", "--out", " ", "--methods", "ar"], "--out is given an empty value (' ')"),
    ("policy-blank", ["bench", "--methods", "ar", "--policy", "\t"], "--policy is given an empty value"),
    ("workload-missing", ["bench", "--workload", "{tmp}/q.jsonl"], "hemingkx/Spec-Bench"),
    ("workload-not-utf8", ["bench", "--workload", "{bin}"], "not UTF-8"),
    ("workload-empty", ["bench", "--workload", "{empty}"], "has no prompts"),
    ("workload-directory", ["bench", "--workload", "{dir}"], "is a directory"),
    ("workload-garbage", ["bench", "--workload", "{garbage}"], "not a Spec-Bench question line"),
    ("workload-code-unknown", ["bench", "--workload", "code:no_such_package_here"], "is not installed"),
    ("workload-json-list", ["bench", "--workload", "{jsonlist}"], "not a Spec-Bench question line"),
    ("workload-no-turns", ["bench", "--workload", "{jsonl_noturns}"], "not a Spec-Bench question line"),
    ("workload-empty-turn", ["bench", "--workload", "{jsonl_emptyturn}"], "first turn is empty"),
    ("out-under-a-file", ["bench", "--out", "{blocker}/run", "--methods", "ar"], "not a directory"),
    ("out-is-a-file", ["bench", "--out", "{blocker}", "--methods", "ar"], "is a file"),
    ("drafter-option-unknown", ["bench", "--drafter-option", "bogus.x=1"], "'bogus' is not a drafter"),
    ("drafter-option-bad-name", ["bench", "--drafter-option", "eagle3.depth=2"], "not an option of eagle3"),
    (
        "drafter-option-bad-value",
        ["bench", "--drafter-option", "eagle3.vocab=-5"],
        "vocab must be an integer",
    ),
    ("drafter-option-no-value", ["bench", "--drafter-option", "ngram.max_depth"], "NAME.OPTION=VALUE"),
    (
        "drafter-option-two-values",
        ["bench", "--drafter-option", "ngram.max_depth=1\nmax_ngram=2"],
        "--drafter-option ngram.max_depth: the value is more than one TOML value",
    ),
    (
        "drafter-option-nested-too-deep",
        ["bench", "--drafter-option", "hybrid.options=" + "{a=" * 400 + "1" + "}" * 400],
        "--drafter-option hybrid.options: the value nests too deep",
    ),
    (
        "policy-not-zip",
        ["bench", "--policy", "{bin}", "--out", "{tmp}/run"],
        "not a readable draftgym policy",
    ),
]
RECORD = [
    ("out-under-a-file", ["record", "--out", "{blocker}/t.npz", "--limit", "1"], "not a directory"),
    ("out-exists", ["record", "--out", "{garbage}"], "already exists"),
    ("out-directory", ["record", "--out", "{dir}"], "is a directory"),
    ("max-new-one", ["record", "--out", "{tmp}/t.npz", "--max-new-tokens", "1"], "must be >= 2"),
    ("max-new-negative", ["record", "--out", "{tmp}/t.npz", "--max-new-tokens", "-3"], "must be >= 1"),
    ("per-category-zero", ["record", "--out", "{tmp}/t.npz", "--per-category", "0"], "must be >= 1"),
    ("limit-zero", ["record", "--out", "{tmp}/t.npz", "--limit", "0"], "must be >= 1"),
    ("unknown-drafter", ["record", "--out", "{tmp}/t.npz", "--drafters", "ngram,nope"], "unknown drafter"),
    (
        "drafter-twice",
        ["record", "--out", "{tmp}/t.npz", "--drafters", "ngram,suffix,ngram"],
        "lists ngram more than once",
    ),
    ("workload-not-utf8", ["record", "--out", "{tmp}/t.npz", "--workload", "{bin}"], "not UTF-8"),
    ("no-out", ["record"], "--out"),
]
CALIBRATE = [
    ("reps-zero", ["calibrate", "--reps", "0"], "--reps: must be in [1, 10000]"),
    ("reps-huge", ["calibrate", "--reps", str(2**63 - 1)], "--reps: must be in [1, 10000]"),  # ran for ever
    # a model's config.json is JSON: it was replaced by the cost model
    ("out-in-the-model", ["calibrate", "--model", "{tmp}/m", "--out", "{tmp}/m/config.json"], "is inside"),
    ("reps-huge-garbage", ["calibrate", "--reps", "1e99"], "expected an integer"),
    ("unknown-drafter", ["calibrate", "--drafters", "ngram,nope"], "unknown drafter 'nope'"),
    ("drafters-blank", ["calibrate", "--drafters", ", ,"], "--drafters names no drafter"),  # ran as none
    ("drafter-twice", ["calibrate", "--batch", "--drafters", "ngram,ngram"], "lists ngram more than once"),
    ("out-under-a-file", ["calibrate", "--out", "{blocker}/c.json"], "not a directory"),
    ("out-directory", ["calibrate", "--out", "{dir}"], "is a directory"),
]
OUTPUTS = [
    ("evaluate-json-fifo", ["evaluate", str(ROOT / "policies" / "data" / "best-static.zip"), "--no-live", "--json", "{fifo}"],
     "is not a regular file"),
    ("record-out-fifo", ["record", "--limit", "1", "--max-new-tokens", "4", "--out", "{fifo}"], "is not a regular file"),
    ("train-drafter-out-not-a-head", ["train-drafter", "eagle", "--exclude-per-category", "0", "--out", "{victim}"],
     "is not a draftgym head"),
    ("train-drafter-out-a-folder", ["train-drafter", "eagle", "--exclude-per-category", "0", "--out", "{dir}"],
     "is a directory"),
    ("train-n-envs-huge", ["train", "{toml_nenvs}"], "n_envs"),
    ("bench-workload-fifo", ["bench", "--workload", "{fifo}", "--limit", "1"], "is not a regular file"),
    ("run-config-fifo", ["run", "{fifo}"], "is not a regular file (a fifo"),
    ("bench-category-breaks-tables", ["bench", "--workload", "{jsonl_tablecat}", "--limit", "1"],
     "holds a control character or '|'"),
    ("serve-bench-rate-tiny", ["serve-bench", "--limit", "2", "--methods", "ar", "--rate", "1e-6"],
     "a served stream spans at most 3600 s"),
    ("bench-json-a-folder", ["bench", "--limit", "1", "--methods", "ar", "--out", "{out_benchjson_dir}"],
     "bench.json is not a regular file"),
    ("run-summary-a-folder", ["run", str(CONFIGS / "bandit.toml"), "--out", "{out_summary_dir}"],
     "summary.json is not a regular file"),
    ("run-plots-a-file", ["run", str(CONFIGS / "bandit.toml"), "--out", "{out_plots_file}"], "plots is not a folder"),
    ("serve-bench-out-empty", ["serve-bench", "--limit", "1", "--methods", "ar", "--out", ""], "--out is given an empty"),
    ("evaluate-json-empty", ["evaluate", str(ROOT / "policies" / "data" / "best-static.zip"), "--no-live", "--json", ""],
     "--json is given an empty value"),
    ("record-out-empty", ["record", "--limit", "1", "--out", ""], "--out is given an empty value"),
    ("run-out-blank", ["run", str(CONFIGS / "bandit.toml"), "--out", "  "], "--out is given an empty value"),
]  # fmt: skip
TOP = [
    ("no-command", [], "required"),
    ("unknown-command", ["serve"], "invalid choice"),
    ("abbreviated-command-option", ["bench", "--method", "ar"], "unrecognized arguments: --method"),
]

CASES = [
    *(("generate-" + i, a, n) for i, a, n in GENERATE),
    *(("bench-" + i, a, n) for i, a, n in BENCH),
    *(("record-" + i, a, n) for i, a, n in RECORD),
    *(("calibrate-" + i, a, n) for i, a, n in CALIBRATE),
    *OUTPUTS,
    *TOP,
]


@pytest.mark.parametrize("argv, needle", [pytest.param(a, n, id=i) for i, a, n in CASES])
def test_bad_input_is_one_line_and_exit_2(argv, needle, files, tmp_path, capsys, monkeypatch):
    check(expand(argv, files, tmp_path), needle, files, tmp_path, capsys, monkeypatch)


def test_payload_is_live(tmp_path):
    """The hostile files above are real: unpickling their payload does create the marker file."""
    import pickle

    marker = tmp_path / MARKER
    pickle.loads(payload(marker))
    assert marker.exists()


def test_every_command_is_covered():
    """Every subcommand of ``draftgym`` has bad-input cases in one of the suite's files."""
    from experiments.cli import build_parser
    from tests.experiments.test_bad_input_configs import CASES as CONFIG_CASES
    from tests.experiments.test_bad_input_model import CASES as DRAFTER_CASES
    from tests.experiments.test_bad_input_model import MODEL
    from tests.experiments.test_bad_input_serve import CASES as SERVE_CASES

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    covered = {
        argv[0] for _, argv, _ in [*CASES, *MODEL, *CONFIG_CASES, *DRAFTER_CASES, *SERVE_CASES] if argv
    }
    assert set(sub.choices) <= covered, sorted(set(sub.choices) - covered)


def test_sizes_the_machine_cannot_hold_are_one_line_for_every_command():
    """numpy's MemoryError (a count too large for this machine) was a traceback under ``draftgym`` while the
    programs under ``env/`` said it in one line."""
    from experiments.cli import user_message

    msg = user_message(MemoryError("Unable to allocate 58.2 TiB for an array with shape (1000000000000, 16)"))
    assert msg is not None and msg.startswith("not enough memory for the sizes asked for") and "\n" not in msg
    assert user_message(RuntimeError("something else")) is None  # a bug keeps its traceback


def test_torch_running_out_of_memory_is_one_line():
    """torch's CPU allocator says "can't allocate memory" (a traceback under every program: only "not enough
    memory" was matched); a GPU's OutOfMemoryError comes with a paragraph, cut to one line of at most ~200."""
    import torch

    from experiments.cli import user_message

    try:
        torch.empty(1 << 60, dtype=torch.uint8)
    except RuntimeError as err:
        msg = user_message(err)
    assert msg is not None and msg.startswith(
        "not enough memory for the sizes asked for (DefaultCPUAllocator"
    ), msg
    gpu = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB.\n" + "advice " * 100)
    msg = user_message(gpu)
    assert msg is not None and "Tried to allocate 9.00 GiB" in msg and "\n" not in msg and len(msg) < 300, msg
