"""``draftgym/SpecServe-v0``: what each step reports (``info``: the arm, the accepted tokens, the episode's load,
its goodput exactly once), how a vector reset seeds its servers (one seed each, a masked reset leaving the others'
streams alone), and the open-loop arrival processes' rates."""

from __future__ import annotations

import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

from env.serve_env import (
    DEFAULT_ARMS,
    ServeEnvError,
    ServeSim,
    SpecServeEnv,
    SpecServeVectorEnv,
    parse_load,
    request_stream,
)
from tests.env.conftest import SERVE_ROWS as M
from tests.env.conftest import serve_kw as kw


@pytest.fixture(scope="module")
def trace(serve_trace):
    return serve_trace


def test_info_names_the_load_given_in_reset_options(trace):
    e = SpecServeEnv(**kw(trace))
    for seed in range(8):  # the random draw of a load must not leak into the label of a fixed one
        assert e.reset(seed=seed, options={"load": "2"})[1]["load"] == "2"
        assert e.reset(seed=seed, options={"load": "poisson@3"})[1]["load"] == "poisson@3"
    labels = {e.reset(seed=s)[1]["load"] for s in range(40)}
    assert labels <= {"1", "3", "ramp", "bursty", "poisson@2"} and len(labels) > 1


@pytest.mark.parametrize("action", ["batch", "row"])
def test_info_has_the_arm_and_the_accepted_tokens(trace, action):
    e = SpecServeEnv(action=action, **kw(trace, loads=["3"]))
    e.reset(seed=1)
    k = DEFAULT_ARMS.index("ngram-d5") if "ngram-d5" in DEFAULT_ARMS else len(DEFAULT_ARMS) - 1
    seen_accept = 0
    for _ in range(30):
        act = k if action == "batch" else np.full(M, k)
        _, _, term, _, info = e.step(act)
        # each row commits its accepted tokens + 1, a row reaching its end fewer
        assert info["accepted"] >= 0 and info["rows"] <= info["tokens"] <= info["rows"] + info["accepted"]
        if action == "batch":
            assert info["arm"] == DEFAULT_ARMS[k]
        else:
            assert info["arm"] == [DEFAULT_ARMS[k]] * info["rows"]
        seen_accept += info["accepted"]
        if term:
            break
    assert seen_accept > 0  # the synthetic trace's n-gram drafts are accepted sometimes
    e.reset(seed=1)
    info = e.step(0 if action == "batch" else np.zeros(M, int))[4]
    assert info["accepted"] == 0 and info["arm"] in ("none", ["none"] * info["rows"])


def test_next_step_autoreset_reports_an_episodes_goodput_once(trace):
    v = SpecServeVectorEnv(3, autoreset_mode=AutoresetMode.NEXT_STEP, **kw(trace, loads=["2"], requests=2))
    v.reset(seed=0)
    reported = np.zeros(3, int)
    ends = np.zeros(3, int)
    for _ in range(400):
        _, _, term, _, info = v.step(np.full(3, 1))
        reported += ~np.isnan(info["goodput"])
        ends += term
        assert np.array_equal(~np.isnan(info["goodput"]), term)  # only on the step that ends an episode
    assert ends.min() >= 2 and np.array_equal(reported, ends)


def test_a_vector_reset_seeds_each_server_with_its_own_seed(trace):
    v = SpecServeVectorEnv(2, **kw(trace))
    v.reset(seed=[1, 2])
    a = v.sim.req_prompt.copy()
    v.reset(seed=[1, 3])
    b = v.sim.req_prompt.copy()
    assert np.array_equal(a[0], b[0]) and not np.array_equal(a[1], b[1])
    one = SpecServeEnv(
        **kw(trace)
    )  # server i seeded with s_i draws what a one-server env seeded with s_i does
    one.reset(seed=3)
    assert np.array_equal(one.sim.req_prompt[0], b[1])
    with pytest.raises(ValueError, match="2 servers"):
        v.reset(seed=[1, 2, 3])


def test_a_masked_reset_with_a_seed_leaves_the_other_servers_streams(trace):
    def second_episode(masked_seed):
        v = SpecServeVectorEnv(2, **kw(trace))
        v.reset(seed=5)
        if masked_seed is not None:
            v.reset(seed=masked_seed, options={"reset_mask": np.array([True, False])})
        v.reset(
            options={"reset_mask": np.array([False, True])}
        )  # server 1's next episode, from its own stream
        return v.sim.req_prompt[1].copy()

    assert np.array_equal(second_episode(None), second_episode(99))


def test_bursty_arrivals_have_their_documented_rate():
    """Bursts of geometric size (mean 8) at exponential gaps: twice the unit rate in the long run, every gap
    alike (the first burst at 0, the second a whole gap later, not two)."""
    rng = np.random.default_rng(0)
    first, later = [], []
    for _ in range(3000):
        arr, _ = request_stream(parse_load("bursty", 8), 40, 8, 1.0, rng)
        starts = np.unique(arr)
        if len(starts) >= 3:
            first.append(starts[1] - starts[0])
            later.append(starts[2] - starts[1])
    assert abs(np.mean(first) / np.mean(later) - 1) < 0.1
    assert abs(np.mean(later) - 4.0) < 0.3  # 8 requests a burst at 2 requests per unit time


def test_poisson_arrivals_come_at_their_rate_times_the_unit_rate():
    """``poisson@X``: exponential gaps at X times the unit rate (here 4 x 2 = 8 requests per second)."""
    arr, _ = request_stream(parse_load("poisson@4", 8), 20000, 8, 2.0, np.random.default_rng(0))
    gaps = np.diff(arr)
    assert abs(1 / gaps.mean() - 8.0) < 0.3 and abs(gaps.std() / gaps.mean() - 1) < 0.05  # exponential: CV 1


def test_the_unit_rate_counts_the_steps_after_the_prefill(trace):
    sim = ServeSim(1, **kw(trace))
    lengths = sim.tb.length[sim.pool].astype(float)
    ctx = float(np.mean(sim.prompt_len[sim.pool] + lengths / 2))
    step = float(sim.cost.forward_s(1, 1, ctx))
    prefill = float(np.mean(sim.cost.prefill_s(sim.prompt_len[sim.pool])))
    assert sim.unit_rate == pytest.approx(1 / ((lengths.mean() - 1) * step + prefill))


def test_reset_arguments_are_checked_and_the_first_reset_starts_every_server(trace):
    """One line for a bad seed, a misspelt option or a mask of the wrong shape; a step before any reset and a
    first reset leaving servers out are refused (they would step servers no episode set up)."""
    v = SpecServeVectorEnv(3, **kw(trace))
    with pytest.raises(ServeEnvError, match="call reset"):
        v.step(np.zeros(3, dtype=np.int64))
    with pytest.raises(ServeEnvError, match="first reset"):
        v.reset(seed=0, options={"reset_mask": [True, False, False]})
    for seed in (-1, "a", 1.5, True, [0, -2, 1]):
        with pytest.raises(ServeEnvError, match="seed must be"):
            v.reset(seed=seed)
    with pytest.raises(ServeEnvError, match=r"unknown reset options \['lod'\]"):
        v.reset(options={"lod": "2"})
    v.reset(seed=0)
    with pytest.raises(ServeEnvError, match="reset_mask must be an array of 3 booleans"):
        v.reset(options={"reset_mask": [True, False]})
    v.reset(options={"reset_mask": [True, False, False]})  # once started, a partial reset is what it is for
    v.step(np.zeros(3, dtype=np.int64))
    e = SpecServeEnv(**kw(trace))
    with pytest.raises(ServeEnvError, match=r"unknown reset options \['reset_mask'\]; valid: load"):
        e.reset(options={"reset_mask": [True]})
    with pytest.raises(ServeEnvError, match="seed must be"):
        e.reset(seed=-1)
