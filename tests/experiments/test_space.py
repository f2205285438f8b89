"""The sweep's space: the config as written maps to parameters and back to itself; every sample is a valid config;
the analytic objective peaks where the closed form says."""

from __future__ import annotations

import optuna
import pytest

from env.metrics import chain_expected_tokens
from experiments.config import ConfigError, load_config
from experiments.objective import AnalyticEvaluator
from experiments.space import default_params, sample, to_overrides, tuned_method

TREE = 'methods = ["ar", "ngram-d12-k4-b24"]\n[sweep]\nmax_depth = 16\nmax_topk = 4\n'


def test_default_params_round_trip_to_the_config_as_written():
    for arm in ("ngram-d8", "ngram-d12-k4-b24", "ngram-d4-k2"):
        cfg = load_config(None, text=f'methods = ["ar", "{arm}"]\n')
        params = default_params(cfg)
        trial = optuna.trial.FixedTrial(params)
        assert sample(trial, cfg) == params
        assert load_config(None, text=f'methods = ["ar", "{arm}"]\n', trial=to_overrides(cfg, params)) == cfg


def test_samples_are_valid_configs():
    cfg = load_config(None, text=TREE)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0), direction="maximize")
    for _ in range(40):
        trial = study.ask()
        over = to_overrides(cfg, sample(trial, cfg))
        resolved = load_config(None, text=TREE, trial=over)  # validation included
        shape = __import__("env.engine").engine.parse_arm(tuned_method(resolved)).shape
        assert 1 <= shape.depth <= 16 and 1 <= shape.topk <= 4 and shape.max_nodes <= shape.depth * shape.topk
        study.tell(trial, 0.0)


def test_config_outside_the_space_is_refused():
    cfg = load_config(None, text='methods = ["ar", "ngram-d20"]\n')
    with pytest.raises(ConfigError, match="outside the space"):
        default_params(cfg)


def test_policy_space_sets_policy_params():
    pytest.importorskip("policies.bandits")
    text = 'methods = ["ar", "policy:u"]\n[policies.u]\nkind = "ucb1"\nparams = { c = 0.5 }\n'
    cfg = load_config(None, text=text)
    assert default_params(cfg) == {"c": 0.5}
    over = to_overrides(cfg, {"c": 2.0})
    assert over == {"policies.u.params.c": 2.0}
    assert load_config(None, text=text, trial=over).policies["u"].params["c"] == 2.0


def test_analytic_objective_is_the_closed_form():
    cfg = load_config(
        None, text='methods = ["ar", "ngram-d6"]\n[workload]\nlimit = 1\n[sweep]\nanalytic_alpha = 0.7\n'
    )
    seen = []
    out = AnalyticEvaluator()(cfg, {}, lambda step, v: seen.append((step, v)))
    expected = chain_expected_tokens(0.7, 6) / (1 + 0.05 * 6)
    assert out["value"] == pytest.approx(expected) and seen == [(0, pytest.approx(expected))]


def test_the_widest_corner_of_the_space_is_an_arm_of_at_most_4096_nodes():
    """With max_depth 256 and max_topk 64 a budget fraction below 1 made arms of up to 16,384 nodes, refused by the
    arm check inside the objective (a worker's death mid-sweep); the budget is capped at the arm's bound instead."""
    from experiments.space import arm_of

    wide = 'methods = ["ar", "ngram-d12-k4-b24"]\n[sweep]\nmax_depth = 256\nmax_topk = 64\n'
    cfg = load_config(None, text=wide)
    for frac in (0.25, 0.6, 1.0):
        arm = arm_of(
            cfg, {"drafter": "ngram", "ngram.depth": 256, "ngram.topk": 64, "ngram.budget_frac": frac}
        )
        assert arm.shape.max_nodes == 4096
        over = to_overrides(
            cfg, {**default_params(cfg), "ngram.depth": 256, "ngram.topk": 64, "ngram.budget_frac": frac}
        )
        shape = (
            __import__("env.engine")
            .engine.parse_arm(tuned_method(load_config(None, text=wide, trial=over)))
            .shape
        )
        assert shape.max_nodes == 4096
