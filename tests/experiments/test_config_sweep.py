"""Config checks a sweep relies on: heartbeat and grace period that keep a live trial alive (and do not overflow the
heartbeat thread), policy table names that dotted override keys can address, and strings that survive the trip
through ``to_toml`` (the config a study stores and reads back after every trial ran)."""

from __future__ import annotations

import pytest

from experiments.cli import main
from experiments.config import ConfigError, load_config, to_toml
from experiments.strict_toml import _toml_value, tomllib

CONTROL = [chr(c) for c in [*range(0x20), 0x7F]]


@pytest.mark.parametrize(
    ("sweep", "needle"),
    [
        (
            "heartbeat_s = 10\ngrace_s = 2",
            "sweep.grace_s is 2; it must be at least twice sweep.heartbeat_s (10)",
        ),
        ("heartbeat_s = 10\ngrace_s = 19", "sweep.grace_s is 19; it must be at least twice"),
        ("heartbeat_s = 100000000000", "sweep.heartbeat_s must be <= 3600"),
        ("grace_s = 100000000000", "sweep.grace_s must be <= 86400"),
        ("grace_s = 1", "sweep.grace_s must be >= 2"),
    ],
)
def test_heartbeat_and_grace_period_out_of_range_are_one_line(tmp_path, capsys, sweep, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, text=f"[sweep]\nbackend = 'analytic'\n{sweep}\n")
    path = tmp_path / "h.toml"
    path.write_text(f'methods = ["ar", "ngram-d8"]\n[sweep]\nbackend = "analytic"\n{sweep}\n')
    assert main(["sweep", str(path), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]
    assert not (tmp_path / "run").exists()


def test_heartbeat_and_grace_period_in_range_are_taken():
    cfg = load_config(None, text="[sweep]\nheartbeat_s = 3600\ngrace_s = 86400\n")
    assert (cfg.sweep.heartbeat_s, cfg.sweep.grace_s) == (3600, 86400)
    assert load_config(None, text="[sweep]\nheartbeat_s = 1\ngrace_s = 2\n").sweep.grace_s == 2


@pytest.mark.parametrize("name", ["a.b", "", "a b", "ü", 'a"b'])
def test_a_policy_table_name_that_dotted_keys_cannot_address_is_refused(tmp_path, capsys, name):
    method, key = _toml_value(f"policy:{name}"), _toml_value(name)
    text = f'name = "p"\nmethods = ["ar", {method}]\n[policies.{key}]\nkind = "ucb1"\narms = ["none", "ngram-d4"]\n'
    with pytest.raises(ConfigError, match="a policy name is letters, digits, '_' and '-' only"):
        load_config(None, text=text)
    path = tmp_path / "p.toml"
    path.write_text(text + '[sweep]\nbackend = "replay"\nn_trials = 2\n')
    assert main(["sweep", str(path), "--out", str(tmp_path / "run")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_policy_names_of_letters_digits_dash_and_underscore_are_taken():
    text = (
        'methods = ["ar", "policy:Ucb-1_x"]\n[policies.Ucb-1_x]\nkind = "ucb1"\narms = ["none", "ngram-d4"]\n'
    )
    assert "Ucb-1_x" in load_config(None, text=text).policies


@pytest.mark.parametrize("char", CONTROL, ids=[f"U+{ord(c):04X}" for c in CONTROL])
def test_every_control_character_survives_the_trip_through_toml(char):
    s = f'a{char}b\\"{char}'
    assert tomllib.loads(f"v = {_toml_value(s)}")["v"] == s
    assert tomllib.loads(f"{_toml_value(s)} = 1") == {s: 1}  # as a key too
    if char == "\x00":
        return  # no config string may hold NUL (load_config refuses it)
    name = s.replace("\\", "")  # a run's name is a folder under runs/: no path separator, nothing unprintable
    text = (
        f'name = "ab"\nmethods = ["ar", "ngram-d8"]\n[sweep]\nstudy_name = {_toml_value(s)}\n'
        f"[workload]\ncategories = [{_toml_value(s)}]\n"
    )
    cfg = load_config(None, text=text)
    assert cfg.sweep.study_name == s and cfg.workload.categories == (s,)
    with pytest.raises(ConfigError, match="no line break or other unprintable character"):
        load_config(None, text=text.replace('"ab"', _toml_value(name)))
    written = to_toml(cfg, header=f"Exported by: draftgym sweep conf{char}ig.toml\nsecond line")
    assert load_config(None, text=written) == cfg


def test_a_study_whose_config_holds_a_control_character_resumes(tmp_path):
    """The study stores its config as TOML and reads it back on every resume and export: with a raw control
    character it could not, after all its trials ran."""
    from experiments.sweep import open_study

    cfg = load_config(
        None,
        text='name = "plain"\nmethods = ["ar", "ngram-d8"]\n[sweep]\nbackend = "analytic"\n'
        'study_name = "tab\\there\\u0001"\n',  # (a run's name, a folder, holds no control character)
    )
    url = f"sqlite:///{tmp_path / 's.db'}"
    open_study(cfg, url)
    assert open_study(cfg, url).study_name == "tab\there\x01"
