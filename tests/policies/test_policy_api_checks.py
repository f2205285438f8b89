"""The policies' Python API refuses what it used to take silently: NaN rewards (the statistics turned NaN and every
policy picked arm 0 for ever), action indices outside the menu (-1 credited the last arm), a string as the arm menu
("abc" was three arms), observation sizes and feature names that save files which do not load, act_batch inputs of
the wrong shape or with NaN, and predictors fitted on outputs of the wrong width."""

from __future__ import annotations

import math

import numpy as np
import pytest

from policies.bandits import EXP3, UCB1, ThompsonSampling
from policies.base import PolicyError
from policies.heuristic import HFSchedulePolicy
from policies.linucb import LinUCB
from policies.predictor import PredictorPolicy
from policies.serving import BatchTablePolicy, BucketUCB

ARMS = ["none", "ngram-d2", "ngram-d4"]
SERVE_OBS = 21  # a serving observation's size at two rows (9 load and pooled features, 6 per row)


def _online() -> list:
    return [
        UCB1(ARMS),
        ThompsonSampling(ARMS),
        EXP3(ARMS),
        LinUCB(ARMS, 3),
        BucketUCB(ARMS, SERVE_OBS),
    ]


def _obs(p) -> np.ndarray | None:
    return np.full(p.obs_size, 0.25) if p.obs_size else None


@pytest.mark.parametrize("reward", [math.nan, math.inf, -math.inf, None, "1", True])
def test_an_online_policy_refuses_a_reward_that_is_no_finite_number(reward):
    for p in _online():
        p.act(_obs(p))
        with pytest.raises(PolicyError, match="reward must be a finite number"):
            p.update(_obs(p), 1, reward, {})


@pytest.mark.parametrize("action", [-1, 3, 1.5, True, "1", None])
def test_an_online_policy_refuses_an_action_outside_its_menu(action):
    for p in [*_online(), HFSchedulePolicy(ARMS)]:
        p.act(_obs(p))
        with pytest.raises(PolicyError, match=r"action must be an arm index in 0\.\.2"):
            p.update(_obs(p), action, 1.0, {})


def test_a_policy_learns_on_after_good_updates_numpy_scalars_included():
    p = UCB1(ARMS)
    for a in range(3):
        p.update(None, np.int64(a), np.float32(1.0), {})
    for _ in range(4):
        p.update(None, 1, 5.0, {})
    assert p.act(None) == 1  # (a NaN reward before made every act arm 0)


@pytest.mark.parametrize("info", [None, {"accepted": "3", "drafted": 4}, {"accepted": math.nan, "drafted": 4},
                                  {"accepted": 2, "drafted": -1}])  # fmt: skip
def test_a_schedule_refuses_step_counts_that_are_no_counts(info):
    p = HFSchedulePolicy(ARMS)
    p.act(None)
    with pytest.raises(PolicyError, match="info"):
        p.update(None, 1, 1.0, info)


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"arms": "abc"}, "list of names"),
        ({"arms": ["none", 2]}, "non-empty strings"),
        ({"arms": ["none", ""]}, "non-empty strings"),
        ({"obs_size": -5}, "obs_size"),
        ({"obs_size": 2.7}, "obs_size"),
        ({"obs_size": True}, "obs_size"),
        ({"obs_size": "3"}, "obs_size"),
        ({"obs_size": 10**12}, "obs_size"),
        ({"obs_size": 3, "features": [1, 2, 3]}, "non-empty strings"),
        ({"obs_size": 3, "features": ["a", "b"]}, "features names 2"),
    ],
)
def test_the_menu_and_observation_are_checked_when_a_policy_is_made(kwargs, says):
    args = {"arms": ARMS, "obs_size": 0, **kwargs}
    with pytest.raises(PolicyError, match=says):
        UCB1(args.pop("arms"), args.pop("obs_size"), **args)


def test_linucb_refuses_matrices_past_a_gibibyte_before_it_allocates():
    with pytest.raises(PolicyError, match="floats"):
        LinUCB(ARMS, 30_000)  # 2.7e9 floats: 21 GB


def _predictor() -> PredictorPolicy:
    rng = np.random.default_rng(0)
    x = rng.random((40, 4))
    return PredictorPolicy(ARMS, 4, model="ridge").fit(x, rng.random((40, 3)), rng.random((40, 3)) + 0.5)


@pytest.mark.parametrize("bad", ["nan", "one column", "one row", "objects"])
def test_act_batch_refuses_observations_of_another_shape_or_not_finite(bad):
    table = BatchTablePolicy(ARMS, SERVE_OBS, table=[[1, "ngram-d4"], [16, "none"]])
    for p in (_predictor(), table):
        n = p.obs_size
        obs = {"nan": np.full((2, n), np.nan), "one column": np.zeros((2, 1)), "one row": np.zeros(n),
               "objects": np.zeros((2, n), object)}[bad]  # fmt: skip
        with pytest.raises(PolicyError, match="act_batch"):
            p.act_batch(obs)
        assert p.act_batch(np.zeros((2, n))).shape == (2,)


@pytest.mark.parametrize("accept_cols, cost_cols", [(5, 1), (3, 2)])
def test_a_predictor_refuses_outputs_that_are_not_one_per_arm(accept_cols, cost_cols):
    rng = np.random.default_rng(0)
    with pytest.raises(PolicyError, match="one per arm"):
        PredictorPolicy(ARMS, 4, model="ridge").fit(
            rng.random((40, 4)), rng.random((40, accept_cols)), rng.random((40, cost_cols))
        )


def test_a_predictor_refuses_inputs_of_another_width_or_nan_and_an_untrained_one_is_not_saved(tmp_path):
    rng = np.random.default_rng(0)
    p = PredictorPolicy(ARMS, 4, model="ridge")
    with pytest.raises(PolicyError, match=r"inputs \[N, 4\]"):
        p.fit(rng.random((40, 7)), rng.random((40, 3)), rng.random((40, 3)))
    x = rng.random((40, 4))
    x[3, 1] = np.nan
    with pytest.raises(PolicyError, match="finite"):
        p.fit(x, rng.random((40, 3)), rng.random((40, 3)))
    with pytest.raises(PolicyError, match="untrained"):
        p.save(tmp_path / "p.zip")
    assert not (tmp_path / "p.zip").exists()


@pytest.mark.parametrize(
    "make",
    [
        lambda: UCB1(ARMS, c=1e308),  # every arm's bound alike: trained to the worst static arm
        lambda: UCB1(ARMS, scale=1e308),
        lambda: UCB1(ARMS, window=10**18),
        lambda: EXP3(ARMS, horizon=10**18),
        lambda: LinUCB(ARMS, 3, alpha=1e300),
    ],
)
def test_parameters_far_past_any_use_are_refused(make):
    with pytest.raises(PolicyError, match=r"must be .* in [[(]"):
        make()


def test_a_policy_is_not_saved_to_a_folder_or_an_empty_name_and_the_zip_checks_skip_a_fifo(tmp_path):
    import os

    from policies.archive import is_policy_zip, is_sb3_zip

    (tmp_path / "dir.zip").mkdir()
    for target in (tmp_path / "dir.zip", ""):
        with pytest.raises(PolicyError, match="cannot save a policy to"):
            UCB1(ARMS).save(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.zip"]  # no .tmp left
    os.mkfifo(tmp_path / "fifo.zip")
    fifo = tmp_path / "fifo.zip"
    assert not is_policy_zip(fifo) and not is_sb3_zip(fifo)  # (they blocked)


def test_numpy_and_zero_dimensional_values_are_taken():
    """What numpy and SB3 hand over: an integer obs_size, string arms, and the 0-d arrays ``predict`` returns for
    one observation."""
    import torch

    p = LinUCB(np.array(ARMS), np.int64(3))
    assert p.obs_size == 3 and all(type(a) is str for a in p.arm_names)
    obs = np.full(3, 0.5)
    p.update(obs, np.array(1), np.array(2.0), {})
    p.update(obs, torch.tensor(2), torch.tensor(1.5), {})
    assert p.pulls.tolist() == [0, 1, 1]


def test_the_replay_scores_refuse_an_arm_or_prompts_the_trace_lacks(synth_env):
    """``score_static(env, -1)`` scored the last arm; unknown prompts were a bare ``KeyError``; a string of ids was
    read character by character."""
    from policies.oracle import score_static

    for arm in (-1, len(synth_env.arm_names), 1.0, True):
        with pytest.raises(PolicyError, match="arm must be an index"):
            score_static(synth_env, arm)
    with pytest.raises(PolicyError, match="not in the trace"):
        score_static(synth_env, 0, ["nope"])
    with pytest.raises(PolicyError, match="a list of prompt ids"):
        score_static(synth_env, 0, "01")
    assert score_static(synth_env, 0, [synth_env.prompt_ids[0]]).prompts == [synth_env.prompt_ids[0]]
