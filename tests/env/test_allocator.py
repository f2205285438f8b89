"""The C allocator's setting for a process that runs a target (``env.machine.settle_allocator``): freed memory kept
for the next tensors, so a forward's large blocks stop page-faulting in again; ``DRAFTGYM_MALLOC=system`` leaves
glibc's behaviour; a bad value is one line and exit code 2 before the model loads. The setting holds for a whole
process, so each case runs in a process of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from env import machine

# tensors of 64 MiB (16,384 pages), allocated and freed eight times while the heap grows to hold them (glibc places an
# aligned block past a freed one of its size until freed neighbours coalesce), then four times counted
FAULTS = """
import resource, torch
from env.machine import machine_info, settle_allocator
how = settle_allocator()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(8):
    x = torch.ones(16 << 20); del x
f0 = faults()
for _ in range(4):
    x = torch.ones(16 << 20); del x
print(how, machine_info()["allocator"], faults() - f0)
"""


def _glibc() -> bool:
    import ctypes

    try:
        ctypes.CDLL(None).mallopt  # noqa: B018
    except (OSError, AttributeError):
        return False
    return True


def _run(mode: str | None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != machine.ALLOCATOR_ENV}
    if mode is not None:
        env[machine.ALLOCATOR_ENV] = mode
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", FAULTS], env=env, cwd=root, capture_output=True, text=True,
                         timeout=120, check=True)  # fmt: skip
    return out.stdout.split()


@pytest.mark.skipif(not _glibc(), reason="mallopt is glibc's")
def test_kept_memory_serves_the_next_tensors_without_page_faults():
    kept = _run(None)  # the default
    assert kept[:2] == ["keep", "keep"], kept
    assert int(kept[2]) < 16384 // 10, kept  # the last four 64 MiB tensors reuse the heap's pages
    system = _run("system")
    assert system[:2] == ["system", "system"], system
    # glibc maps every block above 32 MiB afresh: each of the four faults its 16,384 pages in again
    assert int(system[2]) >= 3 * 16384, system


@pytest.mark.parametrize(
    "value, expected", [(None, "keep"), ("", "keep"), (" System ", "system"), ("keep", "keep")]
)
def test_allocator_mode_reads_the_setting(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(machine.ALLOCATOR_ENV, raising=False)
    else:
        monkeypatch.setenv(machine.ALLOCATOR_ENV, value)
    assert machine.allocator_mode() == expected


def test_a_bad_setting_is_one_line_and_exit_2_before_the_model_loads(monkeypatch, capsys):
    import env.model
    from experiments.cli import main

    def refuse(*a, **k):
        raise AssertionError("the model was read before the setting was checked")

    monkeypatch.setenv(machine.ALLOCATOR_ENV, "jemalloc")
    monkeypatch.setattr(env.model, "embedded_model_folder", refuse)
    assert main(["generate", "hi", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "DRAFTGYM_MALLOC='jemalloc': valid values are keep, system" in err, err
