"""The CPU label every published figure carries, and the native-bf16 decision, on CPUs other than this one: Arm
names its flags ``Features`` and has no model name (a bf16 Graviton was labelled "no native bf16"), a VM may hide
the model name."""

from __future__ import annotations

from pathlib import Path

import pytest

from env import machine

ARM = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes sve svebf16 i8mm bf16 dgh rng
CPU implementer\t: 0x41
CPU architecture: 8
CPU part\t: 0xd40

processor\t: 1
Features\t: fp asimd
"""
VM = "processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 143\nflags\t\t: fpu avx512f avx512_bf16\n"
OLD = "processor\t: 0\nmodel name\t: Old CPU\ncpu family\t: 6\nmodel\t\t: 85\nflags\t\t: fpu avx2\n"


@pytest.fixture
def cpuinfo(monkeypatch):
    read = Path.read_text

    def use(text: str) -> None:
        monkeypatch.setattr(
            Path,
            "read_text",
            lambda self, *a, **k: text if str(self) == "/proc/cpuinfo" else read(self, *a, **k),
        )

    monkeypatch.setattr(machine.platform, "processor", lambda: "")
    monkeypatch.setattr(machine.platform, "machine", lambda: "aarch64")
    return use


def test_arm_flags_and_name(cpuinfo):
    cpuinfo(ARM)
    assert machine.cpu_has_bf16()
    assert machine.cpu_label() == "aarch64 (implementer 0x41 part 0xd40; bf16)"


def test_a_vm_hiding_the_model_name(cpuinfo):
    cpuinfo(VM)
    assert machine.cpu_has_bf16()
    assert machine.cpu_label() == "aarch64 (family 6 model 143; avx512_bf16)"


def test_no_native_bf16(cpuinfo):
    cpuinfo(OLD)
    assert not machine.cpu_has_bf16()
    assert machine.cpu_label() == "Old CPU (family 6 model 85; no native bf16)"
