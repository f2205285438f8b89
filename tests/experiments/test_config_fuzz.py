"""The strict TOML loader on arbitrary input: any text, any table of known and unknown keys with values of any
type, any ``--set`` item gives a ``Config`` or a one-line ``ConfigError`` naming the problem — never another
exception; and a config it accepts survives ``to_toml`` and loads back equal."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from experiments.config import Config, load_config, to_toml
from experiments.strict_toml import ConfigError

KEYS = {
    "": ["name", "seed", "methods", "bogus"],
    "model": ["dtype", "path", "device", "dtpye"],
    "workload": ["path", "per_category", "limit", "categories"],
    "decode": ["max_new_tokens", "temperature", "top_p", "top_k", "max_new_token"],
    "sweep": ["n_trials", "backend", "seed", "objective"],
}
VALUES = st.one_of(
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.text(max_size=12),
    st.sampled_from(["auto", "fp32", "bf16", "replay", "live", "analytic", "ar", "ngram-d4"]),
    st.lists(st.sampled_from(["ar", "ngram-d8", "hf_greedy", "bogus-d2", "policy:x", ""]), max_size=4),
)


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return {"nan": "nan", "inf": "inf", "-inf": "-inf"}.get(str(v), repr(v))
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return str(v)


@st.composite
def documents(draw):
    lines = []
    for table, keys in KEYS.items():
        chosen = draw(st.lists(st.sampled_from(keys), unique=True, max_size=3))
        if not chosen:
            continue
        if table:
            lines.append(f"[{table}]")
        lines += [f"{k} = {_toml_value(draw(VALUES))}" for k in chosen]
    return "\n".join(lines) + "\n"


def _load(**kwargs):
    try:
        cfg = load_config(None, **kwargs)
    except ConfigError as err:
        assert "\n" not in str(err).strip(), err
        return None
    assert isinstance(cfg, Config)
    return cfg


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=200))
def test_any_text(text):
    _load(text=text)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(documents())
def test_any_table_of_known_and_unknown_keys(doc):
    cfg = _load(text=doc)
    if cfg is not None:  # what it accepts, it writes back and reads back unchanged
        assert load_config(None, text=to_toml(cfg)) == cfg


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(max_size=30), max_size=3))
def test_any_set_items(items):
    _load(text='name = "x"\n', sets=items)
