"""``experiments.sweep_checks`` on real (in-memory) Optuna studies: a worker joins a study created from the same
config with another seed or trial count, a live tokens/s study created before its machine was recorded takes any
worker, a replay study records its trace's digest, and a refused ``--set`` is shown escaped."""

from __future__ import annotations

import re
from pathlib import Path

import optuna
import pytest

from experiments.config import ConfigError, load_config, to_toml
from experiments.sweep_checks import check_resumed, check_sets, input_digests

TREE = """name = "g"
methods = ["ar", "ngram-d4"]
[workload]
limit = 2
[sweep]
n_trials = 2
backend = "{backend}"
objective = "{objective}"
max_topk = 2
"""


def _cfg(backend: str = "analytic", objective: str = "tau", sets: tuple[str, ...] = ()):
    return load_config(None, text=TREE.format(backend=backend, objective=objective), sets=list(sets))


def _study(cfg, **attrs) -> optuna.Study:
    """A study as ``experiments.sweep.open_study`` creates it (its config and input digests), plus ``attrs``."""
    study = optuna.create_study()
    for key, value in {"config": to_toml(cfg), "inputs": input_digests(cfg), **attrs}.items():
        study.set_user_attr(key, value)
    return study


def test_a_worker_with_another_seed_or_more_trials_joins_and_one_other_key_is_refused():
    study = _study(_cfg())
    check_resumed(study, _cfg(sets=("sweep.seed=7", "sweep.n_trials=5")), "study g")
    with pytest.raises(
        ConfigError, match=r"study g was created from another config \(differs in sweep.max_topk\)"
    ):
        check_resumed(study, _cfg(sets=("sweep.max_topk=1",)), "study g")


def test_a_worker_scoring_another_selection_of_prompts_is_refused():
    """Only the trial count and the seed may differ on resume: a worker whose workload selects other prompts would
    put trials scored on two prompt sets in one study."""
    with pytest.raises(ConfigError, match=r"differs in workload.limit\)"):
        check_resumed(_study(_cfg()), _cfg(sets=("workload.limit=3",)), "study g")


def test_a_live_tokens_per_s_study_without_a_recorded_machine_takes_any_worker():
    cfg = _cfg("live", "tokens_per_s")
    check_resumed(_study(cfg), cfg, "study g")  # created before the machine was recorded
    other = "Other CPU (family 1 model 2; no native bf16)"
    with pytest.raises(ConfigError, match=rf"measured on {re.escape(other)}; this worker runs on"):
        check_resumed(_study(cfg, machine=other), cfg, "study g")


def test_a_replay_study_records_its_traces_digest(tmp_path):
    from env.files import file_digest
    from tests.policies.synthetic import synthetic_trace

    trace = Path(synthetic_trace(num_prompts=3, length=24).save(tmp_path / "trace.npz"))
    cfg = _cfg("replay", sets=(f"sweep.trace={str(trace)!r}",))
    assert input_digests(cfg)["trace_sha256"] == file_digest(trace)


def test_a_refused_set_holding_an_unprintable_character_is_shown_escaped():
    item = 'methods=["ar", "ngram-d4\u200b"]'
    with pytest.raises(ConfigError) as err:
        check_sets(_cfg(), [item])
    assert "\u200b" not in str(err.value) and "\\u200b" in str(err.value)


@pytest.mark.parametrize(
    ("backend", "sets", "needle"),
    [
        ("analytic", ("sweep.max_depth=2",), "lies outside the space"),  # trial 0 is the config as written
        ("replay", ("workload.categories=['nosuch']",), "workload.categories ['nosuch']"),
        ("live", ("workload.path='nosuch.jsonl'",), "nosuch.jsonl"),
    ],
    ids=["outside-the-space", "replay-category", "live-workload"],
)
def test_what_a_trial_would_fail_on_is_refused_before_the_study(tmp_path, backend, sets, needle):
    from experiments.sweep_checks import check_inputs

    with pytest.raises(ValueError, match=re.escape(needle)) as err:
        check_inputs(_cfg(backend, sets=sets))
    assert "\n" not in str(err.value)


def test_a_live_study_records_the_head_of_a_method_it_does_not_tune(tmp_path):
    """Every trial also decodes the config's other methods: their head files are inputs too."""
    import hashlib

    head = tmp_path / "h.safetensors"
    head.write_bytes(b"first head")
    cfg = load_config(
        None,
        text=f'name = "s"\nmethods = ["ar", "eagle-d2", "ngram-d4"]\n[drafters.eagle]\nweights = "{head}"\n'
        '[sweep]\nmethod = "ngram-d4"\ndrafters = ["ngram"]\nbackend = "live"\n',
    )
    assert input_digests(cfg)["drafter_head.eagle"] == hashlib.sha256(b"first head").hexdigest()
