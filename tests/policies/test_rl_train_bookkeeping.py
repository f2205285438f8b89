"""The bookkeeping of ``policies.rl_train``, checked without training: which evaluation makes a new best (a tie
does not), when the evaluations fall due, the plateau's tolerance, checkpoints ordered by step (not by name), the
bests a checkpoint leaves reachable, the budget a folder remembers and the speedup a new best must beat."""

from __future__ import annotations

import json
import zipfile
from types import SimpleNamespace

import pytest

from policies import PolicyError, rl_train
from policies.rl_train import _best_speedup, _check_budget, _prune_bests, checkpoint_files, plateau


class _Logger:
    def record(self, key, value):
        pass


def _run_callback(tmp_path, monkeypatch, speedups, steps, eval_freq):
    """The training callback driven by a stand-in model whose step counter takes ``steps``: the (step, speedup)
    of every new best it saves, and the steps ``eval.jsonl`` logs."""
    saved = []
    monkeypatch.setattr(
        rl_train, "_save_best", lambda policy, out, step, speedup: saved.append((step, speedup))
    )
    scores = iter(speedups)
    cb = rl_train._callbacks(object(), tmp_path, lambda p: next(scores), eval_freq, 10**9, n_envs=1)
    model = SimpleNamespace(num_timesteps=0, logger=_Logger())
    cb.init_callback(model)
    cb.on_training_start({}, {})
    for step in steps:
        model.num_timesteps = step
        cb.on_step()
    logged = [json.loads(x)["timesteps"] for x in (tmp_path / "eval.jsonl").read_text().splitlines()]
    return saved, logged


def test_only_an_evaluation_that_beats_the_best_makes_a_new_best(tmp_path, monkeypatch):
    saved, logged = _run_callback(tmp_path, monkeypatch, [1.0, 2.0, 2.0, 1.5, 2.5], [32, 64, 96, 128], 32)
    assert logged == [0, 32, 64, 96, 128]
    assert saved == [(0, 1.0), (32, 2.0), (128, 2.5)]  # the tie at step 64 keeps the earlier best


def test_an_evaluation_falls_due_at_its_step_exactly(tmp_path, monkeypatch):
    _, logged = _run_callback(tmp_path, monkeypatch, [1.0] * 10, [16, 32, 48, 64, 80], 32)
    assert logged == [0, 32, 64]


def _log(out, speedups):
    rows = [{"timesteps": 10 * i, "wall_s": float(i), "cpu_s": 2.0 * i, "replay_speedup": s}
            for i, s in enumerate(speedups)]  # fmt: skip
    (out / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_the_plateau_is_the_first_evaluation_within_tol_of_the_best(tmp_path):
    _log(tmp_path, [1.0, 1.5, 1.985, 2.0, 1.99])
    assert plateau(tmp_path) == {
        "best": 2.0,
        "timesteps": 20,
        "wall_s": 2.0,
        "cpu_s": 4.0,
        "replay_speedup": 1.985,
    }
    assert plateau(tmp_path, tol=0.0)["timesteps"] == 30
    assert plateau(tmp_path, tol=0.3)["timesteps"] == 10
    assert plateau(tmp_path / "none") is None


def test_checkpoints_are_ordered_by_step_not_by_name(tmp_path):
    for name in ("model_9000_steps.zip", "model_10000_steps.zip", "model_500_steps.zip", "model_x_steps.zip",
                 "model_70_steps.zip.tmp"):  # fmt: skip
        (tmp_path / name).write_bytes(b"")
    assert [s for s, _ in checkpoint_files(tmp_path)] == [500, 9000, 10000]
    assert checkpoint_files(tmp_path)[-1][1].name == "model_10000_steps.zip"


def test_pruning_keeps_the_latest_best_at_or_before_the_oldest_checkpoint(tmp_path):
    history = tmp_path / "best_history"
    history.mkdir()
    for step in (10, 50, 100, 101, 200):
        (history / f"best_{step}.zip").write_bytes(b"")
    _prune_bests(tmp_path, 100)  # a resume at step 100 needs best_100; one past it may yet be needed
    assert sorted(p.name for p in history.iterdir()) == ["best_100.zip", "best_101.zip", "best_200.zip"]
    _prune_bests(tmp_path, 150)
    assert sorted(p.name for p in history.iterdir()) == ["best_101.zip", "best_200.zip"]


def test_a_folder_remembers_its_largest_budget(tmp_path):
    _check_budget(tmp_path, 128, 0)
    assert json.loads((tmp_path / "budget.json").read_text()) == {"total_timesteps": 128}
    _check_budget(tmp_path, 128, 128)  # the same budget again: nothing left, not refused
    _check_budget(tmp_path, 64, 64)  # a shorter rerun of a run killed at its own budget: not refused
    with pytest.raises(PolicyError, match="already 96 steps in, past 95"):
        _check_budget(tmp_path, 95, 96)
    _check_budget(tmp_path, 256, 128)
    assert json.loads((tmp_path / "budget.json").read_text()) == {"total_timesteps": 256}


def test_without_best_json_the_best_to_beat_is_the_top_logged_speedup(tmp_path):
    rows = _log(tmp_path, [1.25, 1.75, 1.5])
    assert _best_speedup(tmp_path, rows) == -float("inf")  # no best.zip: the next evaluation makes one
    (tmp_path / "best.zip").write_bytes(b"x")
    assert _best_speedup(tmp_path, rows) == 1.75


def test_a_resumed_run_keeps_its_evaluation_and_checkpoint_schedule(tmp_path, monkeypatch):
    """Resumed at step 128 (eval_freq 32, checkpoint_freq 64): evaluations at 160 and 192, a checkpoint at 192,
    not one at the first step past the resume."""
    _log(tmp_path, [1.0, 1.1, 1.2])  # a killed run's evaluations (steps 0, 10, 20)
    written = []

    def save(model, network, path):
        written.append(path.name)
        path.write_bytes(b"")

    monkeypatch.setattr(rl_train, "save_checkpoint", save)
    monkeypatch.setattr(rl_train, "_save_best", lambda *a: None)
    policy = SimpleNamespace(network=lambda: {})
    scores = iter([1.0] * 10)
    cb = rl_train._callbacks(policy, tmp_path, lambda p: next(scores), 32, 64, n_envs=1)
    model = SimpleNamespace(num_timesteps=128, logger=_Logger())
    cb.init_callback(model)
    cb.on_training_start({}, {})
    for step in range(130, 200, 2):
        model.num_timesteps = step
        cb.on_step()
    logged = [json.loads(x)["timesteps"] for x in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert logged == [0, 10, 20, 160, 192]
    assert written == ["model_192_steps.zip"]


def test_a_best_zip_without_history_was_made_by_the_first_evaluation_of_the_top_speedup(tmp_path):
    """A run from before the history was kept, resumed at step 32: its ``best.zip`` came from step 32 (the first
    evaluation of speedup 2.0), which the resume keeps: adopted, not removed."""
    rows = _log(tmp_path, [1.0, 2.0, 2.0, 1.5])  # steps 0, 10, 20, 30
    with zipfile.ZipFile(tmp_path / "best.zip", "w") as zf:
        zf.writestr("header.json", "{}")
    rl_train._resume_best(tmp_path, 15, rows, rows[:2])
    assert (tmp_path / "best.zip").is_file() and (tmp_path / "best_history" / "best_10.zip").is_file()
    assert json.loads((tmp_path / "best.json").read_text()) == {"timesteps": 10, "replay_speedup": 2.0}
