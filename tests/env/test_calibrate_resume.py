"""``draftgym calibrate --batch`` resumes after a kill (``env.batch_calibrate_state``): the measurements are written
after every pass over the grid and every later phase, a rerun keeps them and measures only the rest, and a work
file of other settings, another format or damaged values is refused in one line naming the field."""

from __future__ import annotations

import json
import statistics
from types import SimpleNamespace

import pytest
import torch

import env.batch_calibrate as bc
from env.batch_calibrate_state import STATE_FORMAT, CalibrationState
from env.cost import CostModelError

GRID = dict(rows=(1, 2), nodes=(1, 2), contexts=(16, 32), reps=3, prefill_tokens=(16, 64))


class Killed(Exception):
    pass


@pytest.mark.model
def test_a_killed_calibration_resumes_and_keeps_what_it_measured(fp32_model, tmp_path, monkeypatch):
    work = tmp_path / "bc.json.partial"
    real_grid = bc._time_grid

    def kill_after_two(*a, on_pass=None, **k):  # the grid's second pass is its last before the kill
        def hook(samples, n):
            on_pass(samples, n)
            if n == 2:
                raise Killed

        return real_grid(*a, on_pass=hook, **k)

    monkeypatch.setattr(bc, "_time_grid", kill_after_two)
    with pytest.raises(Killed):
        bc.calibrate_batch(fp32_model, ["ngram"], work=work, **GRID)
    saved = json.loads(work.read_text())
    assert saved["format"] == STATE_FORMAT and saved["passes"] == 2 and saved["probe"] is None
    kept = {k: list(v) for k, v in saved["samples"].items()}
    assert len(kept) == 8 and all(len(v) == 2 * bc.RUN_STEPS for v in kept.values())

    # resumed: the third pass only, then the later phases; killed again in the prefill
    monkeypatch.setattr(bc, "_time_grid", real_grid)
    real_prefill = bc._time_prefill
    monkeypatch.setattr(bc, "_time_prefill", lambda *a, **k: (_ for _ in ()).throw(Killed()))
    with pytest.raises(Killed):
        bc.calibrate_batch(fp32_model, ["ngram"], work=work, **GRID)
    mid = json.loads(work.read_text())
    assert mid["passes"] == 3 and mid["probe"] is not None and mid["prefill"] is None
    for k, v in kept.items():  # the first two passes' samples kept, the third's appended
        assert mid["samples"][k][: len(v)] == v and len(mid["samples"][k]) == 3 * bc.RUN_STEPS

    # resumed again: neither the grid nor the probe measured again
    monkeypatch.setattr(bc, "_time_prefill", real_prefill)
    monkeypatch.setattr(bc, "_probe_cells", lambda *a, **k: pytest.fail("the probe was measured again"))
    cost = bc.calibrate_batch(fp32_model, ["ngram"], work=work, **GRID)
    done = json.loads(work.read_text())
    assert (
        cost.meta["resumed"] is True and done["samples"] == mid["samples"] and done["probe"] == mid["probe"]
    )
    assert done["prefill"] and done["drafters"] and cost.drafters["ngram"] > 0
    r, n, c = 2, 2, 16  # each cell's figure is the median of its nine samples, two runs' together
    got = next(m[3] for m in cost.meta["measurements"] if m[:3] == [r, n, c])
    assert got == pytest.approx(statistics.median(done["samples"][f"{r},{n},{c}"]))
    assert cost.meta["probe"] == sorted(
        [int(k.split(",")[0]), int(k.split(",")[1]), v] for k, v in mid["probe"].items()
    )

    # a finished work file: nothing measured again, the same cost model
    monkeypatch.setattr(bc, "_time_prefill", lambda *a, **k: pytest.fail("the prefill was measured again"))
    monkeypatch.setattr(
        "env.calibrate._time_drafters", lambda *a, **k: pytest.fail("the drafters were timed again")
    )
    monkeypatch.setattr(
        bc, "_time_policy_book", lambda *a, **k: pytest.fail("the policy book was timed again")
    )
    again = bc.calibrate_batch(fp32_model, ["ngram"], work=work, **GRID)
    assert (
        (again.base == cost.base).all()
        and (again.slope == cost.slope).all()
        and again.drafters == cost.drafters
        and again.policy_book == cost.policy_book
    )
    assert done["policy_book"] == list(cost.policy_book.seconds) and cost.policy_book.nodes == GRID["rows"]
    assert 0 < cost.policy_book_s(1) <= cost.policy_book_s(2) < 0.05  # a fraction of a millisecond a step


LOADED = SimpleNamespace(model_id="m", dtype=torch.float32, weights="dense", forward="lean", device="cpu")


def _state(tmp_path, names=("ngram", "eagle3")):
    return CalibrationState.open(tmp_path / "w.json", LOADED, list(names), {}, GRID["rows"], GRID["nodes"],
                                 GRID["contexts"], GRID["reps"], batching=["eagle3"], prefill_lengths=[16, 64],
                                 run_steps=bc.RUN_STEPS)  # fmt: skip


def _written(tmp_path) -> dict:
    st = _state(tmp_path)
    cells = [(r, n, c) for r in GRID["rows"] for n in GRID["nodes"] for c in GRID["contexts"]]
    st.save_pass({cell: [0.01] * (3 * bc.RUN_STEPS) for cell in cells}, 3)
    st.save_phase("prefill", [0.02, 0.03])
    st.save_phase("drafters", {"ngram": 2e-5, "eagle3": 3e-3})
    from env.batch_cost import BatchedDraft

    st.save_batched("eagle3", BatchedDraft((1, 2), (1e-3, 2e-3), (2e-3, 3e-3)))
    st.save_phase("policy_book", [2e-4, 3e-4])
    return json.loads((tmp_path / "w.json").read_text())


@pytest.mark.parametrize(
    "damage, says",
    [
        (lambda d: d.update(format="draftgym-batch-cost-model"), "format must be"),
        (lambda d: d.update(version=7), "version must be an integer in 1..1"),
        (lambda d: d.update(code="__import__('os')"), "is no field of a calibration work file"),
        (lambda d: d["settings"].update(cpu="another CPU"), "settings are another calibration's: 'cpu'"),
        (lambda d: d["settings"].update(threads=64), "settings are another calibration's: 'threads'"),
        (lambda d: d["settings"].update(rows=[1, 2, 4]), "settings are another calibration's: 'rows'"),
        (lambda d: d.update(passes=9), "passes must be an integer in 0..3"),
        (lambda d: d.update(passes=True), "passes must be an integer"),
        (lambda d: d["samples"].update({"1,1,16": [0.01] * 8 + [float("nan")]}), "samples.1,1,16 must be a finite"),
        (lambda d: d["samples"].update({"1,1,16": [0.01]}), "samples.1,1,16 must be a list of 9 seconds"),
        (lambda d: d["samples"].update({"9,9,9": [0.01] * 9}), "samples.'9,9,9' is no cell"),
        (lambda d: d["samples"].pop("1,1,16"), "samples must hold the grid's 8 cells"),
        (lambda d: d.update(passes=2, samples={k: v[:6] for k, v in d["samples"].items()}), "prefill is measured after the grid's 3 passes, and the file has 2"),
        (lambda d: d.update(passes=0, samples={}), "prefill is measured after the grid's 3 passes, and the file has 0"),
        (lambda d: d.update(prefill=[-1.0, 0.1]), "prefill must be a finite number > 0"),
        (lambda d: d.update(prefill=[0.1]), "prefill must be 2 seconds, one per prompt length [16, 64]"),
        (lambda d: d.update(prefill="fast"), "prefill must be a list"),
        (lambda d: d.update(probe={"1,16": 0.01}), "probe must hold 4 cells"),
        (lambda d: d.update(drafters={"ngram": 1e-5}), "drafters must be the timings of ['ngram', 'eagle3']"),
        (lambda d: d.update(batched={"ngram": d["batched"]["eagle3"]}), "batched.'ngram' is no drafter timed per batch"),
        (lambda d: d["batched"]["eagle3"].update(fixed_s=[1e9, 1e9]), "batched.eagle3 fixed_s and level_s must be finite"),
        (lambda d: d["batched"].update(eagle3={"rows": [1], "fixed_s": [0.001], "level_s": [0.002]}), "batched.eagle3.rows must be the grid's rows"),
        (lambda d: d.update(policy_book=[2e-4]), "policy_book must be 2 seconds, one per row count [1, 2]"),
        (lambda d: d.update(policy_book=[3e-4, 2e-4]), "policy_book must be seconds in [0, 1], not falling"),
        (lambda d: d.update(policy_book=[0.5, 2.0]), "policy_book must be seconds in [0, 1]"),
        (lambda d: d.update(policy_book=[2e-4, "slow"]), "policy_book must be a finite number"),
        (lambda d: d.update(policy_book={"1": 2e-4}), "policy_book must be a list"),
        (lambda d: d.update(batched={}), "policy_book is measured after the drafters"),
        (lambda d: d.update(passes=2, samples={k: v[:6] for k, v in d["samples"].items()}, prefill=None, drafters=None, batched={}), "policy_book is measured after the grid's 3 passes"),
    ],
)  # fmt: skip
def test_a_work_file_of_other_settings_or_damaged_is_refused_naming_the_field(tmp_path, damage, says):
    d = _written(tmp_path)
    damage(d)
    (tmp_path / "w.json").write_text(json.dumps(d))
    with pytest.raises(CostModelError, match="calibration work file") as err:
        _state(tmp_path)
    msg = str(err.value)
    assert says in msg and "\n" not in msg and "delete it to start over" in msg, msg


@pytest.mark.parametrize("text", ["", "{", "[1, 2]", "\udcff", "null"])
def test_a_work_file_that_is_no_json_object_is_refused(tmp_path, text):
    (tmp_path / "w.json").write_text(text, encoding="utf-8", errors="surrogateescape")
    with pytest.raises(CostModelError, match="calibration work file") as err:
        _state(tmp_path)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_work_file_that_is_no_regular_file_is_refused_before_a_read(tmp_path, kind):
    """A FIFO in the work file's place would block the read forever; a folder is no file either."""
    import os

    if kind == "fifo":
        if not hasattr(os, "mkfifo"):
            pytest.skip("no FIFOs on this system")
        os.mkfifo(tmp_path / "w.json")
    else:
        (tmp_path / "w.json").mkdir()
    with pytest.raises(CostModelError, match=r"calibration work file .*w.json is not a regular file") as err:
        _state(tmp_path)
    assert "\n" not in str(err.value)


def test_a_written_work_file_reads_back_as_written(tmp_path):
    d = _written(tmp_path)
    st = _state(tmp_path)
    assert st.passes == 3 and st.resumed and st.prefill == [0.02, 0.03] and st.probe is None
    assert st.drafters == {"ngram": 2e-5, "eagle3": 3e-3} and st.batched["eagle3"].level_s == (2e-3, 3e-3)
    assert st.policy_book == [2e-4, 3e-4]
    assert (
        st.samples[(2, 2, 32)] == [0.01] * (3 * bc.RUN_STEPS)
        and d["settings"]["cpu"]
        and d["settings"]["threads"] >= 1
    )


def test_the_command_keeps_its_work_file_beside_the_output_and_removes_it_once_saved(
    tmp_path, monkeypatch, capsys
):
    import argparse

    import experiments.env_commands as ec
    from tests.env.test_batch_cost import fitted

    out = tmp_path / "bc.json"
    work = tmp_path / "bc.json.partial"
    work.write_text("{}")  # a killed run's
    seen = {}

    def fake(loaded, names, reps, progress, work, drafter_options):
        seen["work"], seen["options"] = work, drafter_options
        c = fitted()
        c.meta["resumed"] = True
        return c

    monkeypatch.setattr("env.batch_calibrate.calibrate_batch", fake)
    args = argparse.Namespace(reps=3, json=False)
    assert ec._calibrate_batch(args, None, ["ngram"], out, {"ngram": {"max_ngram": 3}}) == 0
    assert seen["work"] == work and out.is_file() and not work.exists()
    assert seen["options"] == {"ngram": {"max_ngram": 3}}
    assert f"resumed from {work}" in capsys.readouterr().out


@pytest.mark.parametrize("text", ["{", '{"format": "other"}', "[1]"])
def test_the_command_refuses_a_damaged_work_file_before_the_model_loads(tmp_path, monkeypatch, capsys, text):
    """A damaged ``OUT.partial`` was found only once the model had loaded."""
    from experiments.cli import main

    (tmp_path / "bc.json.partial").write_text(text)
    monkeypatch.setattr("env.model.load_model", lambda *a, **k: pytest.fail("the model loaded first"))
    assert main(["calibrate", "--batch", "--out", str(tmp_path / "bc.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bc.json.partial" in err and "delete it to start over" in err, err
    assert (tmp_path / "bc.json.partial").read_text() == text
