"""Bad input gets one line naming the problem and exit code 2, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _run(*args, stdin=""):
    return subprocess.run(
        [sys.executable, "-m", "experiments", *args], input=stdin, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    "args, needle",
    [
        (["generate", ""], "prompt is empty"),
        (["generate", "hi", "--drafter", "nope"], "known drafters:"),
        (["generate", "hi", "--depth", "0"], "--depth must be >= 1"),
        (["generate", "hi", "--model", "/no/such/model"], "does not exist"),
        (["generate", "hi", "--dtype", "fp16"], "invalid choice"),
        (["generate", "--prompt-file", "/no/such/file"], "does not exist"),
        (["bench", "--methods", "ngram-dX"], "cannot read arm"),
        (["bench", "--workload", "/no/such.jsonl"], "does not exist"),
    ],
)
def test_one_line_exit_2(args, needle):
    r = _run(*args)
    assert r.returncode == 2, r.stderr
    err = [line for line in r.stderr.splitlines() if line.strip() and "Loading weights" not in line]
    assert len(err) == 1, r.stderr
    assert needle in err[0]
    assert "Traceback" not in r.stderr


@pytest.mark.model
def test_prompt_longer_than_context():
    r = _run("generate", "-", "--raw", "--dtype", "fp32", stdin="word " * 9000)
    assert r.returncode == 2, r.stderr
    assert "context is 8192 tokens" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.model
def test_generate_json_has_the_documented_fields():
    import json

    r = _run("generate", "Name three colors.", "--max-new-tokens", "8", "--dtype", "fp32", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) >= {"text", "token_ids", "stats"}
    assert set(out["stats"]) >= {"new_tokens", "steps", "tau", "tokens_per_s", "wall_s"}
    assert len(out["token_ids"]) == out["stats"]["new_tokens"] <= 8
