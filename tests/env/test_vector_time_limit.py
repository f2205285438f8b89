"""``max_episode_steps`` in the vector envs: ``gymnasium.make_vec(..., vectorization_mode="vector_entry_point",
max_episode_steps=N)`` passes it to the vector entry point (it was a TypeError), and each row's episode is then
truncated after N steps as ``TimeLimit`` truncates each env of a ``sync`` vector env: the count restarts with every
episode, however the last one ended, and (next-step autoreset) the reset step is not counted."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

import env
from env.serve_env import ServeEnvError
from env.spec_env import EnvError
from tests.env.conftest import serve_kw


def _follows_the_limit(v, actions: np.ndarray, limit: int, steps: int, exact: np.ndarray) -> tuple[int, int]:
    """Step ``v`` and check each row's truncation against a counter of its own (next-step autoreset: a step after
    an episode ended is its reset step, reward 0 and no tokens, and uncounted): truncated where the count reaches
    ``limit``, and in the rows of ``exact`` (which the env itself never truncates) there only; how many episodes
    ended by the limit and how many otherwise."""
    v.reset(seed=0)
    n = len(actions)
    count, pending = np.zeros(n, np.int64), np.zeros(n, bool)
    by_limit = other = 0
    for _ in range(steps):
        _, reward, terminated, truncated, info = v.step(actions)
        count = np.where(pending, 0, count + 1)
        limited = ~pending & (count >= limit)
        assert (truncated[limited]).all() and (truncated[exact] == limited[exact]).all()
        assert not (reward[pending]).any() and not (info["tokens"][pending]).any()
        by_limit += int(limited.sum())
        other += int(((terminated | truncated) & ~limited).sum())
        pending = terminated | truncated
    return by_limit, other


def test_spec_decode_vector_env_truncates_each_episode_after_max_episode_steps():
    # row 0 one token a step (8 tokens take 7 steps: the limit of 4 ends it), row 1 long n-gram chains (some
    # episodes reach max_new_tokens first, the env's own truncation: the count starts again)
    v = gym.make_vec(env.ENV_ID, num_envs=2, vectorization_mode="vector_entry_point", max_episode_steps=4,
                     max_new_tokens=8)  # fmt: skip
    names = v.unwrapped.arm_names
    by_limit, other = _follows_the_limit(
        v, np.array([0, names.index("ngram-d8")]), 4, 60, np.array([True, False])
    )
    assert by_limit > 0 and other > 0


def test_spec_decode_vector_env_steps_as_sync_under_a_time_limit():
    """The sync vector env (``TimeLimit`` around each env) and the vector entry point on the same prompt: the same
    rewards, truncated at the same step, then the reset step."""
    got = {}
    for mode in ("vector_entry_point", "sync"):
        w = gym.make_vec(env.ENV_ID, num_envs=2, vectorization_mode=mode, max_episode_steps=3)
        w.reset(seed=0, options={"prompt_id": gym.make(env.ENV_ID).unwrapped.prompt_ids[0]})
        got[mode] = [[x.tolist() for x in w.step(np.array([2, 0]))[1:4]] for _ in range(4)]
    assert got["vector_entry_point"] == got["sync"]
    assert [s[2] for s in got["sync"]] == [[False, False], [False, False], [True, True], [False, False]]
    assert got["sync"][3][0] == [0.0, 0.0]


def test_serve_vector_env_truncates_each_episode_after_max_episode_steps(serve_trace):
    v = gym.make_vec(env.SERVE_ID, num_envs=4, vectorization_mode="vector_entry_point", max_episode_steps=40,
                     **serve_kw(serve_trace))  # fmt: skip
    # (these servers' episodes run 15 to 122 steps)
    by_limit, other = _follows_the_limit(v, np.array([0, 1, 3, 5]), 40, 300, np.ones(4, bool))
    assert by_limit > 0 and other > 0
    # same-step autoreset: the final observation of each truncated episode, the count restarting at once
    s = gym.make_vec(env.SERVE_ID, num_envs=2, vectorization_mode="vector_entry_point", max_episode_steps=3,
                     autoreset_mode="same_step", **serve_kw(serve_trace))  # fmt: skip
    s.reset(seed=0)
    flags = [s.step(np.array([1, 2])) for _ in range(6)]
    assert [f[3].tolist() for f in flags] == [[False, False], [False, False], [True, True]] * 2
    assert all(("final_obs" in f[4]) == f[3].any() for f in flags)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "3"])
def test_a_bad_max_episode_steps_is_refused(bad, serve_trace):
    with pytest.raises(EnvError, match="max_episode_steps must be"):
        gym.make_vec(env.ENV_ID, num_envs=2, vectorization_mode="vector_entry_point", max_episode_steps=bad)
    with pytest.raises(ServeEnvError, match="max_episode_steps must be"):
        gym.make_vec(env.SERVE_ID, num_envs=2, vectorization_mode="vector_entry_point", max_episode_steps=bad,
                     **serve_kw(serve_trace))  # fmt: skip


def test_the_sb3_serving_vec_env_ends_truncated_episodes(serve_trace):
    """stable-baselines3 sees a truncated episode end (``dones``, its terminal observation, ``TimeLimit.truncated``):
    it bootstraps from there, not across the reset."""
    from env.serve_env import make_sb3_serve_env

    venv = make_sb3_serve_env(2, max_episode_steps=3, **serve_kw(serve_trace))
    venv.reset()
    for step in range(1, 7):
        venv.step_async(np.array([1, 2]))
        _, _, dones, infos = venv.step_wait()
        assert dones.tolist() == [step % 3 == 0] * 2
        for info in infos:
            assert ("terminal_observation" in info) == (step % 3 == 0)
            assert info.get("TimeLimit.truncated", False) == (step % 3 == 0) and "goodput" not in info
