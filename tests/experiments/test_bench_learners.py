"""``draftgym bench --policy`` with a policy that learns while it decodes (UCB1): a resumed run continues from the
policy's state after the last prompt recorded, not from the file it started from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments.cli import main
from policies.base import read_policy

pytestmark = pytest.mark.model

UCB1 = Path(__file__).resolve().parents[2] / "policies" / "data" / "ucb1.zip"


def _pulls(path: Path) -> int:
    return json.loads(read_policy(path)[1]["state.json"])["stats"]["total_pulls"]


def test_a_resumed_bench_continues_the_online_policy(tmp_path, capsys):
    out = tmp_path / "b"
    base = ["bench", "--methods", "ar", "--policy", str(UCB1), "--max-new-tokens", "8", "--dtype", "fp32",
            "--out", str(out), "--json"]  # fmt: skip
    assert main([*base, "--limit", "1"]) == 0  # as if killed after the first prompt
    state = out / "policies" / "ucb1.zip"
    assert state.is_file()
    assert main([*base, "--limit", "2"]) == 0  # the rerun: the second prompt only
    capsys.readouterr()
    recs = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()]
    mine = [r for r in recs if r["method"] == "policy:ucb1"]
    assert len(mine) == 2 and len({r["prompt_id"] for r in mine}) == 2
    # as many updates as an uninterrupted run's (the steps of both prompts, greedy: the same tokens), more than the
    # second prompt's alone: it started from the first one's state
    whole = tmp_path / "whole"
    assert main([*base[:-3], "--out", str(whole), "--json", "--limit", "2"]) == 0
    capsys.readouterr()
    assert _pulls(state) == _pulls(whole / "policies" / "ucb1.zip") > _pulls(UCB1) + mine[-1]["steps"]
    assert read_policy(state)[0].meta["run_record"]["prompt_id"] == mine[-1]["prompt_id"]
