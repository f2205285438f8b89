"""A resumed RL training drops the evaluations after the checkpoint it resumes from, and with them the bests they
made: ``best.zip`` (and ``best.json``, its step) is then the best of the evaluations kept, not a policy from a step
the run went back past."""

from __future__ import annotations

import json

import pytest
import torch

from policies import load_policy
from policies.rl import SB3Policy
from policies.rl_train import train_sb3
from tests.policies.test_rl import SMALL, make_venv


@pytest.mark.parametrize("before", ["history", "a run without best.json"])
def test_a_resume_drops_the_bests_made_after_its_checkpoint(before, synth_trace, synth_env, tmp_path):
    names = (synth_env.arm_names, len(synth_env.feature_names), synth_env.feature_names)
    run = tmp_path / "run"
    states = []

    def improving(p):  # every evaluation is a new best; its network is kept to compare with
        states.append({k: v.clone() for k, v in p.model.policy.state_dict().items()})
        return float(len(states))

    def train(eval_fn):
        policy = SB3Policy(*names, algo="a2c", **SMALL["a2c"])
        return train_sb3(policy, make_venv(synth_trace, n_envs=2), run, total_timesteps=128, eval_fn=eval_fn,
                         eval_freq=32, checkpoint_freq=64)  # fmt: skip

    train(improving)
    steps = [json.loads(x)["timesteps"] for x in (run / "eval.jsonl").read_text().splitlines()]
    assert steps == [0, 32, 64, 96, 128]
    assert json.loads((run / "best.json").read_text()) == {"timesteps": 128, "replay_speedup": 5.0}
    (run / "checkpoints" / "model_128_steps.zip").unlink()  # killed before its last checkpoint: resumes at 64
    if before != "history":
        (run / "best.json").unlink()
        for p in (run / "best_history").iterdir():
            p.unlink()
    resumed = train(lambda p: 0.5)  # no evaluation after the resume beats the kept ones
    rows = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    assert [r["timesteps"] for r in rows] == [0, 32, 64, 96, 128]
    best = json.loads((run / "best.json").read_text())
    if before == "history":  # the best of the kept evaluations, step 64, is the best again
        assert best == {"timesteps": 64, "replay_speedup": 3.0}
        want = states[2]
    else:  # the old best.zip came from step 128 (the top speedup's first evaluation): dropped, a new one made
        assert best == {"timesteps": 96, "replay_speedup": 0.5}
        want = None
    saved = load_policy(run / "best.zip", arms=synth_env.arm_names, obs_size=len(synth_env.feature_names))
    got = saved.model.policy.state_dict()
    assert not all(torch.equal(got[k], states[-1][k]) for k in got)  # not the dropped step-128 best
    if want is not None:
        assert all(torch.equal(got[k], want[k]) for k in got)
        assert all(torch.equal(resumed.model.policy.state_dict()[k], want[k]) for k in got)


def _trainer(trace, env, run):
    """``train(total)``: an a2c policy trained into ``run`` up to ``total`` steps (each evaluation scores 1.0)."""
    names = (env.arm_names, len(env.feature_names), env.feature_names)

    def train(total):
        policy = SB3Policy(*names, algo="a2c", **SMALL["a2c"])
        return train_sb3(policy, make_venv(trace, n_envs=2), run, total_timesteps=total, eval_fn=lambda p: 1.0,
                         eval_freq=32, checkpoint_freq=64)  # fmt: skip

    return train


def test_a_damaged_best_in_the_history_is_refused_before_it_replaces_best_zip(
    synth_trace, synth_env, tmp_path
):
    """``best_history/best_64.zip`` overwritten with junk replaced a good ``best.zip`` on the resume, and the error
    (naming ``best.zip``) came only after the training had run on."""
    from policies.base import PolicyError

    run = tmp_path / "run"
    train = _trainer(synth_trace, synth_env, run)
    train(64)
    good = (run / "best.zip").read_bytes()
    history = sorted((run / "best_history").iterdir())
    history[-1].write_bytes(b"junk")
    with pytest.raises(PolicyError, match=f"{history[-1]} is not a saved model"):
        train(128)
    assert (run / "best.zip").read_bytes() == good
    assert not (run / "checkpoints" / "model_128_steps.zip").exists()  # refused before training on


@pytest.mark.timeout(60)  # a regression blocks on the FIFO
@pytest.mark.parametrize("name", ["eval.jsonl", "best.json"])
def test_a_fifo_among_the_runs_files_is_refused(name, synth_trace, synth_env, tmp_path):
    """``eval.jsonl`` read as absent when it is no file, then opened to append: a FIFO there blocked for ever."""
    import os

    from policies.base import PolicyError

    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / name)
    policy = SB3Policy(synth_env.arm_names, len(synth_env.feature_names), synth_env.feature_names, algo="a2c",
                       **SMALL["a2c"])  # fmt: skip
    with pytest.raises(PolicyError, match=f"{run / name} is not a regular file"):
        train_sb3(policy, make_venv(synth_trace, n_envs=2), run, total_timesteps=64, eval_fn=lambda p: 1.0,
                  eval_freq=32, checkpoint_freq=64)  # fmt: skip


def test_a_damaged_best_zip_of_a_run_without_history_is_named(synth_trace, synth_env, tmp_path):
    """An older run's damaged ``best.zip`` was adopted into the history and refused there, under the history's name:
    deleting that file did not help, as the next resume adopted it again."""
    from policies.base import PolicyError

    run = tmp_path / "run"
    train = _trainer(synth_trace, synth_env, run)
    train(64)
    for p in (run / "best_history").iterdir():  # a run from before the history was kept
        p.unlink()
    (run / "best.zip").write_bytes(b"junk")
    with pytest.raises(PolicyError, match=f"{run / 'best.zip'} is not a saved model"):
        train(128)
    assert not any((run / "best_history").iterdir())


def test_a_checkpoint_whose_step_counter_differs_from_its_name_is_refused(synth_trace, synth_env, tmp_path):
    """A counter of 10^15 steps in the latest checkpoint skipped the rest of the training, and the policy was saved
    as trained to its budget."""
    from policies.archive import read_archive, write_archive
    from policies.base import PolicyError
    from policies.sb3_checkpoints import CHECKPOINT_FORMAT, CHECKPOINT_VERSION

    run = tmp_path / "run"
    train = _trainer(synth_trace, synth_env, run)
    train(128)
    path = run / "checkpoints" / "model_128_steps.zip"
    meta, files = read_archive(path, "state.json", CHECKPOINT_FORMAT, CHECKPOINT_VERSION, "checkpoint")
    meta["counters"]["num_timesteps"] = 10**15
    write_archive(path, "state.json", {k: v for k, v in meta.items() if k != "payload"}, files)
    with pytest.raises(PolicyError, match="counts 1000000000000000 steps, not the 128 of its name"):
        train(256)
