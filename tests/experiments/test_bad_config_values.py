"""Config values the CLI would refuse are refused in a config too, in one ``ConfigError`` line, before any model
loads: TOML's ``nan`` and ``inf`` (a NaN passes every ``min``/``max`` check), ``top_p`` outside (0, 1], a
temperature past 1e4, a ``[drafters.NAME]`` value the drafter refuses (each configured drafter is built once) and
a policy parameter its policy refuses (each policy built once over its arm menu)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from experiments.config import Config, load_config, to_toml
from experiments.strict_toml import ConfigError

OK = 'name = "x"\nmethods = ["ar"]\n\n[decode]\nmax_new_tokens = 4\n'
POLICY = OK + '\n[policies.u]\nkind = "ucb1"\narms = ["none", "ngram-d2", "ngram-d4"]\n'


def _err(text: str = OK, sets: tuple[str, ...] = ()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config("cfg.toml", text=text, sets=list(sets))
    msg = str(info.value)
    assert "\n" not in msg, msg
    return msg


@pytest.mark.parametrize(
    "sets, needle",
    [
        (
            ["decode.temperature=nan"],
            "--set decode.temperature=nan: decode.temperature must be a finite number",
        ),
        (["decode.temperature=inf"], "decode.temperature must be a finite number, got inf"),
        (["decode.temperature=-inf"], "decode.temperature must be a finite number"),
        (["decode.temperature=2e4"], "decode.temperature must be <= 10000.0, got 20000.0"),
        (["decode.temperature=1.0", "decode.top_p=nan"], "decode.top_p must be a finite number, got nan"),
        (["decode.top_p=0.0"], "decode.top_p must be in (0, 1], got 0.0"),
        (["decode.top_p=0"], "decode.top_p must be in (0, 1], got 0.0"),
        (["decode.top_p=1.5"], "decode.top_p must be in (0, 1], got 1.5"),
        (["decode.max_new_tokens=99999999999"], "decode.max_new_tokens must be <= 1048576"),
        (["sweep.analytic_alpha=nan"], "sweep.analytic_alpha must be a finite number"),
        (["sweep.analytic_node_cost=inf"], "sweep.analytic_node_cost must be a finite number"),
        (["drafters.ngram.max_matches=nan"], "drafters.ngram.max_matches must be a finite number, got nan"),
    ],
)
def test_non_finite_and_out_of_range_numbers(sets, needle):
    assert needle in _err(sets=tuple(sets))


def test_the_file_line_is_named_for_a_nan_in_the_file():
    msg = _err(OK + "temperature = nan\n")
    assert msg == "cfg.toml:6: decode.temperature must be a finite number, got nan"


def test_good_values_still_load_and_read_back():
    cfg = load_config(None, text=OK, sets=["decode.temperature=1e4", "decode.top_p=1", "decode.top_p=0.01"])
    assert cfg.decode.top_p == 0.01 and cfg.decode.temperature == 1e4
    assert load_config(None, text=to_toml(cfg)) == cfg
    assert math.isfinite(Config().decode.top_p)


@pytest.mark.parametrize(
    "sets, needle",
    [
        (
            ["drafters.ngram.max_ngram=0"],
            "--set drafters.ngram.max_ngram=0: drafters.ngram.max_ngram is refused",
        ),
        (["drafters.ngram.max_ngram=2.5"], "ngram option max_ngram must be an integer"),
        (["drafters.ngram.min_ngram=3", "drafters.ngram.max_ngram=2"], "min_ngram <= max_ngram"),
        (['drafters.eagle.min_prob="abc"'], "drafters.eagle.min_prob is refused: eagle option min_prob"),
        (["drafters.suffix.choose=1"], "drafters.suffix.choose is refused"),
        (["drafters.hybrid.unscored=0"], "drafters.hybrid.unscored is refused"),
        (['drafters.hybrid.parts="suffix,bogus"'], "unknown hybrid part 'bogus'"),
        (["drafters.recycling.width=true"], "recycling option width must be an integer"),
    ],
)
def test_a_drafter_value_it_refuses(sets, needle):
    assert needle in _err(sets=("methods=['ngram-d2']", *sets))


def test_a_drafter_value_in_the_file_names_its_line():
    msg = _err(OK + "\n[drafters.ngram]\nmax_ngram = 2\nmax_depth = 0\n")
    assert msg.startswith("cfg.toml:9: drafters.ngram.max_depth is refused: ngram option max_depth")


@pytest.mark.parametrize(
    "params, needle",
    [
        ('{ c = "abc" }', "refused by ucb1: "),
        ("{ c = nan }", "policies.u.params.c must be a finite number"),
        ("{ scale = 0 }", "refused by ucb1: "),
    ],
)
def test_a_policy_parameter_it_refuses(params, needle):
    msg = _err(POLICY + f"params = {params}\n", sets=("methods=['policy:u']",))
    assert msg.startswith("cfg.toml:10: policies.u.params") and needle in msg


def test_good_policy_and_drafter_values_load():
    cfg = load_config(
        None,
        text=POLICY + "params = { c = 0.5, scale = 13 }\n\n[drafters.ngram]\nmax_ngram = 3\n",
        sets=["methods=['policy:u', 'ngram-d4']"],
    )
    assert cfg.policies["u"].params == {"c": 0.5, "scale": 13} and cfg.drafters["ngram"] == {"max_ngram": 3}


def test_the_shipped_configs_still_load():
    for path in sorted((Path(__file__).resolve().parents[2] / "experiments" / "configs").glob("*.toml")):
        load_config(path)


@pytest.mark.parametrize(
    "command, sets, needle",
    [
        (
            "run",
            ["--set", 'methods=["ngram-d2"]', "--set", "drafters.ngram.max_ngram=0"],
            "drafters.ngram.max_ngram",
        ),
        (
            "run",
            ["--set", "decode.temperature=1.0", "--set", "decode.top_p=nan"],
            "decode.top_p must be a finite",
        ),
        ("run", ["--set", "decode.top_p=0.0"], "decode.top_p must be in (0, 1]"),
        (
            "run",
            ["--set", 'methods=["policy:u"]', "--set", 'policies.u.params.c="abc"'],
            "policies.u.params.c",
        ),
        ("train", ["--set", 'policies.u.params.c="abc"'], "policies.u.params.c"),
    ],
)
def test_the_cli_refuses_in_one_line_before_the_model_loads(
    command, sets, needle, tmp_path, capsys, monkeypatch
):
    import env.model
    from experiments.cli import main

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(env.model, "load_model", no_model)
    cfg = tmp_path / "ok.toml"
    cfg.write_text(POLICY)
    assert main([command, str(cfg), *sets, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and err[0].startswith(f"draftgym {command}: error: "), err
