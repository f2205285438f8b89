"""``--drafter-option NAME.OPTION=VALUE`` on ``bench`` and ``serve-bench``: the option reaches the drafter (a depth cap
shows in τ, the greedy tokens stay the same), the run records it, and a resumed run with other options is
refused instead of mixing two configurations in one table. Bad options: ``test_bad_input*.py``."""

from __future__ import annotations

import json

import pytest

from experiments.args import drafter_options, same_drafter_options
from experiments.cli import main
from experiments.errors import UserError

CAP = ["--drafter-option", "suffix.depth_limit=2", "--drafter-option", "suffix.max_match=1"]  # drafts 1 token
CAPPED = {"suffix": {"depth_limit": 2, "max_match": 1}}
PROMPT = "Repeat this sentence five times, one per line: the quick brown fox jumps over the lazy dog."


def test_parsed_and_checked_before_any_model():
    assert drafter_options(None) == {}
    got = drafter_options(
        [
            "suffix.depth_limit=2",
            "suffix.max_match=1",
            "ngram.min_ngram = 2",
            "eagle3.vocab=8192",
            "ngram.max_depth=9",
        ]
    )
    assert got == {
        "suffix": {"depth_limit": 2, "max_match": 1},
        "ngram": {"min_ngram": 2, "max_depth": 9},
        "eagle3": {"vocab": 8192},
    }
    for bad, needle in [
        ("ngram=1", "NAME.OPTION=VALUE"),
        ("ngram.max_depth", "NAME.OPTION=VALUE"),
        ("a.b.c=1", "NAME.OPTION=VALUE"),
        ("bogus.x=1", "'bogus' is not a drafter"),
        ("suffix.depth_limit=2", "suffix needs depth_limit >= 2, 1 <= max_match < depth_limit"),
        ("eagle3.depth=3", "'depth' is not an option of eagle3"),
        ("eagle3.vocab=-1", "vocab must be an integer"),
        ('eagle3.tree="sideways"', "unknown tree builder"),
    ]:
        with pytest.raises(UserError, match=needle):
            drafter_options([bad])


def test_a_run_folder_keeps_its_options(tmp_path):
    same_drafter_options(tmp_path, CAPPED, started=False)
    same_drafter_options(tmp_path, CAPPED, started=True)  # the same: a resume
    with pytest.raises(UserError, match="use another --out"):
        same_drafter_options(tmp_path, {}, started=True)
    same_drafter_options(tmp_path, {}, started=False)  # nothing run yet: the folder takes the new options
    assert not (tmp_path / "drafter_options.json").exists()  # (none: no file)
    same_drafter_options(tmp_path, {}, started=True)
    assert not (tmp_path / "drafter_options.json").exists()
    same_drafter_options(tmp_path, CAPPED, started=False)
    assert json.loads((tmp_path / "drafter_options.json").read_text()) == CAPPED
    (tmp_path / "drafter_options.json").write_text("{not json")
    with pytest.raises(UserError, match="not readable JSON"):
        same_drafter_options(tmp_path, {}, started=True)


@pytest.mark.model
def test_bench_option_reaches_the_drafter_and_a_mismatched_resume_is_refused(tmp_path, capsys):
    wl = tmp_path / "q.jsonl"
    wl.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": [PROMPT]}) + "\n")
    base = ["bench", "--workload", str(wl), "--methods", "suffix-d6", "--max-new-tokens", "40", "--dtype", "fp32",
            "--json"]  # fmt: skip
    free, capped = tmp_path / "free", tmp_path / "capped"
    assert main([*base, "--out", str(free)]) == 0
    assert main([*base, "--out", str(capped), *CAP]) == 0
    capsys.readouterr()
    a = [json.loads(x) for x in (free / "records.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (capped / "records.jsonl").read_text().splitlines()]
    assert a[0]["token_ids"] == b[0]["token_ids"]  # lossless either way
    assert b[0]["tau"] <= 2.0 < a[0]["tau"]  # one drafted token per step at most, against chains of up to six
    settings = json.loads((capped / "bench.json").read_text())["settings"]
    assert settings["drafter_options"] == CAPPED
    records = (capped / "records.jsonl").read_text()
    assert main([*base, "--out", str(capped)]) == 2  # a resume without the option
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and "drafter-option" in err[0], err
    assert (capped / "records.jsonl").read_text() == records
    longer = [*base, "--out", str(capped), *CAP]
    longer[longer.index("--max-new-tokens") + 1] = "48"
    assert main(longer) == 2  # a resume of other settings: 40-token records are not 48-token ones
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and "other settings" in err[0] and "max_new_tokens" in err[0], err
    assert (capped / "records.jsonl").read_text() == records
    settings = (
        capped / "settings.json"
    ).read_text()  # started on another CPU: its timings are not this one's
    (capped / "settings.json").write_text(
        json.dumps({**json.loads(settings), "cpu": "Other CPU (family 1 model 2)"})
    )
    assert main([*base, "--out", str(capped), *CAP]) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and "cpu: 'Other CPU (family 1 model 2)' there" in err[0], err
    assert (capped / "records.jsonl").read_text() == records


@pytest.mark.model
def test_serve_bench_option_reaches_the_drafter(tmp_path, capsys):
    wl = tmp_path / "q.jsonl"
    wl.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": [PROMPT]}) + "\n")
    base = ["serve-bench", "--workload", str(wl), "--methods", "suffix-d6", "--concurrency", "1",
            "--max-new-tokens", "40", "--dtype", "fp32", "--json"]  # fmt: skip
    taus = []
    for name, extra in [("free", []), ("capped", [*CAP])]:
        assert main([*base, "--out", str(tmp_path / name), *extra]) == 0
        data = json.loads((tmp_path / name / "serve.json").read_text())
        taus.append(data["rows"][0]["tau"])
        assert data["settings"]["drafter_options"] == (CAPPED if extra else {})
    capsys.readouterr()
    assert taus[1] <= 2.0 < taus[0]
