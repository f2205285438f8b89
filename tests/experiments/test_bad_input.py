"""The bad-input suite: every ``draftgym`` command given missing, garbage and out-of-range arguments and damaged
or hostile files. Expected in every case: exit code 2, one line on stderr naming the problem (``needle``), no
traceback, no hostile payload run, and no output file left behind, whole or half-written.

The commands run in this process (``experiments.cli.main``), so a case that escapes as an exception fails here
with its traceback; ``tests/experiments/test_cli_errors.py`` checks the same through a real ``draftgym`` process.
"""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

import pytest

from tests.hostile import npz_payload, payload, replace_members, torch_payload

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "experiments" / "configs"
MARKER = "PAYLOAD-RAN"  # the file a hostile pickle would create, in the case's folder


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """Bad files, made once: ``{key}`` in a case's arguments is replaced by the path of ``files[key]``."""
    d = tmp_path_factory.mktemp("bad")
    marker = d / MARKER
    f: dict[str, Path] = {"dir": d / "a-folder"}
    f["dir"].mkdir()
    write = {
        "bin": b"\xff\xfe\x00\x81 not utf-8",
        "empty": b"",
        "long_prompt": b"ab " * 400_000,  # past env.decoder.MAX_PROMPT_CHARS: refused before it is tokenized
        "blocker": b"a file where a folder is expected",
        "long": ("word " * 9000).encode(),
        "garbage": b"{{{ this is no format at all\n",
        "jsonlist": b"[1, 2, 3]\n",
        "arrivals_few": b"# arrival times, seconds\n0\n0.5\n",
        "arrivals_back": b"0\n2\n1\n" * 8,
        "arrivals_far": b"0\n1e9\n" + b"1e9\n" * 30,
        "pickle": payload(marker),
        "torchpickle": torch_payload(marker),
        "npzpickle": npz_payload(marker),
        "toml_garbage": b'name = "x\n[decode\n',
        "toml_unknown": b'name = "x"\n[decode]\nmax_new_token = 3\n',
        "toml_type": b'name = "x"\n[decode]\nmax_new_tokens = "many"\n',
        "toml_live": b'name = "x"\n[policies.p]\nkind = "sb3"\n[policies.p.train]\nbackend = "live"\n',
        "toml_nopolicy": b'name = "x"\nmethods = ["ar"]\n',
        "toml_twoout": b'name = "x"\n[policies.a]\nkind = "ucb1"\narms = ["none", "ngram-d2"]\n'
        b'[policies.a.train]\nout = "shared.zip"\n[policies.b]\nkind = "thompson"\narms = ["none", "ngram-d2"]\n'
        b'[policies.b.train]\nout = "shared.zip"\n',
        "jsonl_long": (
            json.dumps({"question_id": 1, "category": "qa", "turns": ["word " * 9000]}) + "\n"
        ).encode(),
        "jsonl_noturns": b'{"question_id": 1, "category": "qa"}\n',
        "jsonl_emptyturn": b'{"question_id": 1, "category": "qa", "turns": [" "]}\n',
        "jsonl_tablecat": b'{"question_id": 1, "category": "a/b\\nc\\t|,", "turns": ["Hi."]}\n',
        "toml_nenvs": b'name = "x"\n[policies.p]\nkind = "sb3"\narms = ["none", "ngram-d2"]\n'
        b"[policies.p.train]\nn_envs = 1000000000000\n",
    }
    for key, data in write.items():
        f[key] = d / f"{key}.dat"
        f[key].write_bytes(data)
    # a draftgym policy whose state member is a pickle (its checksum made to match, so only the format stops it)
    src = ROOT / "policies" / "data" / "linucb.zip"
    import hashlib
    import zipfile

    evil = npz_payload(marker)
    with zipfile.ZipFile(src) as z:
        header = json.loads(z.read("header.json"))
    header["payload"]["state.npz"] = hashlib.sha256(evil).hexdigest()
    f["policy_pickle"] = replace_members(
        src, d / "evil-policy.zip", {"state.npz": evil, "header.json": json.dumps(header).encode()}
    )
    f["policy_truncated"] = d / "truncated-policy.zip"
    f["policy_truncated"].write_bytes(src.read_bytes()[:700])
    f["cost_truncated"] = d / "cost.json"
    f["cost_truncated"].write_bytes((ROOT / "env" / "data" / "cost_model.json").read_bytes()[:300])
    f["trace_truncated"] = d / "trace.npz"
    f["trace_truncated"].write_bytes((ROOT / "env" / "data" / "builtin_trace.npz").read_bytes()[:5000])
    for key, name, data in [("run_garbage", "summary.json", b"{{{"), ("run_list", "summary.json", b"[]"),
                            ("run_nosettings", "summary.json", b'{"name": "x", "summary": []}'),
                            ("sweep_garbage", "sweep.json", b"\xff\xfe"),
                            ("sweep_nobest", "sweep.json", b'{"study": "x"}'),
                            ("bench_garbage", "bench.json", b"{{{"),
                            ("bench_nosettings", "bench.json", b'{"summary": []}'),
                            ("bench_norecords", "bench.json",
                             b'{"settings": {"model": "embedded", "dtype": "fp32", "workload": "builtin"}}')]:  # fmt: skip
        f[key] = d / key
        f[key].mkdir()
        (f[key] / name).write_bytes(data)
    base = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
            "vocab_size": 100, "intermediate_size": 128}  # fmt: skip
    for key, change in [("model_hidden_str", {"hidden_size": "576"}), ("model_heads_zero", {"num_attention_heads": 0}),
                        ("model_layers_negative", {"num_hidden_layers": -1}), ("model_eps_str", {"rms_norm_eps": "x"}),
                        ("model_kv_split", {"num_key_value_heads": 3})]:  # fmt: skip
        f[key] = d / key
        f[key].mkdir()
        (f[key] / "config.json").write_text(json.dumps({**base, **change}))
    f["badhead"] = d / "badhead"  # a head whose two files are there, and neither is one
    (d / "badhead.safetensors").write_bytes(b"{{{ no safetensors header")
    (d / "badhead.json").write_text("{not json")
    # outputs that are no regular file, and run folders whose result files are in the way
    f["fifo"] = d / "fifo"
    os.mkfifo(f["fifo"])  # written under a temporary name and renamed, it was replaced; read, it blocked
    f["victim"] = d / "victim.safetensors"  # someone's file where a head's would go
    f["victim"].write_text("my thesis draft")
    for key, name in [("out_benchjson_dir", "bench.json"), ("out_summary_dir", "summary.json")]:
        (d / key / name).mkdir(parents=True)
        f[key] = d / key
    f["out_plots_file"] = d / "out_plots_file"
    f["out_plots_file"].mkdir()
    (f["out_plots_file"] / "plots").write_text("a file where the plots folder goes")
    f["marker"] = marker
    return f


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

CASES = [
    *(("generate-" + i, a, n) for i, a, n in GENERATE),
    *(("bench-" + i, a, n) for i, a, n in BENCH),
    *(("record-" + i, a, n) for i, a, n in RECORD),
    *(("calibrate-" + i, a, n) for i, a, n in CALIBRATE),
    *CONFIG_COMMANDS,
    *RUN_SWEEP_TRAIN,
    *READERS,
    *POLICY_FILES,
    *(("train-drafter-" + i, a, n) for i, a, n in TRAIN_DRAFTER),
    *(("serve-bench-" + i, a, n) for i, a, n in SERVE),
    *SERVE_POLICIES,
    *OUTPUTS,
    *TOP,
]


def _expand(args: list[str], files: dict[str, Path], tmp: Path) -> list[str]:
    subs = {f"{{{k}}}": str(v) for k, v in files.items()} | {"{tmp}": str(tmp)}
    out = []
    for a in args:
        for key, val in subs.items():
            a = a.replace(key, val)
        out.append(a)
    return out


def _check(
    argv: list[str],
    needle: str,
    files: dict[str, Path],
    tmp: Path,
    capsys,
    monkeypatch,
    folders: bool = False,
) -> None:
    """``folders``: the problem shows only once the model is loaded, after the output folder was checked (made)."""
    from experiments.cli import main

    monkeypatch.chdir(tmp)  # default output folders (runs/...) land in the case's folder
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    before = {p for p in files["dir"].parent.rglob("*")}
    code = main(argv)
    # the last of each \r-separated segment: tqdm redraws a bar on one line, without a newline
    err = [line.split("\r")[-1] for line in capsys.readouterr().err.splitlines()]
    err = [line for line in err if line.strip() and "%|" not in line and "Loading weights" not in line]
    assert code == 2, (argv, err)
    assert len(err) == 1, err
    assert needle.lower() in err[0].lower(), err[0]
    assert "Traceback" not in err[0]
    assert not files["marker"].exists(), "a hostile payload ran"
    after = {p for p in files["dir"].parent.rglob("*")}
    assert after == before, f"left files behind: {sorted(map(str, after - before))}"
    written = [
        p for p in tmp.rglob("*") if p.is_file() or not folders
    ]  # no file, nor a folder before the model
    assert not written, f"a refused command wrote {written}"


@pytest.mark.parametrize("argv, needle", [pytest.param(a, n, id=i) for i, a, n in CASES])
def test_bad_input_is_one_line_and_exit_2(argv, needle, files, tmp_path, capsys, monkeypatch):
    _check(_expand(argv, files, tmp_path), needle, files, tmp_path, capsys, monkeypatch)


@pytest.mark.model
@pytest.mark.parametrize("argv, needle", [pytest.param(a, n, id=i) for i, a, n in MODEL])
def test_bad_input_found_after_loading_the_model(argv, needle, files, tmp_path, capsys, monkeypatch):
    _check(_expand(argv, files, tmp_path), needle, files, tmp_path, capsys, monkeypatch, folders=True)


def test_payload_is_live(tmp_path):
    """The hostile files above are real: unpickling their payload does create the marker file."""
    import pickle

    marker = tmp_path / MARKER
    pickle.loads(payload(marker))
    assert marker.exists()


def test_every_command_is_covered():
    """Every subcommand of ``draftgym`` has bad-input cases here."""
    from experiments.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    covered = {argv[0] for _, argv, _ in [*CASES, *MODEL] if argv}
    assert set(sub.choices) <= covered, sorted(set(sub.choices) - covered)


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
