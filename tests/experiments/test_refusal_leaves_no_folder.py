"""A command refused in one line leaves no output folder it made (an empty ``--out`` folder stayed behind after
``bench``'s, ``train``'s and ``evaluate``'s refusals), and ``serve-bench`` refuses a bad head file before its
folder holds anything (it wrote ``settings.json``, ``cells.jsonl`` and ``drafter_options.json`` first). A folder
that was there before stays, empty or not."""

from __future__ import annotations

import pytest

from experiments.cli import main

BAD_HEAD = ["--drafter-option", 'eagle.weights="nope"']


@pytest.mark.model
@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "--limit", "1", "--methods", "eagle-d2", *BAD_HEAD],
        ["serve-bench", "--limit", "1", "--methods", "eagle-d2", *BAD_HEAD],
    ],
    ids=["bench", "serve-bench"],
)
def test_a_bad_head_file_leaves_no_run_folder(tmp_path, capsys, argv):
    out = tmp_path / "deep" / "run"
    assert main([*argv, "--out", str(out)]) == 2
    assert "no eagle head at nope.safetensors" in capsys.readouterr().err
    assert not (tmp_path / "deep").exists()  # the folders it made, parents too
    (tmp_path / "kept").mkdir()  # a folder given that was there: kept
    assert main([*argv, "--out", str(tmp_path / "kept")]) == 2
    assert (tmp_path / "kept").is_dir()


def test_a_refused_evaluate_leaves_no_folder(tmp_path, capsys):
    out = tmp_path / "e6"
    assert main(["evaluate", str(tmp_path / "nope.zip"), "--no-live", "--out", str(out)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert not out.exists()
