"""``train-drafter`` inputs that used to pass silently: an ``--out`` inside the work folder (it replaced a data part),
a workload whose prompt text changed under the same ids (its old answers and training state were reused), an
unbounded ``--threads`` (a segfault), and empty ``--work``/``--out``/``--model`` (taken as the defaults).

The runs are real, on ``random:llama-tiny`` with a handful of prompts, eight answer tokens and one step (``--work``
and ``--out`` given: the draftgym cache holds only the model's files, as in the other tests of that model)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from experiments.cli import build_parser, main

QA = ["Who played anna in once upon a time?", "Where was the 2015 rugby union world cup held?", "Who is Ada?"]


def _workload(path: Path, texts: list[str]) -> Path:
    rows = [{"question_id": 321 + i, "category": "qa", "turns": [t]} for i, t in enumerate(texts)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _train(workload: Path, work: Path, out: Path) -> int:
    return main(["train-drafter", "eagle3", "--model", "random:llama-tiny", "--workload", str(workload),
                 "--exclude-per-category", "1", "--general-prompts", "1", "--code-prompts", "0", "--text-tokens",
                 "0", "--max-new-tokens", "8", "--draft-vocab", "64", "--train-window", "32", "--steps", "1",
                 "--json", "--work", str(work), "--out", str(out)])  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Path]:
    """One finished run: its workload and work folder (tests copy the folder before they change it)."""
    d = tmp_path_factory.mktemp("trained")
    wl = _workload(d / "wl.jsonl", QA)
    assert _train(wl, d / "W", d / "head" / "h") == 0
    return {"workload": wl, "work": d / "W"}


@pytest.fixture
def work(trained, tmp_path) -> Path:
    return Path(shutil.copytree(trained["work"], tmp_path / "W"))


def _one_line_error(capsys, *needles: str) -> str:
    err = capsys.readouterr().err.strip()  # the model's loading bars first, then the error alone on its line
    assert "Traceback" not in err, err
    err = err.splitlines()[-1]
    assert err.startswith("draftgym"), err
    for needle in needles:
        assert needle in err, err
    return err


def test_an_out_inside_the_work_folder_is_refused_and_the_data_stay(trained, work, tmp_path, capsys):
    part = work / "answers" / "part-00000.safetensors"
    before = part.read_bytes()
    for out in (work / "answers" / "part-00000", work / "sub" / ".." / "head"):
        capsys.readouterr()
        assert _train(trained["workload"], work, out) == 2
        _one_line_error(capsys, "inside the work folder", "--out")
        assert part.read_bytes() == before
        assert not out.with_suffix(".json").exists()


def test_another_text_under_the_same_ids_is_refused(trained, work, tmp_path, capsys):
    wl2 = _workload(tmp_path / "wl2.jsonl", [*QA[:1], "Say something different about turtles.", QA[2]])
    trains = sorted(work.glob("train-*"))
    capsys.readouterr()
    assert _train(wl2, work, tmp_path / "h2") == 2
    _one_line_error(capsys, "prompt id 322", "another text", "--work")
    assert sorted(work.glob("train-*")) == trains  # no training state touched, none made
    assert not (tmp_path / "h2.safetensors").exists()
    assert _train(trained["workload"], work, tmp_path / "h3") == 0  # the same texts still resume


def _drop_digests(folder: Path) -> None:
    """Make the parts look like ones written before the prompt digest was recorded."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    for part in folder.glob("part-*.safetensors"):
        with safe_open(str(part), framework="pt") as fh:
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118
            meta = json.loads(fh.metadata()["meta"])
        save_file(tensors, str(part), metadata={"meta": json.dumps([{k: v for k, v in m.items() if k != "prompt_sha"} for m in meta])})  # fmt: skip


def test_a_folder_without_digests_resumes_but_another_text_trains_from_its_own_state(
    trained, work, tmp_path, capsys
):
    _drop_digests(work / "answers")
    trains = sorted(work.glob("train-*"))
    assert len(trains) == 1
    assert _train(trained["workload"], work, tmp_path / "h") == 0  # no digest there: taken as it is
    info = json.loads((work / "answers" / "info.json").read_text())
    assert info["answer_tokens_this_call"] == 0
    assert sorted(work.glob("train-*")) == trains  # the same prompts: the same training state
    wl2 = _workload(tmp_path / "wl2.jsonl", [*QA[:1], "Say something different about turtles.", QA[2]])
    assert _train(wl2, work, tmp_path / "h2") == 0
    assert len(list(work.glob("train-*"))) == 2  # another text: never the other run's training state


def _parse_error(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        build_parser("train-drafter").parse_args(["train-drafter", "eagle3", *argv])
    assert exit_.value.code == 2
    return _one_line_error(capsys)


@pytest.mark.parametrize("threads", ["100000", "3000000000", "-1"])
def test_threads_are_bounded(capsys, threads):
    assert "--threads: must be in [0, 1024]" in _parse_error(capsys, ["--threads", threads])
    for ok in ("0", "1024"):
        assert build_parser("train-drafter").parse_args(
            ["train-drafter", "eagle3", "--threads", ok]
        ).threads == int(ok)


@pytest.mark.parametrize("flag", ["--work", "--out", "--model"])
def test_an_empty_path_or_model_is_refused(capsys, flag):
    err = _parse_error(capsys, [flag, ""])
    assert f"argument {flag}: is empty" in err


@pytest.mark.parametrize("layers", ["0,2", "2,30", "-1"])
def test_capture_layers_out_of_the_target_are_refused_before_any_folder_is_made(
    tmp_path, monkeypatch, capsys, layers
):
    """They were checked once the model had loaded, the --work folder made by then; the target's layer count is
    read from its folder's config.json where there is one."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 30}))
    monkeypatch.setattr("env.model.load_model", lambda *a, **k: pytest.fail("the model loaded first"))
    wl = _workload(tmp_path / "wl.jsonl", QA)
    assert main(["train-drafter", "early_exit", "--model", str(model), "--workload", str(wl), "--exclude-per-category",
                 "0", f"--capture-layers={layers}", "--work", str(tmp_path / "W")]) == 2  # fmt: skip
    _one_line_error(capsys, "capture layers", "1..29")
    assert not (tmp_path / "W").exists()


def test_an_eagle3_bad_workload_is_refused_before_any_folder_is_made(tmp_path, monkeypatch, capsys):
    """eagle3 made its --work folder (and loaded the model) before it read --workload."""
    monkeypatch.setattr("env.model.load_model", lambda *a, **k: pytest.fail("the model loaded first"))
    (tmp_path / "wl.jsonl").write_text("{not json\n")
    assert main(["train-drafter", "eagle3", "--model", "random:llama-tiny", "--workload", str(tmp_path / "wl.jsonl"),
                 "--work", str(tmp_path / "W")]) == 2  # fmt: skip
    _one_line_error(capsys, "wl.jsonl")
    assert not (tmp_path / "W").exists()
