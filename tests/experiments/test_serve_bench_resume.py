"""Resuming ``draftgym serve-bench`` (``--out`` re-used) on the tiny random model (``random:llama-tiny``: seconds, not
the embedded model's minutes): a run killed after some cells serves only the missing ones and ends with every cell,
the kept ones byte for byte; a finished run serves nothing again; a line that is no JSON is served again and the
cells after it are kept; new methods or levels extend the folder; a setting the cells depend on, changed, is
refused in one line and the folder is left as it was; ``--seed``, which a closed loop never reads, is no such
setting."""

from __future__ import annotations

import json
import shutil

import pytest

import experiments.serve_bench as serve_bench
from experiments.cli import main
from experiments.errors import UserError

LEVELS = [1, 2]
METHODS = ["ar", "ngram-d2"]
RUN_CELL = serve_bench.run_cell


def _argv(out, *extra, methods=METHODS, levels=LEVELS):
    return ["serve-bench", "--model", "random:llama-tiny", "--dtype", "fp32", "--limit", "3", "--max-new-tokens",
            "6", "--concurrency", ",".join(map(str, levels)), "--methods", ",".join(methods), "--out", str(out),
            "--json", *extra]  # fmt: skip


def _cells(out):
    return [json.loads(line) for line in (out / "cells.jsonl").read_text().splitlines()]


def _tokens(out):
    """Each request's greedy tokens, by (method, level, prompt), from serve.json."""
    reqs = json.loads((out / "serve.json").read_text())["requests"]
    return {(q["method"], q["concurrency"], q["prompt_id"]): q["token_ids"] for q in reqs}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A folder of one finished run: its four cells, in the order they were served (level by level)."""
    out = tmp_path_factory.mktemp("serve-bench") / "sb"
    assert main(_argv(out)) == 0
    assert [(c["method"], c["concurrency"]) for c in _cells(out)] == [(m, c) for c in LEVELS for m in METHODS]
    return out


@pytest.fixture
def folder(finished, tmp_path):
    """A copy of the finished folder to change."""
    return shutil.copytree(finished, tmp_path / "sb")


def _served(monkeypatch, kill_after=None):
    """The (method, level) of each cell served from now on (the warm-up, of 4 tokens, left out); ``kill_after``:
    a kill (Ctrl-C) when that many have been served."""
    timed = []

    def spy(loaded, method, level, prompts, rids, args, engines):
        if args.max_new_tokens == 6:
            if len(timed) == kill_after:
                raise KeyboardInterrupt
            timed.append((method, level))
        return RUN_CELL(loaded, method, level, prompts, rids, args, engines)

    monkeypatch.setattr(serve_bench, "run_cell", spy)
    return timed


def test_a_run_killed_after_two_cells_serves_the_other_two_and_ends_with_the_same_results(
    finished, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "sb"
    _served(monkeypatch, kill_after=2)
    assert main(_argv(out)) == 130
    kept = (out / "cells.jsonl").read_text()
    assert [(c["method"], c["concurrency"]) for c in _cells(out)] == [("ar", 1), ("ngram-d2", 1)]
    assert not (out / "serve.json").exists()

    timed = _served(monkeypatch)
    capsys.readouterr()
    assert main(_argv(out)) == 0
    assert timed == [("ar", 2), ("ngram-d2", 2)]  # only the missing cells are served
    text = (out / "cells.jsonl").read_text()
    assert text.startswith(kept)
    cells = _cells(out)
    assert [(c["method"], c["concurrency"]) for c in cells] == [(m, c) for c in LEVELS for m in METHODS]
    assert cells[0]["session"] == cells[1]["session"] != cells[2]["session"] == cells[3]["session"]
    data = json.loads((out / "serve.json").read_text())
    assert [(r["method"], r["concurrency"], r["session"]) for r in data["rows"]] == [
        (c["method"], c["concurrency"], c["session"]) for c in cells
    ]
    assert [r["goodput_tok_s"] for r in data["rows"][:2]] == [
        c["summary"]["goodput_tok_s"] for c in cells[:2]
    ]
    assert _tokens(out) == _tokens(finished)  # the same greedy tokens as the run that was not killed
    assert json.loads(capsys.readouterr().out)["rows"] == data["rows"]


def test_a_finished_run_run_again_serves_nothing_and_writes_the_same_rows(folder, monkeypatch):
    cells, rows = (
        (folder / "cells.jsonl").read_text(),
        json.loads((folder / "serve.json").read_text())["rows"],
    )
    timed = _served(monkeypatch)
    assert main(_argv(folder)) == 0
    assert timed == [] and (folder / "cells.jsonl").read_text() == cells
    assert json.loads((folder / "serve.json").read_text())["rows"] == rows


def test_a_torn_last_line_is_cut_and_a_line_that_is_no_json_is_served_again(folder):
    lines = (folder / "cells.jsonl").read_text().splitlines(keepends=True)
    # line 2 (ngram-d2 at 1) damaged in the middle of the file, and a kill tore a fifth line
    (folder / "cells.jsonl").write_text(
        lines[0] + "not json\n" + "".join(lines[2:]) + '{"method": "ar", "conc'
    )
    assert main(_argv(folder)) == 0
    cells = _cells_skipping_bad(folder)
    assert [(c["method"], c["concurrency"]) for c in cells] == [
        ("ar", 1),
        ("ar", 2),
        ("ngram-d2", 2),
        ("ngram-d2", 1),
    ]
    assert len({c["session"] for c in cells[:3]}) == 1 and cells[3]["session"] != cells[0]["session"]
    text = (folder / "cells.jsonl").read_text()
    assert text.startswith(lines[0] + "not json\n" + "".join(lines[2:]))
    kept = text.splitlines()  # the torn fragment is gone, not skipped: every other line is a whole cell
    assert len(kept) == 5 and kept[1] == "not json"
    assert [json.loads(x)["method"] for x in kept if x != "not json"] == ["ar", "ar", "ngram-d2", "ngram-d2"]


def _cells_skipping_bad(out):
    cells = []
    for line in (out / "cells.jsonl").read_text().splitlines():
        try:
            cells.append(json.loads(line))
        except ValueError:
            continue
    return cells


def test_another_method_and_level_extend_the_folder_serving_only_the_new_cells(folder):
    before = (folder / "cells.jsonl").read_text()
    assert main(_argv(folder, methods=[*METHODS, "ngram-d4"], levels=[*LEVELS, 3])) == 0
    text = (folder / "cells.jsonl").read_text()
    assert text.startswith(before)
    new = [(c["method"], c["concurrency"]) for c in _cells(folder)[len(LEVELS) * len(METHODS) :]]
    assert new == [("ngram-d4", 1), ("ngram-d4", 2), ("ar", 3), ("ngram-d2", 3), ("ngram-d4", 3)]
    rows = json.loads((folder / "serve.json").read_text())["rows"]
    assert [(r["method"], r["concurrency"]) for r in rows] == [
        (m, c) for c in [*LEVELS, 3] for m in [*METHODS, "ngram-d4"]
    ]


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--limit", "2"], ["other settings", "prompt_ids"]),
        (["--max-batch", "1"], ["other settings", "max_batch"]),
        (["--kv-budget", "100000"], ["other settings", "kv_budget"]),
        (["--prefill-chunk", "8"], ["other settings", "prefill_chunk"]),
        (["--rate", "50"], ["other settings", "rate"]),
        (["--drafter-option", "suffix.depth_limit=2", "--drafter-option", "suffix.max_match=1"],
         ["holds results run with --drafter-option {}"]),
    ],
)  # fmt: skip
def test_a_changed_setting_is_refused_in_one_line_and_the_folder_is_kept(folder, capsys, extra, needles):
    cells, settings = (folder / "cells.jsonl").read_text(), (folder / "settings.json").read_text()
    capsys.readouterr()
    assert main([*_argv(folder), *extra]) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and all(n in err[0] for n in needles), err
    assert (folder / "cells.jsonl").read_text() == cells and (
        folder / "settings.json"
    ).read_text() == settings


def test_the_seed_of_a_closed_loop_is_no_setting_it_resumes(folder):
    cells = (folder / "cells.jsonl").read_text()
    assert main([*_argv(folder), "--seed", "5"]) == 0
    assert (folder / "cells.jsonl").read_text() == cells


def test_a_line_that_is_json_but_no_cell_is_named_by_its_number(finished, tmp_path):
    lines = (finished / "cells.jsonl").read_text().splitlines()
    (tmp_path / "cells.jsonl").write_text("\n".join([lines[0], "not json", lines[1], "{}", lines[2]]) + "\n")
    with pytest.raises(UserError, match=r"cells.jsonl: line 4 .*delete that line"):
        serve_bench.load_cells(tmp_path / "cells.jsonl")
    (tmp_path / "cells.jsonl").write_text("\n".join([lines[0], "not json", lines[1], lines[2]]) + "\n")
    assert list(serve_bench.load_cells(tmp_path / "cells.jsonl")) == [("ar", 1), ("ngram-d2", 1), ("ar", 2)]
