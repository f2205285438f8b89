"""The ``python -m env.bench_*`` programs print the machine they measure on (the CPU's model and bf16 flags:
``env.machine.cpu_label``) above their table. The CPU label and the measurements are stubbed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

LABEL = "Test CPU 9000 (family 6 model 1; avx512_bf16)"


@pytest.fixture
def label(monkeypatch):
    import env.machine

    monkeypatch.setattr(env.machine, "cpu_label", lambda: LABEL)
    return LABEL


def test_bench_serve_env_names_the_machine(label, monkeypatch, capsys):
    import env.bench_serve_env as bse

    monkeypatch.setattr(bse, "bench", lambda e, *a: {"envs": e, "request_steps_s": 1.0, "env_steps_s": 2.0})
    assert bse.main(["--envs", "4"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"machine: CPU {label}"


def test_bench_env_names_the_machine(label, monkeypatch, capsys):
    import env.bench_env as be

    monkeypatch.setattr(be, "bench_single", lambda *a: 1.0)
    monkeypatch.setattr(be, "bench_vector", lambda *a: 1.0)
    monkeypatch.setattr(be, "cpu_reference", lambda: 0.3)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert be.main(["--batch", "8", "--seconds", "0.01"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"machine: CPU {label}"


def test_bench_batch_names_the_machine(label, monkeypatch, tmp_path, capsys):
    import env.bench_batch as bb
    import env.model

    monkeypatch.setattr(
        env.model, "load_model", lambda *a, **k: SimpleNamespace(dtype=torch.float32, max_context=8192)
    )
    monkeypatch.setattr(bb, "raw_forward", lambda *a: None)
    monkeypatch.setattr(bb, "engine_step", lambda *a: None)
    monkeypatch.setattr(bb, "_interleaved_ms", lambda fns, reps: [1.0, 2.0])
    assert bb.main(["--rows", "1", "--json", str(tmp_path / "b.json")]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"machine: CPU {label}; float32, context 300"
