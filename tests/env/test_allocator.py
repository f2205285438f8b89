"""The C allocator's setting for a process that runs a target (``env.allocator.settle_allocator``): freed memory kept
for the next tensors, so a forward's large blocks stop page-faulting in again; ``DRAFTGYM_MALLOC=system`` leaves
glibc's behaviour; a bad value is one line and exit code 2 before the model loads; what a process ran under is
recorded truthfully where nothing could be kept. The setting holds for a whole process: the page faults are
counted in processes of their own, the rest against a fake ``mallopt``."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from env import allocator

# tensors of 64 MiB (16,384 pages), allocated and freed 40 times, the page faults of each counted. The heap grows to
# hold them over the first ones (glibc places an aligned block past a freed one of its size until freed neighbours
# coalesce: eight to a dozen growths, not always the same number); the last eight are the steady state
FAULTS = """
import resource, torch
from env.allocator import allocator_state, settle_allocator
how = settle_allocator()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
each = []
for _ in range(40):
    f0 = faults()
    x = torch.ones(16 << 20); del x
    each.append(faults() - f0)
print(how, allocator_state()["allocator"], *each[-8:])
"""


def _run(mode: str | None) -> list[str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k != allocator.ALLOCATOR_ENV and k not in allocator.ALLOCATOR_VARS
    }
    if mode is not None:
        env[allocator.ALLOCATOR_ENV] = mode
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", FAULTS], env=env, cwd=root, capture_output=True, text=True,
                         timeout=120, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_kept_memory_serves_the_next_tensors_without_page_faults():
    kept = _run(None)  # the default
    if kept[0] != "keep":
        pytest.skip(f"this C library takes no setting here ({kept[0]})")
    assert kept[1] == "keep", kept
    pages = (64 << 20) // resource.getpagesize()  # one tensor's pages
    steady = [int(n) for n in kept[2:]]
    # each of the last eight reuses the heap's pages
    assert len(steady) == 8 and max(steady) < pages // 10, kept
    system = _run("system")
    assert system[:2] == ["system", "system"], system
    # glibc maps every block above 32 MiB afresh: each tensor faults its pages in again (a page a fault; a huge page,
    # where the kernel gives them, a fault for many: still one or more a tensor, and more than any kept one)
    assert all(int(n) >= 1 and int(n) > max(steady) for n in system[2:]), (system, kept)


class FakeMallopt:
    """glibc's mallopt as a recorder: takes what ``refuse`` does not name."""

    def __init__(self, refuse: set[tuple[int, int]] = frozenset()) -> None:
        self.calls: list[tuple[int, int]] = []
        self.refuse = refuse

    def __call__(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 0 if (param, value) in self.refuse else 1


@pytest.fixture
def fresh(monkeypatch):
    """A process in which nothing was settled yet, with no allocator variables or setting in its environment."""
    monkeypatch.setattr(allocator, "_allocator", None)
    for k in (allocator.ALLOCATOR_ENV, *allocator.ALLOCATOR_VARS):
        monkeypatch.delenv(k, raising=False)

    def use(fake: FakeMallopt | None) -> None:
        monkeypatch.setattr(allocator, "glibc_mallopt", lambda: fake)

    return use


GIB, OLD = allocator.KEEP_BYTES, allocator.KEEP_BYTES_OLD
TRIM, MMAP = allocator.M_TRIM_THRESHOLD, allocator.M_MMAP_THRESHOLD


def test_keep_sets_both_thresholds_once(fresh, monkeypatch):
    fake = FakeMallopt()
    fresh(fake)
    assert allocator.allocator_state() == {"allocator": "untouched", "allocator_env": {}}
    assert allocator.settle_allocator() == "keep"
    assert fake.calls == [(MMAP, GIB), (TRIM, GIB)]  # the mmap threshold first
    monkeypatch.setenv(allocator.ALLOCATOR_ENV, "system")  # the first call decided: nothing set again
    assert allocator.settle_allocator() == "keep" and len(fake.calls) == 2
    monkeypatch.setenv(allocator.ALLOCATOR_ENV, "bad")  # but a bad value is still refused
    with pytest.raises(allocator.AllocatorError):
        allocator.settle_allocator()
    assert allocator.allocator_state() == {"allocator": "keep", "allocator_env": {}}


def test_a_glibc_that_caps_the_mmap_threshold_gets_32_mib(fresh):
    fake = FakeMallopt(refuse={(MMAP, GIB)})
    fresh(fake)
    assert allocator.settle_allocator() == "keep-32MiB"
    assert fake.calls == [(MMAP, GIB), (MMAP, OLD), (TRIM, GIB)]


@pytest.mark.parametrize(
    "fake, env, expected, calls",
    [
        (None, {}, "unavailable", None),  # no glibc mallopt: nothing changed
        (FakeMallopt(refuse={(TRIM, GIB)}), {}, "partial", [(MMAP, GIB), (TRIM, GIB)]),
        # the mmap threshold refused: the trim threshold is not tried (setting it alone would stop the dynamic one)
        (FakeMallopt(refuse={(MMAP, GIB), (MMAP, OLD)}), {}, "unavailable", [(MMAP, GIB), (MMAP, OLD)]),
        (FakeMallopt(), {"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, "preloaded", []),
        (FakeMallopt(), {allocator.ALLOCATOR_ENV: "system"}, "system", []),
    ],
)
def test_what_is_recorded_where_nothing_is_kept(fresh, monkeypatch, fake, env, expected, calls):
    fresh(fake)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert allocator.settle_allocator() == expected
    if calls is not None:
        assert fake.calls == calls
    state = allocator.allocator_state()
    assert state["allocator"] == expected
    assert state["allocator_env"] == {k: v for k, v in env.items() if k in allocator.ALLOCATOR_VARS}


def test_the_run_identity_names_the_allocator(fresh, monkeypatch):
    """A timed run folder resumed under the other setting is refused as another machine's timings would be."""
    from experiments.records import machine_identity

    fresh(FakeMallopt())
    untouched = machine_identity("cpu")
    allocator.settle_allocator()
    assert machine_identity("cpu")["allocator"] == "keep" != untouched["allocator"]
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    assert machine_identity("cpu")["allocator_env"] == {"MALLOC_ARENA_MAX": "2"}


@pytest.mark.parametrize(
    "value, expected", [(None, "keep"), ("", "keep"), (" System ", "system"), ("keep", "keep")]
)
def test_allocator_mode_reads_the_setting(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(allocator.ALLOCATOR_ENV, raising=False)
    else:
        monkeypatch.setenv(allocator.ALLOCATOR_ENV, value)
    assert allocator.allocator_mode() == expected


def test_a_bad_setting_is_one_line_and_exit_2_before_the_model_loads(monkeypatch, capsys):
    import env.model
    from experiments.cli import main

    def refuse(*a, **k):
        raise AssertionError("the model was read before the setting was checked")

    monkeypatch.setenv(allocator.ALLOCATOR_ENV, "jemalloc")
    monkeypatch.setattr(env.model, "embedded_model_folder", refuse)
    assert main(["generate", "hi", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "DRAFTGYM_MALLOC='jemalloc': valid values are keep, system" in err, err
