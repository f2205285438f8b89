"""The ``draftgym`` process itself: one line and exit code 2 for a prompt longer than the context, and the documented
``generate --json`` fields (the bad-input suite runs in process: tests/test_bad_input.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _run(*args, stdin=""):
    return subprocess.run(
        [sys.executable, "-m", "experiments", *args], input=stdin, capture_output=True, text=True, timeout=300
    )


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
