"""``render_mode="ansi"`` (``env.render``): SpecDecode and SpecServe render the last reset or step as one line
that agrees with what ``step`` returned; without a render mode ``render()`` warns and returns None (as
Gymnasium's envs); another render mode is refused in one line, as a ``TypeError`` too."""

from __future__ import annotations

import re
import warnings

import gymnasium as gym
import pytest

import env
from env.serve_env import ServeEnvError, SpecServeEnv
from env.spec_env import EnvError, SpecDecodeEnv
from tests.env.conftest import serve_kw


def _checked(e) -> None:
    from gymnasium.utils.env_checker import check_env
    from stable_baselines3.common.env_checker import check_env as sb3_check_env

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test (render_fps, the render's type)
        check_env(e)
        sb3_check_env(e, warn=True)


def _return(line: str) -> float:
    return float(re.search(r"return (-?[\d.]+)", line).group(1))


def test_spec_decode_renders_each_step_as_step_returned_it():
    e = gym.make(env.ENV_ID, render_mode="ansi", max_new_tokens=24)
    _checked(e.unwrapped)
    e.reset(seed=0, options={"prompt_id": e.unwrapped.prompt_ids[0]})
    pid = e.unwrapped.prompt_ids[0]
    assert e.render() == f"prompt {pid} · 1/24 tokens · reset"  # the prefill's first token
    total, generated, k, done = 0.0, 1, 0, False
    while not done:
        _, reward, terminated, truncated, info = e.step(k % e.action_space.n)
        done, k = terminated or truncated, k + 1
        total, generated = total + reward, generated + info["tokens"]
        line = e.render()
        assert line.startswith(f"prompt {pid} · {generated}/24 tokens · {info['arm']}: drafted {info['drafted']}, "
                               f"accepted {info['accepted']}, +{info['tokens']} · step ")  # fmt: skip
        assert _return(line) == pytest.approx(total, abs=1e-3) and line.endswith(" · done") == done
    assert generated == 24 or terminated


def test_serve_renders_each_step_as_step_returned_it(serve_trace):
    for action in ("batch", "row"):
        e = gym.make(env.SERVE_ID, action=action, render_mode="ansi", **serve_kw(serve_trace)).unwrapped
        _checked(e)
        _, info = e.reset(seed=1, options={"load": "2"})
        assert (
            e.render() == f"load 2 · step 0 · clock {info['clock_s']:.3f} s · queue {info['queue']} · reset"
        )
        total, steps, done = 0.0, 0, False
        while not done:
            _, reward, done, _, info = e.step(e.action_space.sample())
            total, steps = total + reward, steps + 1
            line = e.render()
            arm = info["arm"] if action == "batch" else " ".join(info["arm"])
            assert line.startswith(f"load 2 · step {steps} · clock {info['clock_s']:.3f} s · ")
            assert f" · {arm}: +{info['tokens']} tokens, accepted {info['accepted']} · " in line
            assert _return(line) == pytest.approx(total, abs=1e-3)
        assert line.endswith(f" · done, goodput {info['goodput']:.1f} tokens/s")


def test_render_without_a_mode_warns_and_another_mode_is_refused(serve_trace):
    e = gym.make(env.ENV_ID)
    e.reset(seed=0)
    with pytest.warns(UserWarning, match="render_mode='ansi'"):
        assert e.render() is None
    with pytest.raises(EnvError, match=r"render_mode 'human' is not supported; valid: None, 'ansi'") as err:
        SpecDecodeEnv(render_mode="human")
    assert isinstance(err.value, TypeError)  # (SB3's make_vec_env retries without it)
    with pytest.raises(ServeEnvError, match=r"render_mode 'rgb_array' is not supported") as err:
        SpecServeEnv(render_mode="rgb_array", **serve_kw(serve_trace))
    assert isinstance(err.value, TypeError)
    s = SpecServeEnv(**serve_kw(serve_trace))
    s.reset(seed=0)
    with pytest.warns(UserWarning, match="without a render mode"):
        assert s.render() is None
    assert SpecDecodeEnv(render_mode="ansi").render() == "no episode yet: call reset()"


@pytest.mark.model
def test_live_render_shows_the_text_generated_so_far(fp32_model):
    e = SpecDecodeEnv(backend="live", model=fp32_model, render_mode="ansi", max_new_tokens=8)
    e.reset(seed=0)
    done = False
    while not done:
        _, _, terminated, truncated, _ = e.step(1)
        done = terminated or truncated
    first, tail = e.render().split("\n")
    seq = e._seq.tokens
    assert f" · {len(seq)}/8 tokens · " in first and first.endswith(" · done")
    assert tail == f"  …{fp32_model.tokenizer.decode(seq[-16:])[-60:]!r}" and len(tail) > 6


def test_the_vector_entry_points_refuse_a_render_mode(serve_trace):
    """They do not render (a render mode passed to make_vec reached the inner env, and render() then raised a bare
    NotImplementedError); the refusal names the sync mode, which renders each env."""
    for env_id, error, kw in (
        (env.ENV_ID, EnvError, {}),
        (env.SERVE_ID, ServeEnvError, serve_kw(serve_trace)),
    ):
        with pytest.raises(error, match='the vector entry point does not render.*vectorization_mode="sync"'):
            gym.make_vec(
                env_id, num_envs=2, vectorization_mode="vector_entry_point", render_mode="ansi", **kw
            )
        v = gym.make_vec(env_id, num_envs=2, vectorization_mode="sync", render_mode="ansi", **kw)
        v.reset(seed=0)
        assert all(line.endswith(" · reset") for line in v.render())
