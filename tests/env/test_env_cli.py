"""``draftgym calibrate`` and ``draftgym record``: help, one-line errors with exit code 2, and a tiny record run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _run(*args):
    return subprocess.run(
        [sys.executable, "-m", "experiments", *args], capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize("cmd", ["calibrate", "record"])
def test_help(cmd, capsys):
    from experiments.cli import main

    with pytest.raises(SystemExit) as exit_:
        main([cmd, "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and "--json" in out and "--out" in out


def test_one_line_errors(tmp_path, capsys):
    from experiments.cli import main

    exists = tmp_path / "t.npz"
    exists.write_bytes(b"")
    cases = [
        (["calibrate", "--reps", "0"], "--reps must be >= 1"),
        (["calibrate", "--drafters", "ngram,nope"], "unknown drafter 'nope'"),
        (["record", "--out", str(exists)], "already exists"),
        (
            ["record", "--out", str(tmp_path / "x.npz"), "--max-new-tokens", "1"],
            "--max-new-tokens must be >= 2",
        ),
        (["record", "--out", str(tmp_path / "x.npz"), "--workload", "/no/such.jsonl"], "does not exist"),
    ]
    for args, needle in cases:
        assert main(args) == 2, args
        err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
        assert len(err) == 1 and needle in err[0] and "Traceback" not in err[0], (args, err)


@pytest.mark.model
def test_record_a_tiny_trace(tmp_path):
    out = tmp_path / "tiny.npz"
    r = _run("record", "--out", str(out), "--limit", "1", "--max-new-tokens", "3", "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert (
        summary["prompts"] == 1
        and 1 <= summary["positions"] <= 3
        and summary["drafters"] == {"ngram": "exact"}
    )
    assert out.is_file()
