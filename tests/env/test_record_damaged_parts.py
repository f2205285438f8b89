"""``draftgym record`` resuming from a damaged ``OUT.parts/`` folder: each part read back gets the checks a trace's
arrays get on loading (``env.trace.check_trace``), so a damaged part ends in one line naming it, with the parts kept
and no trace written, never in a traceback or in a trace that ``load_trace`` then refuses."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import env.trace_record as trace_mod
from env.trace import TraceError, load_trace
from env.trace_record import record
from env.workloads import Prompt
from tests.env.kills import dies_on_call

PROMPTS = [
    Prompt("code-d-a", "code", "Write a function that adds two numbers."),
    Prompt("code-d-b", "code", "Hi."),
]
GO = dict(max_new_tokens=4, workload="code:damaged")


@pytest.fixture(scope="module")
def tiny():
    from env.model import load_model

    return load_model("random:llama-tiny", dtype="fp32", device="cpu")


@pytest.fixture(scope="module")
def killed(tiny, tmp_path_factory):
    """A recording of PROMPTS killed while decoding the second: its parts folder holds the first prompt's part."""
    out = tmp_path_factory.mktemp("killed") / "t.npz"
    real = trace_mod.record_prompt
    trace_mod.record_prompt = dies_on_call(2, real)
    try:
        with pytest.raises(KeyboardInterrupt):
            record(tiny, PROMPTS, ["ngram"], out, progress=False, **GO)
    finally:
        trace_mod.record_prompt = real
    parts = out.with_name(out.name + ".parts")
    assert (parts / "00000.npz").is_file() and not (parts / "00001.npz").exists()
    return parts


def _copy(killed, tmp_path):
    out = tmp_path / "t.npz"
    shutil.copytree(killed, out.with_name(out.name + ".parts"))
    return out, out.with_name(out.name + ".parts") / "00000.npz"


DAMAGE = {
    "feat-as-strings": lambda a: a.update(feat=np.full(a["feat"].shape, "x")),
    "0-d-prompt": lambda a: a.update(prompt=np.int32(5)),
    "2-D-traj": lambda a: a.update(traj=a["traj"][None, :]),
    "invalid-tree": lambda a: a.update({"ngram/parents": np.full_like(a["ngram/parents"], 5)}),
    "huge-tokens": lambda a: a.update({"ngram/tokens": np.full_like(a["ngram/tokens"], 2**31 - 1)}),
    "bad-offsets": lambda a: a.update({"ngram/off": np.r_[0, 100, a["ngram/off"][2:]]}),
    "nan-feat": lambda a: a.update(feat=np.full_like(a["feat"], np.nan)),
    "no-feat": lambda a: a.pop("feat"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_a_damaged_part_is_refused_naming_it_and_the_parts_are_kept(case, tiny, killed, tmp_path):
    out, part = _copy(killed, tmp_path)
    arrays = dict(np.load(part))
    DAMAGE[case](arrays)
    np.savez(part, **arrays)
    before = part.read_bytes()
    with pytest.raises(TraceError) as err:
        record(tiny, PROMPTS, ["ngram"], out, progress=False, **GO)
    msg = str(err.value)
    assert str(part) in msg and f"delete {part.parent} to record afresh" in msg and "\n" not in msg
    assert part.read_bytes() == before and not out.exists()  # nothing assembled, nothing deleted


def test_a_part_in_another_prompts_place_is_refused(tiny, killed, tmp_path):
    """Prompt 0's part copied into prompt 1's place was resumed, and the trace labelled it prompt 1."""
    out, part = _copy(killed, tmp_path)
    moved = part.with_name("00001.npz")
    shutil.copy(part, moved)
    with pytest.raises(TraceError, match=f"{moved} records another prompt than prompt code-d-b") as err:
        record(tiny, PROMPTS, ["ngram"], out, progress=False, **GO)
    assert "\n" not in str(err.value) and moved.is_file() and not out.exists()


def test_an_intact_part_is_resumed_saying_so(tiny, killed, tmp_path, capsys):
    out, _ = _copy(killed, tmp_path)
    trace = record(tiny, PROMPTS, ["ngram"], out, progress=True, **GO)
    assert "resuming: 1 of 2 prompts already recorded" in capsys.readouterr().err
    assert trace.num_prompts == 2 and load_trace(out).num_prompts == 2
    assert not out.with_name(out.name + ".parts").exists()


def test_the_cli_reports_a_damaged_part_in_one_line_without_a_resume_line(tmp_path, capsys, monkeypatch):
    from experiments.cli import main

    out = tmp_path / "t.npz"
    argv = ["record", "--model", "random:llama-tiny", "--limit", "1", "--max-new-tokens", "3", "--out", str(out)]  # fmt: skip

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(trace_mod, "_assemble", killed)  # killed after its one part
    assert main(argv) == 130
    monkeypatch.undo()
    part = out.with_name(out.name + ".parts") / "00000.npz"
    arrays = dict(np.load(part))
    arrays.pop("feat")
    np.savez(part, **arrays)
    capsys.readouterr()
    assert main(argv) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert lines == [
        f"draftgym record: error: recorded part {part} holds no feat array; delete {part.parent} to record afresh"
    ]


def _foreign_file(parts):
    (parts / "notes.txt").write_text("mine")
    return parts / "notes.txt"


def _foreign_folder(parts):
    (parts / "00002.npz").mkdir()  # a part's name, but a folder
    return parts / "00002.npz"


def _foreign_done(parts):
    done = parts.with_name(parts.name + ".done")
    done.mkdir()
    (done / "keep.me").write_text("mine")
    return done / "keep.me"


def _parts_a_file(parts):
    shutil.rmtree(parts)
    parts.write_text("mine")
    return parts


def _parts_a_link(parts):
    other = parts.with_name("elsewhere")
    parts.rename(other)
    parts.symlink_to(other, target_is_directory=True)
    return other / "00000.npz"


@pytest.mark.parametrize("finished", [False, True], ids=["resumed", "finished"])
@pytest.mark.parametrize(
    "plant", [_foreign_file, _foreign_folder, _foreign_done, _parts_a_file, _parts_a_link]
)
def test_a_parts_folder_with_what_no_recording_writes_is_refused_and_kept(
    plant, finished, tiny, killed, tmp_path
):
    """The parts folder and its ``.done`` trash are deleted whole when a recording ends (or, beside a finished
    trace, when it is run again): a user's file there, or a parts 'folder' that is a file or a link, was deleted
    with them or ended in a traceback."""
    out, _ = _copy(killed, tmp_path)
    if finished:
        shutil.copy(out.with_name(out.name + ".parts") / "00000.npz", tmp_path / "part.npz")
        record(tiny, PROMPTS, ["ngram"], out, progress=False, **GO)
        out.with_name(out.name + ".parts").mkdir()
        shutil.copy(tmp_path / "part.npz", out.with_name(out.name + ".parts") / "00000.npz")
    before = out.read_bytes() if finished else None
    mine = plant(out.with_name(out.name + ".parts"))
    with pytest.raises(
        TraceError, match="which no recording writes|is not a folder of recorded parts"
    ) as err:
        record(tiny, PROMPTS, ["ngram"], out, progress=False, **GO)
    assert "\n" not in str(err.value) and "choose another --out" in str(err.value)
    assert mine.exists()  # kept
    assert (out.read_bytes() == before) if finished else not out.exists()


def test_what_a_killed_recording_leaves_in_its_parts_is_resumed(tiny, killed, tmp_path):
    """The temporary files a kill can leave (a part's, the probes' state's, ``env.files``' of the header) and a part
    numbered past 99,999 are a recording's own: resumed over, then deleted with the folder."""
    out, part = _copy(killed, tmp_path)
    parts = part.parent
    for name in ("00001.tmp.npz", "probes.tmp.npz", f".header.json.{12345}.tmp"):
        (parts / name).write_bytes(b"torn")
    trace = record(tiny, PROMPTS, ["ngram"], out, progress=False, **GO)
    assert trace.num_prompts == 2 and not parts.exists()
    trace_mod._check_parts_contents(tmp_path / "other.npz")  # no folders: nothing to check
    (tmp_path / "other.npz.parts").mkdir()
    (tmp_path / "other.npz.parts" / "100000.npz").write_bytes(b"")
    (tmp_path / "other.npz.parts" / "100000.tmp.npz").write_bytes(b"")
    trace_mod._check_parts_contents(tmp_path / "other.npz")


def test_the_cli_refuses_a_parts_file_before_the_model_loads(tmp_path, capsys, monkeypatch):
    import env.model
    from experiments.cli import main

    monkeypatch.setattr(env.model, "load_model", lambda *a, **k: pytest.fail("the model loaded first"))
    (tmp_path / "t.npz.parts").write_text("mine")
    assert (
        main(["record", "--model", "random:llama-tiny", "--limit", "1", "--out", str(tmp_path / "t.npz")])
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "t.npz.parts is not a folder of recorded parts" in err, err
    assert (tmp_path / "t.npz.parts").read_text() == "mine"
