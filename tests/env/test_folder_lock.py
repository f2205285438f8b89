"""One command at a time in a run folder (``env.folder_lock``): a second process is refused in one line naming the
folder and the process that holds it, nothing is written in the folder, a killed holder leaves no lock behind, and
a command releases its folders when it returns."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from env.folder_lock import FolderBusy, claim_folder, release_folder, release_folders

HOLD = """
import sys, time
from env.folder_lock import claim_folder
claim_folder(sys.argv[1], "held")
print("held", flush=True)
time.sleep(120)
"""


class Holder:
    """Another process holding ``folder`` until it is killed."""

    def __init__(self, folder: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "held"

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)  # as kill -9: nothing of its own runs
        self.proc.wait(timeout=30)


@pytest.fixture
def held(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    holder = Holder(folder)
    yield folder, holder
    if holder.proc.poll() is None:
        holder.kill()


def test_a_folder_another_process_holds_is_refused_naming_it_and_the_process(held):
    folder, holder = held
    with pytest.raises(FolderBusy) as err:
        claim_folder(folder, f"--out {folder}")
    msg = str(err.value)
    assert msg.startswith(f"--out {folder} is in use by another process") and "\n" not in msg
    assert f"(pid {holder.proc.pid})" in msg
    assert list(folder.iterdir()) == []  # the lock is on the folder: nothing is made in it


def test_a_killed_holder_leaves_no_lock_and_a_release_lets_another_process_in(held):
    folder, holder = held
    holder.kill()
    claim_folder(folder, "x")
    claim_folder(folder, "x")  # this process holds it: a no-op
    with pytest.raises(AssertionError):
        Holder(folder)  # while this process holds it, the other cannot (it fails before saying "held")
    release_folder(folder)
    other = Holder(folder)
    other.kill()
    claim_folder(folder, "x")
    release_folders()
    Holder(folder).kill()


def test_a_command_on_a_held_run_folder_is_one_line_and_exit_2_before_any_work(held, capsys):
    """``draftgym bench --out`` on a folder another run is writing: refused before the model loads, its records
    untouched; the command's own folder is released when it returns (another process may take it)."""
    from experiments.cli import main

    folder, holder = held
    records = folder / "records.jsonl"
    records.write_text(json.dumps({"method": "ar", "prompt_id": "1"}) + "\n")
    before = records.read_bytes()
    assert (
        main(["bench", "--out", str(folder), "--limit", "1", "--methods", "ar", "--max-new-tokens", "4"]) == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--out {folder} is in use by another process (pid {holder.proc.pid})" in err[0]
    assert records.read_bytes() == before
    holder.kill()
    records.unlink()
    assert (
        main(["bench", "--out", str(folder), "--limit", "1", "--methods", "ar", "--max-new-tokens", "4"]) == 0
    )
    assert len(records.read_text().splitlines()) == 1
    Holder(folder).kill()  # released when the command returned


def test_a_sweeps_shared_folder_is_not_held(held, capsys):
    """Sweep workers share one folder (and their study): a sweep goes on in a folder another process holds (here to
    its check of the folder's config, which refuses a folder of another run); ``output_dir`` holds one only when
    asked."""
    from experiments.args import output_dir
    from experiments.cli import main

    folder, _ = held
    (folder / "config.toml").write_text('name = "another-run"\n')
    cfg = Path(__file__).resolve().parents[2] / "experiments" / "configs" / "tree_sweep.toml"
    assert main(["sweep", str(cfg), "--out", str(folder)]) == 2
    err = capsys.readouterr().err
    assert "in use" not in err and "another" in err, err
    assert output_dir(folder) == folder
    with pytest.raises(FolderBusy):
        output_dir(folder, exclusive=True)


def test_a_command_releases_only_what_it_claimed(tmp_path):
    """An in-process caller (a notebook, a test) holding a folder keeps it when a command it runs returns."""
    from experiments.cli import main

    mine, other = tmp_path / "mine", tmp_path / "other"
    mine.mkdir()
    (other / "bench.json").mkdir(parents=True)  # refused once the command holds its folder
    claim_folder(mine, "mine")
    try:
        assert main(["bench", "--out", str(other), "--limit", "1", "--methods", "ar"]) == 2
        with pytest.raises(AssertionError):
            Holder(mine)  # still held by this process
        Holder(other).kill()  # the command's own folder was released
    finally:
        release_folder(mine)


def test_a_recording_in_progress_is_not_recorded_into_by_another(fp32_model, tmp_path):
    from env.trace_record import record
    from env.workloads import load_workload

    out = tmp_path / "t.npz"
    parts = out.with_name(out.name + ".parts")
    parts.mkdir()
    holder = Holder(parts)
    try:
        with pytest.raises(FolderBusy, match=f"{parts} is in use by another process"):
            record(fp32_model, load_workload()[:1], ["ngram"], out, max_new_tokens=4, progress=False)
        assert list(parts.iterdir()) == [] and not out.exists()
    finally:
        holder.kill()
    trace = record(fp32_model, load_workload()[:1], ["ngram"], out, max_new_tokens=4, progress=False)
    assert out.is_file() and not parts.exists() and len(trace.prompt_ids) == 1
    # a rerun of the finished trace removes leftover parts, but not a folder another recording is writing
    parts.mkdir()
    (parts / "00000.npz").write_bytes(b"being written")
    holder = Holder(parts)
    try:
        with pytest.raises(FolderBusy):
            record(fp32_model, load_workload()[:1], ["ngram"], out, max_new_tokens=4, progress=False)
        assert (parts / "00000.npz").read_bytes() == b"being written"
    finally:
        holder.kill()
    assert record(fp32_model, load_workload()[:1], ["ngram"], out, max_new_tokens=4, progress=False)
    assert not parts.exists()


HOLD_FILE = """
import sys, time
from env.folder_lock import claim_file
claim_file(sys.argv[1], "held")
print("held", flush=True)
time.sleep(120)
"""


def test_a_file_renamed_into_place_is_held_through_a_lock_beside_it(tmp_path, capsys):
    """``calibrate --batch`` rewrites ``OUT.partial`` by renaming: two calibrations into one output interleaved
    their measurements. The second is refused in one line before the model loads; the lock file goes at release,
    and one a killed holder left behind is taken over."""
    from env.folder_lock import claim_file
    from experiments.cli import main

    out = tmp_path / "bc.json"
    partial = out.with_name("bc.json.partial")
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD_FILE, str(partial)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        with pytest.raises(FolderBusy, match=rf"x is in use by another process \(pid {proc.pid}\)"):
            claim_file(partial, "x")
        assert main(["calibrate", "--batch", "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"--out {out} is in use by another process" in err[0], err
        assert not partial.exists() and not out.exists()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    lock = claim_file(partial, "x")  # the killed holder's lock file is left; its lock is not
    assert lock == partial.with_name("bc.json.partial.lock") and lock.is_file()
    release_folder(lock)
    assert not lock.exists()


def test_calibrate_batch_releases_its_partial_when_it_returns(tmp_path, monkeypatch, capsys):
    """However ``calibrate --batch`` ends (here: its measuring fails), the lock beside ``OUT.partial`` is gone."""
    import env.batch_calibrate
    from env.batch_cost import CostModelError
    from env.folder_lock import claim_file
    from experiments.cli import main

    def fails(*a, **k):
        assert (tmp_path / "bc.json.partial.lock").is_file()  # held while it measures
        raise CostModelError("measuring failed")

    monkeypatch.setattr(env.batch_calibrate, "calibrate_batch", fails)
    assert main(["calibrate", "--batch", "--dtype", "fp32", "--out", str(tmp_path / "bc.json")]) == 2
    assert "measuring failed" in capsys.readouterr().err
    assert not (tmp_path / "bc.json.partial.lock").exists()
    release_folder(claim_file(tmp_path / "bc.json.partial", "x"))  # free for the next calibration


def test_a_refused_command_removes_only_the_empty_folders_it_made_and_none_another_process_holds(tmp_path):
    """A refusal removes the output folders the command made while empty; not a folder that was there, one with
    something in it, or one that another run, started at the same moment, took meanwhile (it lost its lock's
    folder)."""
    from env.files import forget_made_folders, make_folder, remove_made_folders

    (tmp_path / "was").mkdir()
    forget_made_folders()
    make_folder(tmp_path / "was" / "a" / "b")
    make_folder(tmp_path / "full")
    (tmp_path / "full" / "r.json").write_text("{}")
    make_folder(tmp_path / "taken")
    holder = Holder(tmp_path / "taken")
    try:
        remove_made_folders()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["full", "taken", "was"]
        assert list((tmp_path / "was").iterdir()) == []
    finally:
        holder.kill()
    make_folder(tmp_path / "was")  # there already: not this process's to remove
    remove_made_folders()
    assert (tmp_path / "was").is_dir()
