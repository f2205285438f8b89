"""The strict config loader: misspelled keys and wrong types fail with the key's name and where it was set;
precedence is file < sweep trial < command line; a written config reads back equal."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from experiments.config import Config, ConfigError, load_config, parse_set, to_toml

CONFIGS = Path(__file__).resolve().parents[2] / "experiments" / "configs"


def _err(text: str, **kw) -> str:
    with pytest.raises(ConfigError) as info:
        load_config("cfg.toml", text=text, **kw)
    return str(info.value)


def test_defaults_load():
    assert load_config(None) == Config()


def test_misspelled_key_names_key_line_and_suggestion():
    msg = _err('name = "x"\n\n[decode]\nmax_new_token = 5\n')
    assert msg.startswith("cfg.toml:4: unknown key 'decode.max_new_token'")
    assert "did you mean 'max_new_tokens'" in msg


def test_misspelled_table_and_nested_policy_key():
    assert _err("[decods]\nmax_new_tokens = 5\n").startswith("cfg.toml:1: unknown key 'decods'")
    text = 'methods = ["ar", "policy:u"]\n[policies.u]\nkind = "ucb1"\narmz = ["none"]\n'
    assert _err(text).startswith("cfg.toml:4: unknown key 'policies.u.armz'")


@pytest.mark.parametrize(
    "text, needle",
    [
        (
            "[decode]\nmax_new_tokens = 'ten'\n",
            "cfg.toml:2: decode.max_new_tokens must be an integer, got 'ten'",
        ),
        ("[decode]\ntemperature = true\n", "decode.temperature must be a number, got True"),
        ("[decode]\nmax_new_tokens = 0\n", "decode.max_new_tokens must be >= 1, got 0"),
        ("[model]\ndtype = 'fp16'\n", "model.dtype is 'fp16'; valid: auto, bf16, fp32"),
        ("methods = 'ar'\n", "methods must be a list of strings"),
        (
            "methods = ['ar', 'ngram-dX']\n",
            "cfg.toml:1: methods[1] is not a method: cannot read arm 'ngram-dX'",
        ),
        ("methods = ['ar', 'ar']\n", "methods lists a method twice"),
        ("methods = ['ar', 'policy:p']\n", "no [policies.p] table"),
        ("[drafters.ngram]\nmax_gram = 3\n", "drafters.ngram.max_gram is not an option of ngram"),
        ("[sweep]\nmethod = 'ngram-d4'\n", "sweep.method is 'ngram-d4', not one of methods"),
        ("[sweep]\nbackend = 'cloud'\n", "sweep.backend is 'cloud'; valid: live, replay, analytic"),
    ],
)
def test_bad_values_name_the_key(text, needle):
    assert needle in _err(text)


def test_policy_params_checked_against_the_policy_type():
    base = 'methods = ["ar", "policy:u"]\n[policies.u]\n'
    assert "known policy types" in _err(base + 'kind = "ucb"\n')
    assert "policies.u.params.cc is not a parameter of ucb1" in _err(
        base + 'kind = "ucb1"\nparams = { cc = 1 }\n'
    )
    cfg = load_config(None, text=base + 'kind = "ucb1"\nparams = { c = 0.5 }\n')
    assert cfg.policies["u"].params == {"c": 0.5}


def test_set_overrides_are_typed_and_named():
    cfg = load_config(
        None, sets=["decode.max_new_tokens=16", "methods=['ar', 'ngram-d4']", "model.dtype=fp32"]
    )
    assert cfg.decode.max_new_tokens == 16 and cfg.methods == ("ar", "ngram-d4") and cfg.model.dtype == "fp32"
    assert _err("", sets=["decode.max_new_tokens=abc"]).startswith("--set decode.max_new_tokens=abc: decode.")
    assert "unknown key 'decode.max_tokens'" in _err("", sets=["decode.max_tokens=3"])
    assert parse_set("policies.u.params.c=3e-4") == (("policies", "u", "params", "c"), 3e-4)
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        parse_set("decode.max_new_tokens")


def test_precedence_file_then_trial_then_command_line():
    text = "[decode]\nmax_new_tokens = 10\ntop_k = 3\ntop_p = 0.5\n"
    trial = {"decode.max_new_tokens": 20, "decode.top_k": 4}
    cfg = load_config(None, text=text, trial=trial, sets=["decode.max_new_tokens=30"])
    assert (cfg.decode.max_new_tokens, cfg.decode.top_k, cfg.decode.top_p) == (30, 4, 0.5)
    assert "sweep trial (decode.top_k)" in _err(text, trial={"decode.top_k": "many"})


def test_written_config_reads_back_equal(tmp_path):
    cfg = load_config(CONFIGS / "bandit.toml", sets=["drafters.ngram.max_ngram=3"])
    path = tmp_path / "resolved.toml"
    path.write_text(to_toml(cfg, header="resolved"))
    assert load_config(path) == cfg


def test_a_hybrids_parts_take_their_options_as_tables(tmp_path):
    """``[drafters.hybrid.options.PART]``: the parts' options, checked by building the hybrid, written back as an
    inline table that reads back equal; ``--set`` reaches into them too."""
    text = (
        'methods = ["hybrid-d5-k2-b8"]\n[drafters.hybrid]\nparts = "ngram,eagle3"\n'
        "[drafters.hybrid.options.eagle3]\nvocab = 1024\n"
    )
    cfg = load_config(None, text=text)
    assert cfg.drafters["hybrid"]["options"] == {"eagle3": {"vocab": 1024}}
    assert load_config(None, text=to_toml(cfg)) == cfg
    assert "options = {eagle3 = {vocab = 1024}}" in to_toml(cfg)
    over = load_config(None, text=text, sets=["drafters.hybrid.options.eagle3.vocab=512"])
    assert over.drafters["hybrid"]["options"]["eagle3"]["vocab"] == 512
    assert "'vocabb' is not an option of eagle3" in _err(text.replace("vocab =", "vocabb ="))
    assert "eagle3 option vocab must be an integer" in _err(text.replace("1024", "-1"))
    assert "drafters.hybrid.options.eagle3.vocab must be" in _err(text.replace("1024", "{x = {y = 1}}"))
    assert "drafters.ngram.x.y must be a table" in _err("[drafters.ngram.x]\ny = 1\n")
    assert "max_ngram must be an integer" in _err("[drafters.ngram]\nmax_ngram = {a = {b = 1}}\n")


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_example_configs_load_strictly(path):
    load_config(path)


def test_cli_bad_config_is_one_line_exit_2(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\nmethods = ["ar"]\n[decode]\nmax_new_token = 8\n')
    for cmd in ("run", "sweep"):
        r = subprocess.run(
            [sys.executable, "-m", "experiments", cmd, str(bad)], capture_output=True, text=True
        )
        assert r.returncode == 2, r.stderr
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
        assert f"{bad}:4: unknown key 'decode.max_new_token'" in lines[0]


def test_device_loop_methods_are_checked_like_arms():
    cfg = load_config("cfg.toml", text='methods = ["ar", "device:lookup-d4", "device:none"]\n')
    assert list(cfg.methods) == ["ar", "device:lookup-d4", "device:none"]
    msg = _err('methods = ["device:ngram-d4"]\n')
    assert "methods[0] is not a method: unknown device-loop arm 'ngram-d4'" in msg
    msg = _err('methods = ["device:lookup-d4"]\n[decode]\ntemperature = 0.7\n')
    assert "is 'device:lookup-d4', which only runs greedy" in msg
