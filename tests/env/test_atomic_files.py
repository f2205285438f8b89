"""``env.files``: an atomic write leaves the old file or the new one; an output that is a directory is named as
itself in the error (the temporary the replace would have failed on means nothing to the user); what a killed
writer left is removed by the next run that takes the folder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from env.files import atomic_write_text
from env.folder_lock import claim_folder, release_folder


def test_an_atomic_write_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "out" / "r.json"
    atomic_write_text(path, "{}")
    atomic_write_text(path, '{"a": 1}')
    assert path.read_text() == '{"a": 1}' and [p.name for p in path.parent.iterdir()] == ["r.json"]


def test_a_directory_in_the_way_is_named_as_itself(tmp_path):
    (tmp_path / "r.json").mkdir()
    with pytest.raises(IsADirectoryError) as info:
        atomic_write_text(tmp_path / "r.json", "{}")
    assert info.value.filename == str(tmp_path / "r.json") and ".tmp" not in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


KILLED_MID_WRITE = """
import os, sys, time
from env import files
def slow(a, b):  # the temporary is written; the kill comes before it is renamed
    print("written", flush=True)
    time.sleep(120)
os.replace = slow
files.atomic_write_text(sys.argv[1], "{}")
"""


def _killed_writer(path):
    """A writer killed (SIGKILL) between writing its temporary and renaming it: the temporary it leaves."""
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_MID_WRITE, str(path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "written"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    (tmp,) = [p for p in path.parent.iterdir() if p.name.endswith(f".{proc.pid}.dg.tmp")]
    return tmp


def test_taking_a_folder_removes_what_killed_writers_left_and_nothing_else(tmp_path):
    """A run killed mid-write left ``.NAME.PID.dg.tmp`` beside its results, and every resume kept it; the next run to
    take the folder removes those of dead processes, in the folder and its subfolders -- not a live writer's
    temporary, nor a file of another name."""
    (tmp_path / "plots").mkdir()
    dead = [_killed_writer(tmp_path / "bench.json"), _killed_writer(tmp_path / "plots" / "tau.png")]
    live = tmp_path / f".report.md.{os.getppid()}.dg.tmp"  # a process that runs (pytest's parent)
    other = (
        tmp_path / f".{dead[0].name.split('.')[1]}.{dead[0].name.split('.')[3]}.tmp"
    )  # another program's name
    kept = [live, other, tmp_path / "notes.tmp", tmp_path / ".x.tmp", tmp_path / "records.jsonl"]
    for p in kept:
        p.write_text("keep")
    claim_folder(tmp_path, "--out run")
    try:
        assert not any(p.exists() for p in dead)
        assert all(p.read_text() == "keep" for p in kept)
    finally:
        release_folder(tmp_path)
