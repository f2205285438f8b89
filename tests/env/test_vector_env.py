"""The batched replay env: make_vec returns it, shapes and autoreset follow Gymnasium, each row replays exactly
what the single env does, torch equals numpy, and stable-baselines3 can train on it."""

from __future__ import annotations

import warnings

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.vector import AutoresetMode

import env as env_pkg
from env.spec_env import EnvError, SpecDecodeEnv
from env.vector_env import SpecDecodeVectorEnv, make_sb3_vec_env


def test_make_vec_returns_the_batched_replay_env():
    v = gym.make_vec(env_pkg.ENV_ID, num_envs=4096, vectorization_mode="vector_entry_point")
    assert isinstance(v.unwrapped, SpecDecodeVectorEnv)
    obs, info = v.reset(seed=0)
    assert obs.shape == (4096, v.single_observation_space.shape[0]) and obs.dtype == np.float32
    obs, rew, term, trunc, info = v.step(v.action_space.sample())
    assert rew.shape == term.shape == trunc.shape == (4096,) and rew.dtype == np.float32
    assert {"tokens", "accepted", "cost_s", "ar_cost_s", "arm"} <= set(info)
    assert v.observation_space.contains(obs)
    assert v.metadata["autoreset_mode"] == AutoresetMode.NEXT_STEP


def _single_rollout(trace, cost, prompt_id, actions):
    e = SpecDecodeEnv(trace=trace, cost_model=cost)
    obs, _ = e.reset(seed=0, options={"prompt_id": prompt_id})
    rows = [(obs, 0.0, False, False)]
    for a in actions:
        obs, r, te, tu, _ = e.step(int(a))
        rows.append((obs, r, te, tu))
        if te or tu:
            break
    return rows


@pytest.mark.parametrize("device", [None, "cpu"])
def test_rows_replay_like_the_single_env_then_autoreset_next_step(toy_trace, toy_cost, device):
    b = 6
    v = SpecDecodeVectorEnv(b, trace=toy_trace, cost_model=toy_cost, device=device)
    obs, _ = v.reset(seed=0, options={"prompt_id": "p1"})
    actions = np.random.default_rng(0).integers(len(v.arms), size=(60, b))
    expect = [_single_rollout(toy_trace, toy_cost, "p1", actions[:, i]) for i in range(b)]
    to_np = (lambda x: x.cpu().numpy()) if device else np.asarray
    assert np.allclose(to_np(obs), np.stack([e[0][0] for e in expect]))
    ended = np.zeros(b, dtype=bool)
    for t in range(60):
        obs, rew, term, trunc, info = v.step(actions[t])
        obs, rew, term, trunc = map(to_np, (obs, rew, term, trunc))
        for i in range(b):
            if ended[i]:
                continue
            e_obs, e_rew, e_term, e_trunc = expect[i][t + 1]
            assert np.allclose(obs[i], e_obs, atol=1e-6) and rew[i] == pytest.approx(e_rew, rel=1e-5)
            assert (term[i], trunc[i]) == (e_term, e_trunc)
            if e_term or e_trunc:
                ended[i] = True
                pending = i
        if ended.any() and not ended.all():
            break
    # next step: the ended rows reset (reward 0, not done, position back at the start)
    obs, rew, term, trunc, _ = v.step(np.zeros(b, dtype=np.int64))
    obs, rew, term, trunc = map(to_np, (obs, rew, term, trunc))
    assert rew[pending] == 0.0 and not term[pending] and not trunc[pending]
    assert obs[pending, 0] == pytest.approx(1 / v.single.max_new_tokens)


def test_same_step_autoreset_reports_final_obs(toy_trace, toy_cost):
    v = SpecDecodeVectorEnv(8, trace=toy_trace, cost_model=toy_cost, autoreset_mode="same_step")
    v.reset(seed=1)
    for _ in range(200):
        obs, rew, term, trunc, info = v.step(np.full(8, 3))
        done = term | trunc
        if done.any():
            assert np.array_equal(info["_final_obs"], done)
            i = int(np.flatnonzero(done)[0])
            assert info["final_obs"][i].shape == obs[i].shape and obs[i, 0] == pytest.approx(1 / 40)
            return
    raise AssertionError("no episode ended")


def test_torch_equals_numpy(toy_trace, toy_cost):
    vn = SpecDecodeVectorEnv(64, trace=toy_trace, cost_model=toy_cost)
    vt = SpecDecodeVectorEnv(64, trace=toy_trace, cost_model=toy_cost, device="cpu")
    on, _ = vn.reset(seed=5)
    ot, _ = vt.reset(seed=5)
    acts = np.random.default_rng(1).integers(len(vn.arms), size=(50, 64))
    for a in acts:
        assert np.allclose(on, ot.numpy(), atol=1e-6)
        on, rn, *_ = vn.step(a)
        ot, rt, *_ = vt.step(torch.as_tensor(a))
        assert np.allclose(rn, rt.numpy(), rtol=1e-5)


def test_bad_input(toy_trace, toy_cost):
    v = SpecDecodeVectorEnv(4, trace=toy_trace, cost_model=toy_cost)
    v.reset(seed=0)
    with pytest.raises(EnvError, match="not a valid arm index"):
        v.step(np.array([0, 1, 2, 99]))
    with pytest.raises(EnvError, match="shape"):
        v.step(np.zeros(3, dtype=np.int64))
    for bad in (
        np.full(4, 1.5),
        np.full(4, np.nan),
        np.array(["1"] * 4),
        np.ones(4, bool),
        torch.full((4,), 1.0),
    ):
        with pytest.raises(
            EnvError, match="integer arm indices"
        ):  # as the single env: no truncation of floats
            v.step(bad)
    with pytest.raises(EnvError, match="replays traces only"):
        SpecDecodeVectorEnv(4, backend="live")
    with pytest.raises(EnvError, match="autoreset_mode"):
        SpecDecodeVectorEnv(4, trace=toy_trace, cost_model=toy_cost, autoreset_mode="sometimes")


def test_a_full_reset_drops_the_autoresets_pending_from_the_episodes_before(toy_trace, toy_cost):
    """A row whose episode ended waits for its autoreset at the next step; a reset() of every row starts new
    episodes, so the next step is a real step of each (not an autoreset with reward 0)."""
    v = SpecDecodeVectorEnv(2, trace=toy_trace, cost_model=toy_cost)
    v.reset(seed=0)
    for _ in range(200):
        _, _, term, trunc, _ = v.step(np.array([3, 3]))
        if (term | trunc).any():
            break
    assert (term | trunc).any()
    v.reset(seed=1)
    _, reward, _, _, info = v.step(np.array([3, 3]))
    assert (info["tokens"] >= 1).all() and (reward > 0).all()


def test_partial_reset_with_a_mask(toy_trace, toy_cost):
    v = SpecDecodeVectorEnv(4, trace=toy_trace, cost_model=toy_cost)
    v.reset(seed=0)
    v.step(np.full(4, 3))
    obs, _ = v.reset(options={"reset_mask": np.array([True, False, False, False])})
    hist = next(i for i, n in enumerate(v.feature_names) if n.startswith("accept/"))  # history features
    assert obs[0, 0] == pytest.approx(1 / 40) and np.allclose(obs[0, hist:], 0.0)
    assert not np.allclose(obs[1:, hist:], 0.0)


def test_the_first_reset_starts_every_env(toy_trace, toy_cost):
    """Before any episode, a partial mask would leave envs on prompt 0 at position 0, never drawn or started."""
    v = SpecDecodeVectorEnv(4, trace=toy_trace, cost_model=toy_cost)
    with pytest.raises(EnvError, match="first reset"):
        v.reset(seed=0, options={"reset_mask": np.array([True, False, False, False])})
    with pytest.raises(EnvError, match="call reset"):
        v.step(np.zeros(4, dtype=np.int64))
    obs, _ = v.reset(seed=0, options={"reset_mask": np.ones(4, dtype=bool)})
    assert obs.shape[0] == 4


def test_stable_baselines3_trains_on_it(toy_trace, toy_cost, tmp_path, monkeypatch):
    import tempfile

    from stable_baselines3 import PPO
    from stable_baselines3.common.logger import Logger
    from stable_baselines3.common.vec_env import VecMonitor

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where stable-baselines3 would put SB3-<date>
    venv = VecMonitor(make_sb3_vec_env(16, trace=toy_trace, cost_model=toy_cost))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = PPO("MlpPolicy", venv, n_steps=8, batch_size=64, n_epochs=1, seed=0, device="cpu")
        model.set_logger(Logger(folder=None, output_formats=[]))  # no SB3-<date> folder in the temp dir
        model.learn(128)
    obs = venv.reset()
    actions, _ = model.predict(obs, deterministic=True)
    assert actions.shape == (16,)
    assert not list(tmp_path.glob("SB3-*"))


def test_seeds_of_every_integer_kind(toy_trace, toy_cost):
    """A numpy integer seeds as a Python one (it crashed); a sequence seeds by its first; junk is refused."""
    first = SpecDecodeVectorEnv(3, trace=toy_trace, cost_model=toy_cost).reset(seed=3)[0]
    for seed in (np.int64(3), [3, 4, 5], np.array([3, 4, 5])):
        obs = SpecDecodeVectorEnv(3, trace=toy_trace, cost_model=toy_cost).reset(seed=seed)[0]
        assert np.array_equal(obs, first)
    v = SpecDecodeVectorEnv(3, trace=toy_trace, cost_model=toy_cost)
    v.reset(seed=[None, None, None])  # unseeded, as gymnasium's own vector envs take it
    for bad in (1.5, "3", [], -1, True):
        with pytest.raises(EnvError, match="seed must be"):
            v.reset(seed=bad)
    for wrong in ([3, 4], [3, 4, 5, 6], np.array([3, 4, 5, 6])):  # took the first and dropped the rest
        with pytest.raises(EnvError, match=f"{len(wrong)} seeds for 3 envs"):
            v.reset(seed=wrong)
    with pytest.raises(EnvError, match="got -1"):  # a seed after the first is checked as it is
        v.reset(seed=[3, 4, -1])


def test_stable_baselines3s_make_vec_env_builds_the_env():
    """``make_vec_env("draftgym/SpecDecode-v0")`` failed: it asks for ``render_mode="rgb_array"`` and retries
    without it only on a ``TypeError``, and the env refused it with a ``ValueError``."""
    import warnings

    from stable_baselines3.common.env_util import make_vec_env

    import env  # noqa: F401 (registers the ids)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (gymnasium warns of the render mode asked for)
        venv = make_vec_env("draftgym/SpecDecode-v0", n_envs=2, seed=0)
    obs = venv.reset()
    assert obs.shape[0] == 2 and np.isfinite(obs).all()
    venv.step(np.array([0, 1]))
    venv.close()


@pytest.mark.parametrize("device", [None, "cpu"])
def test_a_step_before_any_reset_is_refused_as_the_single_env_does(toy_trace, toy_cost, device):
    """It stepped every env on prompt 0 without an episode; the single env refuses in one line."""
    v = SpecDecodeVectorEnv(2, trace=toy_trace, cost_model=toy_cost, device=device)
    with pytest.raises(EnvError, match=r"call reset\(\) before step\(\)"):
        v.step(np.array([1, 1]))
    v.reset(seed=0)
    assert v.step(np.array([1, 1]))[1].shape == (2,)


@pytest.mark.parametrize("bad", [2.7, 2.0, "2", True])
def test_num_envs_that_is_no_integer_is_refused_not_rounded(toy_trace, toy_cost, bad):
    with pytest.raises(EnvError, match="num_envs must be an integer"):
        SpecDecodeVectorEnv(bad, trace=toy_trace, cost_model=toy_cost)
    assert SpecDecodeVectorEnv(np.int64(3), trace=toy_trace, cost_model=toy_cost).num_envs == 3


def test_reset_arguments_are_checked(toy_trace, toy_cost):
    v = SpecDecodeVectorEnv(4, trace=toy_trace, cost_model=toy_cost)
    for seed in (-1, 1.5, True, "a"):
        with pytest.raises(EnvError, match="seed"):
            v.reset(seed=seed)
    with pytest.raises(EnvError, match="reset options must be a dict"):
        v.reset(options=["prompt_id"])
    with pytest.raises(EnvError, match="reset_mask must be an array of 4 booleans"):
        v.reset(options={"reset_mask": np.ones(3, dtype=bool)})
    with pytest.raises(EnvError, match="reset_mask must be an array of 4 booleans"):
        v.reset(options={"reset_mask": np.full(4, 0.5)})
    single = SpecDecodeEnv(trace=toy_trace, cost_model=toy_cost)
    with pytest.raises(EnvError, match="seed must be a non-negative integer"):
        single.reset(seed=-3)
    with pytest.raises(EnvError, match="unknown reset options"):
        single.reset(options={"reset_mask": [True]})
