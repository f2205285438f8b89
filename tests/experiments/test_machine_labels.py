"""A printed timing table or a plot of timings names the machine it was measured on (the CPU's model and bf16
flags: ``env.machine.cpu_label``): ``draftgym bench``'s table and the goodput plot of ``serve-bench``
(``tests/env/test_bench_machine_label.py``: the ``python -m env.bench_*`` programs). The CPU label and the
measurements are stubbed."""

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


def test_bench_table_names_the_machine(label, tmp_path, monkeypatch, capsys):
    import env.model
    import experiments.bench as bench
    from experiments.cli import main

    class Tok:
        chat_template = None

        def __call__(self, text):
            return {"input_ids": [ord(c) % 97 for c in text[:12]]}

    loaded = SimpleNamespace(model_id="tiny", dtype=torch.float32, device="cpu", weights="dense", forward="lean",
                             tokenizer=Tok(), max_context=512, config=SimpleNamespace(vocab_size=64))  # fmt: skip
    monkeypatch.setattr(env.model, "load_model", lambda *a, **k: loaded)
    monkeypatch.setattr(bench, "arm_decoder", lambda *a, **k: SimpleNamespace(drafters={}))
    monkeypatch.setattr(bench, "run_method", lambda *a, **k: ([5, 6], 0.1, 2, 1.0, []))
    argv = [
        "bench",
        "--methods",
        "ar,ngram-d8",
        "--limit",
        "1",
        "--max-new-tokens",
        "2",
        "--out",
        str(tmp_path),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"tiny (float32) on CPU {label}"


def test_goodput_plot_names_the_machine(tmp_path, monkeypatch):
    import experiments.plots as plots

    texts = []
    save = plots._save

    def spy(fig, path, note=""):
        out = save(fig, path, note)
        texts.extend(t.get_text() for t in fig.texts)
        return out

    monkeypatch.setattr(plots, "_save", spy)
    rows = [{"method": m, "concurrency": c, "goodput_tok_s": g}
            for m, c, g in [("ar", 1, 10.0), ("ar", 4, 30.0), ("ngram-d8", 1, 15.0), ("ngram-d8", 4, 40.0)]]  # fmt: skip
    plots.goodput_vs_concurrency(
        rows, tmp_path / "goodput.png", title="tiny (float32)", note=f"measured on {LABEL}"
    )
    assert texts == [f"measured on {LABEL}"]


def test_the_sweep_history_names_the_machine_and_an_open_loop_plot_its_axis(tmp_path, monkeypatch):
    """The sweep history plot had no footer (a live tokens/s study plots absolute timings); an open-loop serve-bench
    labelled its batch cap "concurrency (requests in flight)"."""
    import experiments.plots as plots

    texts, labels = [], []
    save = plots._save

    def spy(fig, path, note=""):
        out = save(fig, path, note)
        texts.extend(t.get_text() for t in fig.texts)
        labels.extend(ax.get_xlabel() for ax in fig.axes)
        return out

    monkeypatch.setattr(plots, "_save", spy)
    trials = [{"number": i, "value": v, "state": "COMPLETE"} for i, v in enumerate([1.0, 2.0])]
    plots.sweep_history(trials, tmp_path / "h.png", note=f"measured on {LABEL}")
    rows = [{"method": "ar", "concurrency": c, "goodput_tok_s": g} for c, g in [(1, 10.0), (4, 30.0)]]
    plots.goodput_vs_concurrency(
        rows, tmp_path / "g.png", xlabel="max batch (open loop: Poisson at 2.0 req/s)"
    )
    assert texts == [f"measured on {LABEL}"]
    assert labels == ["trial", "max batch (open loop: Poisson at 2.0 req/s)"]
