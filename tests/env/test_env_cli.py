"""``draftgym calibrate`` and ``draftgym record``: help and a tiny record run (bad input: tests/experiments/test_bad_input.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest


def _run(*args):
    return subprocess.run(
        [sys.executable, "-m", "experiments", *args], capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize("cmd", ["calibrate", "record"])
def test_help(cmd, capsys):
    from experiments.cli import main

    assert main([cmd, "--help"]) == 0
    out = capsys.readouterr().out
    assert "--json" in out and "--out" in out


@pytest.mark.model
def test_record_a_tiny_trace(tmp_path):
    out = tmp_path / "tiny.npz"
    r = _run("record", "--out", str(out), "--limit", "1", "--max-new-tokens", "3", "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert (
        summary["prompts"] == 1
        and 1 <= summary["positions"] <= 3
        and summary["drafters"] == {"ngram": "exact"}
    )
    assert out.is_file()
    # a trace too small to hold any prompt out: evaluate refuses it in one line (it printed a table of nan before)
    r = _run("evaluate", "--trace", str(out), "--no-live")
    assert r.returncode == 2 and "leaves no held-out prompt" in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1, r.stderr


@pytest.mark.model
def test_record_keeps_its_drafter_options_and_refuses_a_rerun_with_others(tmp_path):
    from env.trace import load_trace

    out = tmp_path / "opt.npz"
    args = ["record", "--out", str(out), "--limit", "1", "--max-new-tokens", "3", "--json"]
    r = _run(*args, "--drafter-option", "ngram.max_ngram=2")
    assert r.returncode == 0, r.stderr
    assert load_trace(out).drafters["ngram"]["options"] == {"max_ngram": 2}
    r = _run(*args, "--drafter-option", "ngram.max_ngram=3")  # another configuration under the same file
    assert r.returncode == 2 and "other settings" in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_record_refuses_an_option_for_a_drafter_it_does_not_record(tmp_path):
    r = _run("record", "--out", str(tmp_path / "x.npz"), "--drafters", "ngram", "--drafter-option",
             "suffix.cache_requests=0")  # fmt: skip
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "suffix, which --drafters does not record" in r.stderr and not (tmp_path / "x.npz").exists()


@pytest.mark.parametrize("text, needle", [("0", "must be >= 1, got 0"), ("-" + "9" * 40, "must be >= 1, got -999999... (40 digits)"), ("1" + "0" * 30, "(31 digits)"),
                                          ("x" * 100, "expected an integer")])  # fmt: skip
def test_an_integer_option_out_of_range_is_one_short_message(text, needle):
    """``env.cli.positive_int`` (the programs' counts): bounded above too, so no huge count reaches an allocation,
    and the message stays short whatever the text."""
    import argparse

    from env.cli import positive_int

    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(needle)) as err:
        positive_int(text)
    assert len(str(err.value)) < 80


@pytest.mark.parametrize("batch", [[], ["--batch"]])
def test_calibrate_times_the_drafters_with_the_options_given_and_keeps_them(
    tmp_path, monkeypatch, capsys, batch
):
    """``calibrate --drafter-option`` times the drafters as a trace recorded them (e.g. the hybrid's suffix cache
    off): the options reach the calibration and are kept in the cost model's meta; an option for a drafter it does
    not time is one line and exit 2."""
    import env.batch_calibrate as bcal
    import env.calibrate as cal
    from experiments.cli import main

    seen = []
    for mod, name in ((bcal, "calibrate_batch"), (cal, "calibrate")):
        real = getattr(mod, name)

        def spy(*a, _real=real, **k):
            seen.append(k.get("drafter_options"))
            return _real(*a, **{**k, "reps": 1} if "reps" in k else k)

        monkeypatch.setattr(mod, name, spy)
    out = tmp_path / "c.json"
    argv = ["calibrate", *batch, "--model", "random:llama-tiny", "--drafters", "ngram", "--reps", "1", "--json",
            "--drafter-option", "ngram.max_ngram=3", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert seen == [{"ngram": {"max_ngram": 3}}]
    assert json.loads(out.read_text())["meta"]["drafter_options"] == {"ngram": {"max_ngram": 3}}
    argv[argv.index("ngram.max_ngram=3")] = "suffix.cache_requests=0"
    capsys.readouterr()
    assert main(argv) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and "names suffix, which --drafters does not time" in err[0], err
