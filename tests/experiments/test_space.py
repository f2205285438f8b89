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
    out = AnalyticEvaluator()(cfg, {}, lambda step, v, n: seen.append((step, v, n)))
    expected = chain_expected_tokens(0.7, 6) / (1 + 0.05 * 6)
    assert out["value"] == pytest.approx(expected) and seen == [(0, pytest.approx(expected), 1)]
    tau = load_config(None, text=cfg_text(0.7, "tau"))  # it returned the speedup whatever the objective
    assert AnalyticEvaluator()(tau, {}, lambda *a: None)["value"] == pytest.approx(
        chain_expected_tokens(0.7, 6)
    )
    with pytest.raises(ConfigError, match="tokens_per_s' needs seconds"):
        AnalyticEvaluator()(load_config(None, text=cfg_text(0.7, "tokens_per_s")), {}, lambda *a: None)


def cfg_text(alpha: float, objective: str) -> str:
    return (
        f'methods = ["ar", "ngram-d6"]\n[workload]\nlimit = 1\n[sweep]\nanalytic_alpha = {alpha}\n'
        f'objective = "{objective}"\n'
    )


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


def test_trial_0_runs_exactly_the_arm_as_written_or_the_config_is_refused():
    """Every arm of a small grid: either trial 0 (``default_params``) resolves to the arm as written (the same canonical
    name), or the config is refused in one line that names the method and what the space allows. A budget below the
    space's was silently raised (ngram-d4-k8-b4 ran as ngram-d4-k8-b8) and a chain's budget dropped."""
    from env.engine import parse_arm

    refused = []
    for depth in range(1, 7):
        for topk in range(1, 5):
            for budget in range(0, depth * topk + 2):
                arm = (
                    f"ngram-d{depth}" + (f"-k{topk}" if topk > 1 else "") + (f"-b{budget}" if budget else "")
                )
                text = f'methods = ["ar", "{arm}"]\n[sweep]\nmax_depth = 8\nmax_topk = 4\n'
                cfg = load_config(None, text=text)
                try:
                    params = default_params(cfg)
                except ConfigError as err:
                    assert "\n" not in str(
                        err
                    ) and f"sweep.method {arm!r} lies outside the sweep space" in str(err)
                    refused.append(arm)
                    continue
                runs = tuned_method(load_config(None, text=text, trial=to_overrides(cfg, params)))
                assert parse_arm(runs).name == parse_arm(arm).name, (arm, runs)
                assert sample(optuna.trial.FixedTrial(params), cfg) == params  # inside the distributions
    assert "ngram-d4-k4-b3" in refused and "ngram-d6-b3" in refused and "ngram-d4-k4-b4" not in refused


@pytest.mark.parametrize(
    ("arm", "needle"),
    [
        (
            "ngram-d4-k8-b4",
            "budgets of at least 8 (max(depth, 0.25 x depth x topk)), not 4; trial 0 would run 'ngram-d4-k8-b8'",
        ),
        ("ngram-d8-b4", "its chains have no node budget (-b4)"),
    ],
)
def test_an_arm_outside_the_space_names_the_value_and_the_space(arm, needle):
    cfg = load_config(None, text=f'methods = ["ar", "{arm}"]\n[sweep]\nmax_topk = 8\n')
    with pytest.raises(ConfigError) as err:
        default_params(cfg)
    assert needle in str(err.value)


@pytest.mark.parametrize(
    ("policy", "needle"),
    [
        (
            'kind = "ucb1"\nparams = { c = 0 }',
            "policies.u.params.c = 0 (written) lies outside the sweep space [0.05, 5]",
        ),
        ('kind = "ucb1"\nparams = { c = 50.0 }', "policies.u.params.c = 50.0 (written) lies outside"),
        (
            'kind = "thompson"\nparams = { scale = 0.1 }',
            "policies.u.params.scale = 0.1 (written) lies outside",
        ),
        ('kind = "exp3"', "policies.u.params.gamma is unset (exp3 chooses it itself)"),
    ],
)
def test_a_policy_parameter_outside_the_space_is_refused(policy, needle):
    cfg = load_config(None, text=f'methods = ["ar", "policy:u"]\n[policies.u]\n{policy}\n')
    with pytest.raises(ConfigError) as err:
        default_params(cfg)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_policy_defaults_inside_the_space_are_the_config_as_written():
    for kind, key in [("ucb1", "c"), ("thompson", "scale"), ("linucb", "alpha")]:
        text = f'methods = ["ar", "policy:u"]\n[policies.u]\nkind = "{kind}"\n'
        cfg = load_config(None, text=text)
        params = default_params(cfg)  # the class default, written out
        resolved = load_config(None, text=text, trial=to_overrides(cfg, params))
        assert resolved.policies["u"].params == {key: 1.0}


@pytest.mark.parametrize(
    ("policy", "needle"),
    [
        (
            'kind = "sb3"',
            "policies.u is a sb3 policy, trained offline (draftgym train): a sweep does not train",
        ),
        ('kind = "predictor"', "policies.u is a predictor policy, trained offline"),
        (
            'kind = "ucb1"\npath = "u.zip"',
            "policies.u.path is set: every trial would load the same saved policy",
        ),
        ('kind = "static"\nparams = { arm = "none" }', "no sweep space for policy type 'static'"),
    ],
)
def test_a_sweep_that_cannot_tune_its_policy_is_refused_before_any_folder(tmp_path, capsys, policy, needle):
    """A trained policy (sb3, predictor) needs draftgym train per trial, and a loaded one ignores its parameters:
    such a sweep failed every trial, or ran one saved policy under every label."""
    path = tmp_path / "s.toml"
    path.write_text(
        f'name = "s"\nmethods = ["ar", "policy:u"]\n[policies.u]\n{policy}\narms = ["none", "ngram-d4"]\n'
        '[sweep]\nbackend = "replay"\nn_trials = 2\n'
    )
    from experiments.cli import main

    assert main(["sweep", str(path), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "run").exists()


def test_an_arm_the_sweep_samples_is_in_the_space_as_trial_0():
    """A sampled fraction is rounded to a whole budget: ``ngram-d3-k6-b4`` (4 of 18 nodes, under a quarter) is what
    the space's floor gives, so it is accepted as written, and trial 0 runs it."""
    cfg = load_config(None, text='methods = ["ar", "ngram-d3-k6-b4"]\n[sweep]\nmax_topk = 6\n')
    params = default_params(cfg)
    from experiments.space import arm_of

    assert arm_of(cfg, params).name == "ngram-d3-k6-b4" and params["ngram.budget_frac"] == 0.25
