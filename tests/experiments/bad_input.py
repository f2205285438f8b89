"""The bad-input suite's support: the bad files the cases name, and the check every case must pass. Expected in
every case: exit code 2, one line on stderr naming the problem (``needle``), no traceback, no hostile payload run,
and no output file left behind, whole or half-written.

The commands run in this process (``experiments.cli.main``), so a case that escapes as an exception fails with its
traceback; ``tests/experiments/test_cli_errors.py`` checks the same through a real ``draftgym`` process. The cases
are in ``test_bad_input*.py``, one file per group of commands; the ``files`` fixture is in this folder's
``conftest.py``.
"""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

from tests.hostile import npz_payload, payload, replace_members, torch_payload

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "experiments" / "configs"
MARKER = "PAYLOAD-RAN"  # the file a hostile pickle would create, in the case's folder


def make_files(d: Path) -> dict[str, Path]:
    """Bad files, made once per module in ``d``: ``{key}`` in a case's arguments is replaced by the path of
    ``files[key]``."""
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


def expand(args: list[str], files: dict[str, Path], tmp: Path) -> list[str]:
    subs = {f"{{{k}}}": str(v) for k, v in files.items()} | {"{tmp}": str(tmp)}
    out = []
    for a in args:
        for key, val in subs.items():
            a = a.replace(key, val)
        out.append(a)
    return out


def check(
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
