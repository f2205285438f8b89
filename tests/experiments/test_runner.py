"""``draftgym run``: a run killed with SIGKILL mid-way and started again ends with the same results as an
uninterrupted run, with no (method, prompt) missing or duplicated; a run directory refuses another config."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments.config import load_config
from experiments.records import load_done
from experiments.runner import RunDirError, check_results, prepare_run_dir, run, select_prompts

CONFIG = """name = "killme"
methods = ["ar", "ngram-d4"]
[model]
dtype = "fp32"   # exactness is defined in fp32
device = "cpu"
[workload]
limit = 2
[decode]
max_new_tokens = 8
warmup = false
"""


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.is_file() else 0


@pytest.mark.model
def test_killed_run_restarts_to_the_uninterrupted_results(tmp_path, fp32_model):
    cfg_path = tmp_path / "run.toml"
    cfg_path.write_text(CONFIG)
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "experiments", "run", str(cfg_path), "--out", str(out), "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 600
    while _lines(out / "records.jsonl") < 1 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = _lines(out / "records.jsonl")
    assert 1 <= killed_at < 4, "the run was not killed mid-way"
    with (out / "records.jsonl").open("a") as fh:  # a torn last line, as a kill during a write leaves it
        fh.write('{"method": "ar", "prompt_id": "1", "categ')

    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    cfg = load_config(cfg_path)
    records = load_done(out / "records.jsonl")
    assert check_results(records, select_prompts(cfg), list(cfg.methods)) == []  # none missing, none twice
    assert len(records) == 4 and len(out.joinpath("provenance.jsonl").read_text().splitlines()) == 2

    ref = run(cfg, tmp_path / "uninterrupted", progress=False, loaded=fp32_model)
    ref_records = load_done(tmp_path / "uninterrupted" / "records.jsonl")
    assert {(x.method, x.prompt_id): x.token_ids for x in records} == {
        (x.method, x.prompt_id): x.token_ids for x in ref_records
    }
    # timings differ, and so do the timing sessions (the resumed run's records come from two)
    from experiments.bench_summary import TIMED_FIELDS as strip

    got = json.loads((out / "summary.json").read_text())["summary"]
    assert [{k: v for k, v in row.items() if k not in strip} for row in got] == [
        {k: v for k, v in row.items() if k not in strip} for row in ref["summary"]
    ]
    for png in ("speedup_per_category", "tau_distribution", "arm_choices"):
        assert (out / "plots" / f"{png}.png").stat().st_size > 0


def test_run_directory_refuses_another_config(tmp_path):
    prepare_run_dir(load_config(None, text=CONFIG), tmp_path)
    with pytest.raises(RunDirError, match="differs in decode.max_new_tokens"):
        prepare_run_dir(load_config(None, text=CONFIG, sets=["decode.max_new_tokens=9"]), tmp_path)
    prepare_run_dir(
        load_config(None, text=CONFIG, sets=["sweep.n_trials=3"]), tmp_path
    )  # sweep keys don't matter
