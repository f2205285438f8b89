"""stable-baselines3 policies on the vectorized replay env: smoke training of PPO, DQN and A2C for a few hundred
steps, the saved file loading through ``load_policy`` and acting with ``predict(obs, deterministic=True)``, and a
killed training resuming from its last checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from policies import PolicyError, load_policy
from policies.oracle import score_batch
from policies.rl import SB3Policy
from policies.rl_train import train_sb3
from tests.policies.synthetic import SYNTH_ARMS, synthetic_cost_model

SMALL = {
    "ppo": {"n_steps": 32, "batch_size": 64, "n_epochs": 2},
    "a2c": {"n_steps": 8},
    "dqn": {"learning_starts": 64, "buffer_size": 2_000, "target_update_interval": 100},
}


def make_venv(trace, n_envs=8, seed=0):
    from env.vector_env import make_sb3_vec_env

    venv = make_sb3_vec_env(n_envs, trace=trace, arms=SYNTH_ARMS, cost_model=synthetic_cost_model())
    venv.seed(seed)
    return venv


@pytest.mark.parametrize("algo", ["ppo", "dqn", "a2c"])
def test_smoke_train_save_load_predict(algo, synth_trace, synth_env, tmp_path):
    policy = SB3Policy(synth_env.arm_names, len(synth_env.feature_names), synth_env.feature_names, algo=algo,
                       **SMALL[algo])  # fmt: skip

    def eval_fn(p):
        return score_batch(synth_env, p.act_batch, name=algo, kind="rl").speedup

    train_sb3(policy, make_venv(synth_trace), tmp_path / "run", total_timesteps=512, eval_fn=eval_fn,
              eval_freq=256, checkpoint_freq=256)  # fmt: skip
    run = tmp_path / "run"
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert evals[0]["timesteps"] == 0 and evals[-1]["timesteps"] >= 512
    assert all(r["replay_speedup"] > 0.5 for r in evals)
    assert list((run / "tb").iterdir()), "no TensorBoard log"
    assert list((run / "checkpoints").glob("model_*_steps.zip"))
    path = tmp_path / f"{algo}.zip"
    policy.save(path)
    again = load_policy(path, arms=synth_env.arm_names, obs_size=len(synth_env.feature_names))
    assert again.kind == "rl" and again.algo == algo
    obs, _ = synth_env.reset(seed=1)
    action, _ = again.predict(obs, deterministic=True)
    assert int(action) == policy.act(obs) == again.act(obs)
    batch = np.random.default_rng(0).random((64, len(synth_env.feature_names))).astype(np.float32)
    fast = again.act_batch(batch)  # the numpy copy of the network
    assert again._layers is not None
    assert np.array_equal(fast, again.model.predict(batch, deterministic=True)[0])


def test_evaluations_are_logged_once_and_a_folder_of_other_settings_is_refused(
    synth_trace, synth_env, tmp_path
):
    """The closing evaluation at a step just evaluated is not logged twice; a rerun in the same folder with another
    reward, seed or prompt set would resume (or return) the other run's model: refused in one line, nothing changed."""
    names = (synth_env.arm_names, len(synth_env.feature_names), synth_env.feature_names)
    run = tmp_path / "run"

    def train(total, settings=None, **kw):
        policy = SB3Policy(*names, algo="a2c", **{**SMALL["a2c"], **kw})
        return train_sb3(policy, make_venv(synth_trace, n_envs=2), run, total_timesteps=total,
                         eval_fn=lambda p: 1.0, eval_freq=32, checkpoint_freq=32, settings=settings)  # fmt: skip

    train(64, {"prompts": ["a", "b"]})
    steps = [json.loads(x)["timesteps"] for x in (run / "eval.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 64
    log = (run / "eval.jsonl").read_text()
    for settings, kw, what in [({"prompts": ["a", "b"]}, {"seed": 7}, "params"),
                               ({"prompts": ["a", "c"]}, {}, "prompts")]:  # fmt: skip
        with pytest.raises(PolicyError, match=f"other settings.*{what}") as err:
            train(128, settings, **kw)
        assert "\n" not in str(err.value)
    assert (run / "eval.jsonl").read_text() == log
    train(128, {"prompts": ["a", "b"]})  # the same settings: resumed and extended
    steps = [json.loads(x)["timesteps"] for x in (run / "eval.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 128
    # a smaller budget would return the longer run's best model, labelled with the smaller one: refused
    log = (run / "eval.jsonl").read_text()
    with pytest.raises(PolicyError, match="holds a run toward 128 timesteps already 128 steps in") as err:
        train(64, {"prompts": ["a", "b"]})
    assert "\n" not in str(err.value) and (run / "eval.jsonl").read_text() == log
    train(128, {"prompts": ["a", "b"]})  # the same budget again: nothing left to train, the same folder


def test_untrained_policy_refuses_to_act_or_save(synth_env, tmp_path):
    p = SB3Policy(synth_env.arm_names, len(synth_env.feature_names), algo="ppo")
    with pytest.raises(PolicyError, match="not trained"):
        p.act(np.zeros(len(synth_env.feature_names)))
    with pytest.raises(PolicyError, match="untrained"):
        p.save(tmp_path / "x.zip")


def test_bad_hyperparameters():
    with pytest.raises(PolicyError, match="does not take"):
        SB3Policy(SYNTH_ARMS, 19, algo="a2c", buffer_size=10)
    with pytest.raises(PolicyError, match="unknown RL algorithm"):
        SB3Policy(SYNTH_ARMS, 19, algo="sac")


RESUME_SCRIPT = """
import sys
from policies.oracle import score_batch
from policies.rl import SB3Policy
from policies.rl_train import train_sb3
from tests.policies.synthetic import synthetic_env, synthetic_trace
from tests.policies.test_rl import make_venv
trace = synthetic_trace()
env = synthetic_env(trace=trace)
p = SB3Policy(env.arm_names, len(env.feature_names), env.feature_names, algo="ppo", n_steps=32, batch_size=64)
train_sb3(p, make_venv(trace), sys.argv[1], total_timesteps=int(sys.argv[2]), eval_fn=lambda q: 1.0,
          eval_freq=256, checkpoint_freq=256)
"""


@pytest.mark.slow
def test_killed_training_resumes_from_its_checkpoint(tmp_path):
    """SIGKILL the trainer after its first checkpoints; a rerun continues from the latest readable one."""
    run = tmp_path / "run"
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    cmd = [sys.executable, "-c", RESUME_SCRIPT, str(run), "200000"]
    proc = subprocess.Popen(cmd, cwd=root, env=env, start_new_session=True)
    try:
        deadline = time.time() + 600
        while len(list((run / "checkpoints").glob("model_*_steps.zip"))) < 2:
            assert proc.poll() is None and time.time() < deadline, "the trainer ended before two checkpoints"
            time.sleep(0.5)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    ckpts = sorted(int(p.name.split("_")[1]) for p in (run / "checkpoints").glob("model_*_steps.zip"))
    latest = ckpts[-1]
    (run / "checkpoints" / f"model_{latest}_steps.zip").write_bytes(b"torn")  # as if killed mid-write
    with (run / "eval.jsonl").open("a") as fh:
        fh.write('{"timesteps": 99')  # and a torn evaluation line
    before = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()[:-1]]
    kept = [r for r in before if r["timesteps"] <= ckpts[-2]]
    target = latest + 1024
    subprocess.run([*cmd[:-1], str(target)], cwd=root, env=env, check=True, timeout=600)
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    steps = [r["timesteps"] for r in evals]
    assert steps == sorted(set(steps))  # no evaluation twice: those after the checkpoint resumed were dropped
    assert evals[: len(kept)] == kept
    resumed = steps[len(kept) :]
    assert resumed[0] > ckpts[-2]  # continued from the last readable checkpoint, not from zero
    assert resumed[-1] >= target
    assert evals[-1]["wall_s"] > kept[-1]["wall_s"]  # training time adds up across the restart


def test_training_without_tensorboard_leaves_no_temp_folder(synth_trace, synth_env, tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where stable-baselines3 would put SB3-<date>
    policy = SB3Policy(synth_env.arm_names, len(synth_env.feature_names), synth_env.feature_names, algo="a2c",
                       **SMALL["a2c"])  # fmt: skip
    policy.build(make_venv(synth_trace, n_envs=2)).learn(64)
    assert not list(tmp_path.glob("SB3-*"))
