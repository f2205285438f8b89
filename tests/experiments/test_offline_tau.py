"""``experiments.offline_tau`` reads a bench's ``records.jsonl`` as data: the torn last line of a killed (or still
running) bench and lines that are not records are skipped, the file is left as it is, and a run without the ar
answers it needs is one line and exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from experiments.offline_tau import ar_answers
from experiments.records import Record

ROOT = Path(__file__).resolve().parents[2]


def _records(path: Path, tail: str) -> bytes:
    lines = [asdict(Record("ar", "p1", "qa", 4, 2, 0.1, 2, 1.0, [5, 6])),
             asdict(Record("ngram-d4", "p1", "qa", 4, 2, 0.1, 1, 2.0, [5, 6])),
             {"method": "ar", "prompt_id": "p2"},  # not a record: skipped
             asdict(Record("ar", "p3", "qa", 4, 1, 0.1, 1, 1.0, [7]))]  # fmt: skip
    data = ("".join(json.dumps(r) + "\n" for r in lines) + tail).encode()
    path.write_bytes(data)
    return data


def test_a_torn_last_line_is_skipped_and_the_file_left_as_it_is(tmp_path):
    path = tmp_path / "records.jsonl"
    data = _records(path, '{"method": "ar", "prompt_id": "p4", "token_')
    assert ar_answers(path) == {"p1": [5, 6], "p3": [7]}
    assert path.read_bytes() == data  # a bench may still be appending to it


def test_missing_answers_are_one_line_and_exit_2(tmp_path):
    _records(tmp_path / "records.jsonl", '{"method": "ar", "pro')
    r = subprocess.run([sys.executable, "-m", "experiments.offline_tau", str(tmp_path), "builtin", "1"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "has no ar answer to" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "experiments.offline_tau", str(tmp_path / "none"), "builtin"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)  # fmt: skip
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "cannot read" in r.stderr, r.stderr
