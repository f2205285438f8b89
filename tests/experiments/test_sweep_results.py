"""What a sweep reports: pruning that saves prompts (never at the last one, where stopping saves nothing), a pruned
trial shown with the mean of the prompts it ran (Optuna stores its last prompt's value), and a study whose stored
config is damaged refused in one line."""

from __future__ import annotations

import json

import optuna
import pytest

from experiments.cli import main
from experiments.config import ConfigError, load_config
from experiments.sweep import open_study, work
from experiments.sweep_table import format_trials, trial_row

# the reviewer's study: 4 prompts, Wilcoxon; it pruned trials 2, 3 and 7 at their 4th and last prompt
PRUNED_AT_LAST = """name = "k"
methods = ["ar", "ngram-d8"]
[workload]
limit = 4
[sweep]
method = "ngram-d8"
backend = "analytic"
n_trials = 8
pruner = "{pruner}"
heartbeat_s = 1
grace_s = 5
"""


@pytest.mark.parametrize("pruner", ["wilcoxon", "median"])
def test_no_trial_is_pruned_at_its_last_prompt(tmp_path, pruner):
    path = tmp_path / "k.toml"
    path.write_text(PRUNED_AT_LAST.format(pruner=pruner))
    url = f"sqlite:///{tmp_path / 's.db'}"
    work(str(path), [], url, tmp_path / "run", progress=False)
    trials = optuna.load_study(study_name="k", storage=url).get_trials()
    assert sum(t.state.name in ("COMPLETE", "PRUNED") for t in trials) == 8
    pruned = [t for t in trials if t.state.name == "PRUNED"]
    assert all(len(t.intermediate_values) < 4 for t in pruned), [t.intermediate_values for t in pruned]
    if pruner == "wilcoxon":  # 3 pairs cannot reach p < 0.1 one-sided (1/8 at best): nothing can be pruned
        assert not pruned


def test_a_pruned_trial_shows_the_mean_of_the_prompts_it_ran():
    study = optuna.create_study(direction="maximize")
    trial = study.ask()
    for step, value in enumerate([1.0, 2.0, 6.0]):
        trial.report(value, step)
    frozen = study.tell(trial, state=optuna.trial.TrialState.PRUNED)
    assert frozen.value == 6.0  # Optuna's: the last prompt's
    row = trial_row(frozen)
    assert row["value"] == 3.0 and row["intermediate"] == [1.0, 2.0, 6.0]
    table = format_trials([row], load_config(None, text=""))
    assert "3.000" in table and "6.000" not in table and "(mean of 3 prompts)" in table


def test_pruned_trials_in_the_exported_results_carry_their_mean(tmp_path, capsys):
    path = tmp_path / "p.toml"
    path.write_text(PRUNED_AT_LAST.replace("limit = 4", "limit = 12").format(pruner="median"))
    out = tmp_path / "run"
    assert main(["sweep", str(path), "--out", str(out), "--json", "--set", "sweep.n_trials=10"]) == 0
    result = json.loads(capsys.readouterr().out)
    pruned = [t for t in result["trials"] if t["state"] == "PRUNED"]
    assert pruned, "the median rule prunes some of 10 trials over 12 prompts"
    for t in pruned:
        assert t["value"] == pytest.approx(sum(t["intermediate"]) / len(t["intermediate"]))
        assert len(t["intermediate"]) < 12
    logged = {r["number"]: r for r in map(json.loads, (out / "trials.jsonl").read_text().splitlines())}
    assert all(logged[t["number"]]["value"] == pytest.approx(t["value"]) for t in pruned)


@pytest.mark.parametrize("damage", [["not", "toml"], 42, "this is = not [valid"])
def test_a_damaged_stored_config_is_one_line(tmp_path, capsys, damage):
    path = tmp_path / "c.toml"
    path.write_text(PRUNED_AT_LAST.format(pruner="none"))
    url = f"sqlite:///{tmp_path / 's.db'}"
    open_study(load_config(path), url)
    optuna.load_study(study_name="k", storage=url).set_user_attr("config", damage)
    with pytest.raises(
        ConfigError, match="study 'k' in .* holds a (damaged config attribute|config that cannot be read)"
    ):
        open_study(load_config(path), url)
    assert main(["sweep", str(path), "--storage", url, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "sweep.study_name" in err
