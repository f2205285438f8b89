"""Where the ``python -m env.*`` programs write their results (``env.cli.output_file``): never over a file they
read (an input named again, a model's or a head's folder, a cost model taken by default), never over something that
is no earlier result (a JSONL, a FIFO, a file too large to check), and only the one JSON value a run writes."""

from __future__ import annotations

import json
import os

import pytest

from tests.env.conftest import _one_line_error


def test_output_file_checks(tmp_path):
    from env.cli import ProgramError, output_file

    assert output_file(None) is None
    assert output_file(tmp_path / "new" / "x.json") == tmp_path / "new" / "x.json"
    (tmp_path / "f").write_text("")
    with pytest.raises(ProgramError, match="is a file, not a directory"):
        output_file(tmp_path / "f" / "x.json")
    with pytest.raises(ProgramError, match="--out .* is a directory"):
        output_file(tmp_path, "--out")


def test_bench_serve_env_never_writes_its_json_over_its_cost_model(no_model, tmp_path, capsys):
    import shutil

    from env.batch_cost import default_batch_cost_path
    from env.bench_serve_env import main

    cost = tmp_path / "bc.json"
    shutil.copy(default_batch_cost_path(), cost)
    before = cost.read_bytes()
    code = main(["--envs", "1", "--steps", "1", "--reps", "1", "--cost", str(cost), "--json", str(cost)])
    _one_line_error(capsys, code, "is also an input of this command")
    assert cost.read_bytes() == before


JSONL = '{"question_id": 1, "turns": ["a"]}\n{"question_id": 2, "turns": ["b"]}\n'


@pytest.mark.parametrize(
    "text, kept",
    [
        (JSONL, True),  # a Spec-Bench question.jsonl or a records.jsonl: its first byte is "{" too
        ("[1, 2]\n[3]\n", True),
        ('{"rows": [', True),  # not one whole JSON value
        ("42\n", True),  # one value, but no result of ours
        ('{"rows": [1, 2], "complete": true}\n', False),  # an earlier result
        ("[1, 2]", False),
        ("", False),  # nothing to lose
        (" \n", False),
    ],
)
def test_json_output_overwrites_only_one_json_value(text, kept, tmp_path):
    """An existing file counted as an earlier ``--json`` result when its first byte was ``{`` or ``[``: a JSONL
    named by ``--json`` was destroyed. Now the whole file must parse as one JSON object or array."""
    from env.cli import ProgramError, holds_other_than_json, output_file

    path = tmp_path / "out.json"
    path.write_text(text)
    assert holds_other_than_json(path) is kept
    if kept:
        with pytest.raises(ProgramError, match="exists and is not a JSON file; not overwritten"):
            output_file(path)
    else:
        assert output_file(path) == path
    assert output_file(tmp_path / "missing.json") == tmp_path / "missing.json"


def test_an_output_that_is_no_regular_file_is_refused_and_kept(tmp_path, capsys):
    """Results are written under a temporary name and renamed over the output: a FIFO (or, for root, a device such as
    /dev/null) named there was replaced by a regular file, and reading it to check for JSON blocked."""

    from env.bench_serve_env import main
    from env.cli import ProgramError, output_file

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(
        ProgramError, match="is not a regular file .a device, FIFO or socket.; not overwritten"
    ):
        output_file(fifo)
    assert main(["--envs", "1", "--steps", "2", "--reps", "1", "--json", str(fifo)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a regular file" in err, err
    assert fifo.is_fifo()


def test_json_output_refuses_a_file_too_large_to_check(monkeypatch, tmp_path):
    import env.cli
    import kernels.timing

    path = tmp_path / "big.json"
    path.write_text(json.dumps({"rows": list(range(100))}))
    assert not env.cli.holds_other_than_json(path)
    monkeypatch.setattr(kernels.timing, "EARLIER_JSON_MAX_BYTES", 64)
    assert env.cli.holds_other_than_json(path)


def test_output_file_refuses_an_input_of_the_command(tmp_path):
    from env.cli import ProgramError, output_file

    src = tmp_path / "cost.json"
    src.write_text("{}")
    with pytest.raises(ProgramError, match="is also an input of this command"):
        output_file(src, inputs=(None, "roofline:h100-sxm/llama-3.1-8b", tmp_path / "." / "cost.json"))
    assert output_file(tmp_path / "other.json", inputs=(src,)) == tmp_path / "other.json"


def _fake_run(prompts, trace, cost_model, seed, on_prompt=None):
    on_prompt({"prompts": 1, "rows": [{"prompt": "p0"}], "complete": False})
    raise KeyboardInterrupt


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--cost-model", "{cm}", "--json", "{cm}"], "--json {cm} is also an input"),
        (["--trace", "{trace}", "--json", "{trace}"], "--json {trace} is also an input"),
        (["--json", "{jsonl}"], "is not a JSON file"),
        (["--calibrate", "--trace", "{trace}", "--save-cost-model", "{trace}"], "is also an input"),
        (["--calibrate", "--json", "{tmp}/a.json", "--save-cost-model", "{tmp}/a.json"], "both name"),
    ],
)
def test_fidelity_does_not_overwrite_its_inputs(args, expected, monkeypatch, no_model, tmp_path, capsys):
    """``--json`` (and ``--save-cost-model``) naming the cost model or the trace read was overwritten by the rows."""
    import env.fidelity as fid
    from env.cost import default_cost_model_path
    from env.trace import default_trace_path

    monkeypatch.setattr(fid, "run", _fake_run)
    files = {"cm": tmp_path / "cm.json", "trace": tmp_path / "t.npz", "jsonl": tmp_path / "question.jsonl"}
    files["cm"].write_bytes(default_cost_model_path().read_bytes())
    files["trace"].write_bytes(default_trace_path().read_bytes())
    files["jsonl"].write_text(JSONL)
    before = {k: p.read_bytes() for k, p in files.items()}
    subst = {"{tmp}": str(tmp_path), **{f"{{{k}}}": str(p) for k, p in files.items()}}

    def fill(text):
        for k, v in subst.items():
            text = text.replace(k, v)
        return text

    code = fid.main([fill(a) for a in args])
    _one_line_error(capsys, code, fill(expected))
    assert {k: p.read_bytes() for k, p in files.items()} == before


@pytest.mark.parametrize(
    "program",
    ["env.bench_device_step", "env.bench_forward", "env.bench_batch", "env.bench_draft", "env.fidelity",
     "experiments.serve_fidelity", "experiments.bench_allocator"],
)  # fmt: skip
def test_json_inside_the_model_folder_read_is_refused(program, no_model, tmp_path, capsys, monkeypatch):
    """``--json MODEL/config.json`` passed every check (it is JSON) and replaced the model's config with the rows;
    the next load failed. Any output inside the folder of the model read (a local one, or the embedded model's
    converted folder in the cache) is refused before the model loads."""
    import importlib

    from env.model import DEFAULT_MODEL

    monkeypatch.setenv("DRAFTGYM_CACHE", str(tmp_path / "cache"))
    if program in ("env.bench_device_step", "env.bench_forward"):
        folder, extra = tmp_path / "model", ["--model", str(tmp_path / "model")]
    else:  # these read the embedded model
        folder, extra = tmp_path / "cache" / "models" / DEFAULT_MODEL, []
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    for out in (folder / "config.json", folder / "sub" / "rows.json"):
        code = importlib.import_module(program).main([*extra, "--json", str(out)])
        _one_line_error(capsys, code, f"--json {out} is inside {folder}, which this command reads")
    assert (folder / "config.json").read_text() == '{"model_type": "llama"}' and not (folder / "sub").exists()


def test_bench_draft_json_is_not_written_among_the_heads(no_model, tmp_path, capsys, monkeypatch):
    """The shipped heads' descriptions are JSON: ``--json`` naming one replaced it with the rows."""
    from drafters.heads import DATA_DIR
    from env.bench_draft import main

    monkeypatch.setenv("DRAFTGYM_CACHE", str(tmp_path / "cache"))
    out = DATA_DIR / "eagle-smollm2-135m-instruct.json"
    before = out.read_bytes()
    _one_line_error(capsys, main(["--json", str(out)]), f"is inside {DATA_DIR}, which this command reads")
    assert out.read_bytes() == before


def test_output_file_refuses_a_path_inside_a_folder_read(tmp_path):
    from env.cli import ProgramError, output_file

    read = tmp_path / "read"
    read.mkdir()
    for out in (read / "x.json", tmp_path / "read" / ".." / "read" / "deep" / "x.json"):
        with pytest.raises(ProgramError, match="which this command reads"):
            output_file(out, folders=(None, read))
    assert (
        output_file(tmp_path / "readme.json", folders=(read,)) == tmp_path / "readme.json"
    )  # a sibling name
    (tmp_path / "link").symlink_to(read)
    with pytest.raises(ProgramError, match="which this command reads"):
        output_file(tmp_path / "link" / "x.json", folders=(read,))


def test_a_file_of_a_draftgym_format_is_no_earlier_json_result(tmp_path):
    """A cost model is one JSON object too: a benchmark's ``--json`` replaced it, as ``calibrate --out`` replaced a
    bench run's ``bench.json``. A JSON object with a ``format`` is another kind of file; an output of a format
    replaces only a file of that format (or an empty one)."""
    from env.cli import ProgramError, output_file
    from env.cost import FORMAT

    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps({"format": FORMAT, "version": 1}))
    before = cost.read_bytes()
    with pytest.raises(ProgramError, match=rf"is not a JSON result \(a {FORMAT} file\); not overwritten"):
        output_file(cost)
    assert output_file(cost, "--save-cost-model", formats=(FORMAT,)) == cost
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"rows": [1, 2]}))
    with pytest.raises(ProgramError, match=f"is not a {FORMAT} file; not overwritten"):
        output_file(bench, "--save-cost-model", formats=(FORMAT,))
    empty = tmp_path / "empty.json"
    empty.write_text("")
    assert output_file(empty, "--save-cost-model", formats=(FORMAT,)) == empty
    assert cost.read_bytes() == before and json.loads(bench.read_text()) == {"rows": [1, 2]}
