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


def test_parameters_beside_a_saved_policy_that_it_does_not_have_are_said_not_applied(tmp_path, capsys):
    """``path`` loads a saved policy, whose parameters are its own: ``params`` beside it that differ were dropped
    without a word (``train`` reads them, so they are no error)."""
    from experiments.methods import build_policy
    from policies.bandits import UCB1

    UCB1(["none", "ngram-d2", "ngram-d4"], scale=13.0).save(tmp_path / "u.zip")
    text = POLICY + f'path = "{tmp_path / "u.zip"}"\nparams = {{ scale = 5.0, c = 1.0 }}\n'
    cfg = load_config(None, text=text, sets=["methods=['policy:u']"])
    assert build_policy("u", cfg.policies["u"]).params()["scale"] == 13.0
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and "policies.u.params.scale = 5.0 is not applied" in err and "is 13.0" in err
    ), err


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


# An integer past TOML's 64-bit range (``tomllib`` reads any size) overflowed where it was made a float
# (``math.isfinite``, ``float``) or passed every check of an unbounded field and failed after the model loaded.
HUGE = "1" + "0" * 400


@pytest.mark.parametrize(
    "line, key",
    [
        (f"temperature = {HUGE}", "decode.temperature"),
        (f"top_k = {HUGE}", "decode.top_k"),
        (f"top_p = {HUGE}", "decode.top_p"),
        (f"top_p = -{HUGE}", "decode.top_p"),
    ],
    ids=["temperature", "top_k", "top_p", "top_p-negative"],
)
def test_a_huge_integer_is_one_line_naming_the_key(line, key):
    msg = _err(OK + line + "\n")
    assert msg.startswith(f"cfg.toml:6: {key} is an integer outside TOML's 64-bit range"), msg
    assert "(401 digits)" in msg and len(msg) < 200, msg


@pytest.mark.parametrize(
    "sets, key",
    [
        ([f"sweep.analytic_alpha={HUGE}"], "sweep.analytic_alpha"),
        ([f"workload.limit={HUGE}"], "workload.limit"),
        (["methods=['ngram-d2']", f"drafters.ngram.max_matches={HUGE}"], "drafters.ngram.max_matches"),
        (["methods=['ngram-d2']", f"drafters.eagle.min_prob={HUGE}"], "drafters.eagle.min_prob"),
    ],
    ids=["analytic_alpha", "limit", "ngram-max_matches", "eagle-min_prob"],
)
def test_a_huge_integer_in_other_fields_and_options(sets, key):
    assert f"{key} is an integer outside TOML's 64-bit range" in _err(sets=tuple(sets))


def test_a_huge_policy_parameter_names_it():
    msg = _err(POLICY + f"params = {{ c = {HUGE} }}\n", sets=("methods=['policy:u']",))
    assert msg.startswith("cfg.toml:10: policies.u.params.c is an integer outside TOML's 64-bit range"), msg


def test_top_k_has_a_maximum():
    from env.engine import Sampling
    from experiments.args import MAX_TOP_K

    assert MAX_TOP_K == 2**31 - 1
    assert load_config(None, text=OK, sets=[f"decode.top_k={MAX_TOP_K}"]).decode.top_k == MAX_TOP_K
    assert f"decode.top_k must be <= {MAX_TOP_K}, got {MAX_TOP_K + 1}" in _err(
        sets=(f"decode.top_k={MAX_TOP_K + 1}",)
    )
    assert Sampling(top_k=MAX_TOP_K).top_k == MAX_TOP_K  # the engine's bound is the config's and the CLI's
    with pytest.raises(ValueError, match=r"top_k must be in \[0, 2\*\*31 - 1\]"):
        Sampling(top_k=MAX_TOP_K + 1)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"top_k": int(HUGE)}, "top_k must be in [0, 2**31 - 1]"),
        ({"temperature": int(HUGE)}, "temperature must be a finite number"),
        ({"temperature": 1.0, "top_p": int(HUGE)}, "top_p must be a finite number"),
    ],
    ids=["top_k", "temperature", "top_p"],
)
def test_sampling_refuses_a_huge_integer_with_a_value_error(kwargs, needle):
    from env.engine import Sampling

    with pytest.raises(ValueError) as info:
        Sampling(**kwargs)
    assert needle in str(info.value) and len(str(info.value)) <= 200


def test_sampling_refuses_a_temperature_the_kernels_would_verify_greedily():
    """Below 2**-100 (logits / T leaves float32) ``kernels.verify`` is greedy; the engine drew coins for a sample."""
    from env.engine import Sampling
    from kernels.common import MIN_TEMPERATURE

    with pytest.raises(ValueError, match="below 2\\*\\*-100"):
        Sampling(temperature=MIN_TEMPERATURE / 2)
    assert Sampling(temperature=MIN_TEMPERATURE).temperature == MIN_TEMPERATURE


@pytest.mark.parametrize("key", ["temperature", "top_k", "top_p"])
def test_run_refuses_a_huge_integer_in_one_line_and_leaves_no_run_folder(key, tmp_path, capsys, monkeypatch):
    import env.model
    from experiments.cli import main

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(env.model, "load_model", no_model)
    cfg = tmp_path / "huge.toml"
    cfg.write_text(OK + f"{key} = {HUGE}\n")
    out = tmp_path / "run"
    assert main(["run", str(cfg), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("draftgym run: error: "), err
    assert f"decode.{key} is an integer outside TOML's 64-bit range" in err[0], err
    assert not out.exists()


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--top-k", HUGE], "argument --top-k: must be <= 2147483647, got 100000... (401 digits)"),
        (["--top-k", str(2**31)], f"argument --top-k: must be <= 2147483647, got {2**31}"),
        (["--top-k", "1" * 5000], "argument --top-k: must be <= 2147483647, got 111111... (5000 digits)"),
        (["--depth", HUGE], "argument --depth: must be <= 9223372036854775807, got 100000... (401 digits)"),
        (["--budget", HUGE], "argument --budget: must be <= 9223372036854775807"),
        (["--max-new-tokens", HUGE], "argument --max-new-tokens: must be <= 1048576, got 100000..."),
    ],
    ids=["top-k", "top-k-2**31", "top-k-5000-digits", "depth", "budget", "max-new-tokens"],
)  # fmt: skip
def test_generate_refuses_a_huge_number_in_one_line(argv, needle, tmp_path, capsys, monkeypatch):
    import env.model
    from experiments.cli import main

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(env.model, "load_model", no_model)
    monkeypatch.chdir(tmp_path)
    assert main(["generate", "hi", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("draftgym generate: error: ") and needle in err[0], err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("option", ["ngram.max_matches", "eagle.min_prob"])
def test_a_huge_drafter_option_is_one_line(option, tmp_path, capsys, monkeypatch):
    import env.model
    from experiments.cli import main

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(env.model, "load_model", no_model)
    out = tmp_path / "run"
    assert main(["bench", "--drafter-option", f"{option}={HUGE}", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"draftgym bench: error: --drafter-option {option}="), err
    assert err[0].endswith(
        "the value is an integer outside TOML's 64-bit range (-2**63 .. 2**63-1): 100000... (401 digits)"
    )
    assert not out.exists()


@pytest.mark.parametrize(
    "arm, needle",
    [
        ("ngram-d4@int4", "policies.u.arms[1] is not an arm: cannot read arm 'ngram-d4@int4'"),
        ("ar", "policies.u.arms[1] is 'ar': write it as 'none'"),
        ("ngram-d4-k1", "policies.u.arms[1] is 'ngram-d4-k1': write it as 'ngram-d4'"),
        ("ngram-d2-k2-b4", "policies.u.arms[1] is 'ngram-d2-k2-b4': write it as 'ngram-d2-k2'"),
    ],
)
def test_a_policy_arm_is_written_as_the_decoder_names_it(arm, needle):
    """A policy's arms are matched to the decoder's by name: one written otherwise (or with a method's @VARIANT)
    was accepted here and refused only after the model had loaded."""
    assert needle in _err(POLICY.replace('"ngram-d2"', f'"{arm}"'))
    assert list(load_config("cfg.toml", text=POLICY).policies["u"].arms) == ["none", "ngram-d2", "ngram-d4"]


@pytest.mark.parametrize(
    "kind, params, needle",
    [
        ("sb3", '{ algo = "ppo", net_arch = "100000000,100000000" }', "layer sizes of at most 4096"),
        ("sb3", '{ algo = "ppo", seed = 1099511627776 }', "seed must be an integer in [0, 4294967295]"),
        ("predictor", "{ hidden = 65536 }", "predictor hidden must be an integer in [1, 4096]"),
    ],
)
def test_network_sizes_past_any_machine_are_refused(kind, params, needle):
    """They passed the config's checks and failed when the network was built (4e16 bytes asked, or 32 GiB a
    layer), or numpy refused the seed at the build."""
    text = OK + f'\n[policies.p]\nkind = "{kind}"\narms = ["none", "ngram-d2"]\nparams = {params}\n'
    assert needle in _err(text, sets=("methods=['policy:p']",))


def test_a_sweep_of_a_billion_billion_trials_is_refused():
    assert "sweep.n_trials must be <= 1000000" in _err(OK, sets=("sweep.n_trials=1000000000000000000",))


def test_a_value_nested_too_deep_is_refused_whatever_the_recursion_limit():
    """It was refused only when the TOML parser ran out of stack, which a raised recursion limit (some library in
    the same process raised it) let it not do."""
    import sys

    from experiments.strict_toml import parse_set

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(100_000)
    try:
        with pytest.raises(ConfigError, match="nests too deep"):
            parse_set("a.b=" + "{a=" * 400 + "1" + "}" * 400)
    finally:
        sys.setrecursionlimit(limit)
    assert parse_set("a.b={x=[1,{y=2}]}") == (("a", "b"), {"x": [1, {"y": 2}]})
