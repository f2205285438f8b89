"""One-time jobs on a machine that processes started at once do in turns (``env.folder_lock.taking_turns``): a
matmul probe's decision (``env.machine._settle``), probed by one and read by the others, so that every process
computes alike; the embedded model's conversion, done by one while the others wait for it. Each runs real
processes (the test runner's workers or a sweep's start several at once)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from env.folder_lock import taking_turns
from env.model import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parents[2]

SETTLE = """
import sys, time
from pathlib import Path
from env.machine import _settle

mine, both = Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]]
mine.touch()
while not all(p.exists() for p in both):  # the two start probing together
    time.sleep(0.01)

def probe():
    time.sleep(1.0)  # the other one comes meanwhile
    return mine.name == "ready-yes"

print(_settle("a test probe", None, probe, lambda v: None))
"""


def _env(cache: Path) -> dict[str, str]:
    return {**os.environ, "DRAFTGYM_CACHE": str(cache)}


def test_two_processes_that_probe_at_once_keep_one_decision(tmp_path):
    """Each probed under the other's load and kept its own answer; the file kept whichever wrote last, so a
    process and the ones it started next could compute differently."""
    ready = [tmp_path / "ready-yes", tmp_path / "ready-no"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SETTLE, str(r), *map(str, ready)],
            cwd=ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=_env(tmp_path / "cache"),
        )  # fmt: skip
        for r in ready
    ]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert all(p.returncode == 0 for p in procs), outs
    said = [out.strip() for out, _ in outs]
    assert said[0] == said[1] in ("True", "False"), said
    kept = json.loads((tmp_path / "cache" / "wide_products.json").read_text())
    assert [k.endswith("|a test probe") for k in kept] == [True] and list(kept.values()) == [
        said[0] == "True"
    ]


def _waiting_on(lock: Path) -> bool:
    """Whether a process waits for ``lock``'s flock (``/proc/locks`` lists a waiter as ``->``)."""
    st = lock.stat()
    where = (
        f" {os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino} "  # as /proc/locks names a file
    )
    return any("->" in line and where in line for line in Path("/proc/locks").read_text().splitlines())


def test_a_first_use_while_another_converts_the_model_waits_and_converts_nothing(tmp_path):
    """Two first uses at once both converted; the later one's rename failed on the folder the earlier one had
    renamed into place (or removed it under the other's reader)."""
    cache = tmp_path / "cache"
    folder = cache / "models" / DEFAULT_MODEL
    lock = folder.with_name(f".{folder.name}.lock")
    code = (  # a conversion would start by reading the GGUF: here it ends the process instead
        "import sys, env.model as m\n"
        "m.embedded_gguf_path = lambda: sys.exit('converted again')\n"
        "print(m.embedded_model_folder())\n"
    )
    proc = None
    try:
        with taking_turns(lock):  # as a process converting it holds it
            proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=_env(cache))  # fmt: skip
            end = time.monotonic() + 120
            while not _waiting_on(lock) and proc.poll() is None and time.monotonic() < end:
                time.sleep(0.05)
            assert _waiting_on(lock), proc.communicate()
            folder.mkdir(parents=True)  # what the converting process leaves: a converted folder
            for name in ("config.json", "model.safetensors"):
                (folder / name).write_text("made by the other process")
        out, err = proc.communicate(timeout=120)
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and out.strip() == str(folder), err
    assert sorted(p.name for p in folder.parent.iterdir()) == [lock.name, folder.name]  # no second conversion
    assert {p.name: p.read_text() for p in folder.iterdir()} == dict.fromkeys(
        ("config.json", "model.safetensors"), "made by the other process"
    )


@pytest.mark.timeout(60)
def test_a_turn_nested_in_one_this_thread_holds_runs_as_part_of_it_and_the_lock_is_free_after(tmp_path):
    """A second descriptor's ``flock`` waits for the first's release: a nested turn on the same file hung."""
    lock, ran = tmp_path / "turn.lock", []
    with taking_turns(lock), taking_turns(lock):
        ran.append(True)
    probe = (
        "import fcntl, os, sys; fcntl.flock(os.open(sys.argv[1], os.O_RDONLY), fcntl.LOCK_EX | fcntl.LOCK_NB)"
    )
    assert ran and subprocess.run([sys.executable, "-c", probe, str(lock)], timeout=60).returncode == 0
