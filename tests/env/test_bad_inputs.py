"""Damaged files and specs refused on load, in one line naming the file and the field: a feature spec (a policy's
``meta.feature_spec``, a trace header's), a cost model JSON and a trace ``.npz``, each a valid one with one thing
broken. Nothing is read lazily: every case fails in the loader, not later in replay with a traceback."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from env.cost import CostModelError, load_cost_model
from env.features import FeatureSpec, FeatureSpecError
from env.trace import TraceError, load_trace
from experiments.cli import main
from experiments.errors import is_user_error
from tests.env.conftest import make_trace, toy_cost_model


def _one_line(err: pytest.ExceptionInfo, *needles: str) -> None:
    text = str(err.value)
    assert "\n" not in text and "Traceback" not in text, text
    for needle in needles:
        assert needle in text, (needle, text)


def _cli_refuses(args: list[str], capsys, *needles: str) -> None:
    """``draftgym ARGS`` exits 2 with one stderr line holding each of ``needles``."""
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"draftgym {args[0]}: error:") and "\n" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)


# ---- feature specs ----------------------------------------------------------------------------------------------

SPECS = [
    ("unknown-key", {"proj_dim": 8, "projdim": 4}, "unknown key(s) 'projdim'"),
    ("list", [8, 0, 16, 0.5], "must be a mapping"),
    ("string", "proj_dim=8", "must be a mapping"),
    ("proj-dim-string", {"proj_dim": "8"}, "proj_dim must be an integer"),
    ("proj-dim-float", {"proj_dim": 8.0}, "proj_dim must be an integer"),
    ("proj-dim-huge-float", {"proj_dim": 1e9}, "proj_dim must be an integer in 0..1024"),
    ("proj-dim-huge", {"proj_dim": 10**9}, "proj_dim must be an integer in 0..1024"),
    ("proj-dim-bool", {"proj_dim": True}, "proj_dim must be an integer"),
    ("proj-dim-negative", {"proj_dim": -1}, "proj_dim must be an integer"),
    ("proj-seed-negative", {"proj_seed": -3}, "proj_seed must be an integer"),
    ("proj-seed-none", {"proj_seed": None}, "proj_seed must be an integer"),
    ("match-max-zero", {"match_max": 0}, "match_max must be an integer in 1.."),
    ("match-max-huge", {"match_max": 10**12}, "match_max must be an integer in 1.."),
    ("decay-nan", {"decay": math.nan}, "decay must be a number in [0, 1)"),
    ("decay-one", {"decay": 1.0}, "decay must be a number in [0, 1)"),
    ("decay-string", {"decay": "0.5"}, "decay must be a number"),
    ("decay-bool", {"decay": False}, "decay must be a number"),
    ("decay-past-float", {"decay": 10**400}, "decay must be a number"),
    ("draft-features-int", {"draft_features": 1}, "draft_features must be true or false"),
]


@pytest.mark.parametrize("spec, needle", [c[1:] for c in SPECS], ids=[c[0] for c in SPECS])
def test_feature_spec_refuses(spec, needle):
    with pytest.raises(FeatureSpecError) as err:
        FeatureSpec.from_dict(spec, "policy p.zip: meta.feature_spec")
    _one_line(err, "policy p.zip: meta.feature_spec", needle)
    assert is_user_error(err.value)  # the command line reports it in one line, exit code 2


def test_feature_spec_accepts_what_it_writes():
    assert FeatureSpec.from_dict(None) == FeatureSpec() == FeatureSpec.from_dict({})
    spec = FeatureSpec(proj_dim=0, proj_seed=7, match_max=4, decay=0.0, draft_features=True)
    assert FeatureSpec.from_dict(json.loads(json.dumps(spec.as_dict()))) == spec
    assert FeatureSpec.from_dict({"decay": 0}).decay == 0.0  # a JSON integer is a number
    assert FeatureSpec(proj_dim=np.int64(4)).proj_dim == 4  # numpy integers are integers
    with pytest.raises(FeatureSpecError, match="proj_dim"):
        FeatureSpec(proj_dim=-1)


def test_policy_with_a_damaged_feature_spec_is_refused_by_the_cli(tmp_path, capsys):
    """``draftgym evaluate POLICY --no-live``: a policy whose ``meta.feature_spec`` asks for 1e9 projected
    features (which would build a billion feature names) is refused in one line."""
    import zipfile
    from pathlib import Path

    src = Path(__file__).resolve().parents[2] / "policies" / "data" / "linucb.zip"
    bad = tmp_path / "policy.zip"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(bad, "w") as zout:
        for name in zin.namelist():
            data = zin.read(name)
            if name == "header.json":
                header = json.loads(data)
                header["meta"]["feature_spec"]["proj_dim"] = 1e9
                data = json.dumps(header).encode()
            zout.writestr(name, data)
    _cli_refuses(["evaluate", str(bad), "--no-live", "--test-per-category", "1"], capsys, "proj_dim")


# ---- cost models ------------------------------------------------------------------------------------------------


def _set(path: str, value: Any) -> Callable[[dict], None]:
    """A corruption: the value at dotted ``path`` set to ``value`` (``DELETE``: removed)."""

    def apply(d: dict) -> None:
        *keys, last = path.split(".")
        for k in keys:
            d = d[k]
        if value is DELETE:
            del d[last]
        else:
            d[last] = value

    return apply


DELETE = object()

COSTS = [
    ("seconds-string", _set("verify.chain.seconds", [0.1, "0.11", 0.13]), "verify.chain.seconds[1] must be"),
    ("nodes-string", _set("verify.chain.nodes", ["1", 9, 17]), "verify.chain.nodes[0] must be an integer"),
    ("nodes-float", _set("verify.tree.nodes", [1, 17.5, 129]), "verify.tree.nodes[1] must be an integer"),
    ("nodes-zero", _set("verify.tree.nodes", [0, 17, 129]), "verify.tree.nodes[0] must be an integer in 1.."),
    ("nodes-bool", _set("verify.tree.nodes", [True, 17, 129]), "verify.tree.nodes[0]"),
    (
        "empty-curve",
        _set("verify.tree", {"nodes": [], "seconds": []}),
        "verify.tree.nodes must be a non-empty",
    ),
    ("length-mismatch", _set("verify.chain.seconds", [0.1, 0.2]), "verify.chain has 3 nodes but 2 seconds"),
    ("nodes-not-increasing", _set("verify.chain.nodes", [1, 17, 9]), "verify.chain.nodes must increase"),
    ("nodes-repeated", _set("verify.chain.nodes", [1, 9, 9]), "verify.chain.nodes must increase"),
    ("nodes-not-from-1", _set("verify.tree.nodes", [3, 9, 17]), "verify.tree.nodes must start at 1"),
    ("seconds-negative", _set("verify.chain.seconds", [-0.1, 0.11, 0.13]), "verify.chain.seconds[0] must be"),
    ("seconds-zero", _set("verify.chain.seconds", [0.0, 0.11, 0.13]), "verify.chain.seconds[0] must be"),
    ("seconds-nan", _set("verify.tree.seconds", [0.1, math.nan, 0.4]), "verify.tree.seconds[1] must be"),
    ("seconds-inf", _set("verify.tree.seconds", [0.1, 0.2, math.inf]), "verify.tree.seconds[2] must be"),
    (
        "seconds-falling-tail",
        _set("verify.tree.seconds", [0.1, 0.4, 0.2]),
        "verify.tree.seconds must not fall",
    ),
    ("curve-list", _set("verify.chain", [[1, 0.1]]), "verify.chain must be a JSON object"),
    ("curve-missing", _set("verify.tree", DELETE), "verify.tree is missing"),
    ("verify-missing", _set("verify", DELETE), "verify is missing"),
    ("verify-string", _set("verify", "fast"), "verify must be a JSON object"),
    ("per-context-nan", _set("verify.per_context", math.nan), "verify.per_context must be a finite number"),
    (
        "seconds-past-float32",  # finite as a float64, infinite in replay's float32 tables: every reward NaN
        _set("verify.chain.seconds", [1e300, 2e300, 3e300]),
        "verify.chain.seconds",
    ),
    ("per-context-string", _set("verify.per_context", "1e-5"), "verify.per_context must be"),
    ("per-node-negative", _set("verify.per_node_context", -1e-7), "verify.per_node_context must be"),
    ("context-ref-float", _set("verify.context_ref", 16.5), "verify.context_ref must be an integer"),
    ("context-ref-negative", _set("verify.context_ref", -1), "verify.context_ref must be an integer"),
    ("model-id-missing", _set("model_id", DELETE), "model_id is missing"),
    ("dtype-int", _set("dtype", 32), "dtype must be a non-empty string"),
    ("version", _set("version", 2), "version must be 1"),
    ("drafters-list", _set("drafters", ["ngram"]), "drafters must be a JSON object"),
    ("drafter-list", _set("drafters.ngram", [1e-4]), "drafters.ngram must be a JSON object"),
    ("drafter-no-shapes", _set("drafters.ngram.shapes", DELETE), "drafters.ngram.shapes is missing"),
    (
        "drafter-shapes-list",
        _set("drafters.ngram.shapes", [1e-4]),
        "drafters.ngram.shapes must be a JSON object",
    ),
    (
        "shape-cost-string",
        _set("drafters.ngram.shapes.ngram-d4", "fast"),
        "drafters.ngram.shapes.ngram-d4 must",
    ),
    (
        "shape-cost-nan",
        _set("drafters.ngram.shapes.ngram-d4", math.nan),
        "drafters.ngram.shapes.ngram-d4 must",
    ),
    ("base-missing", _set("drafters.ngram.base_s", DELETE), "drafters.ngram.base_s is missing"),
    (
        "per-node-negative-drafter",
        _set("drafters.ngram.per_node_s", -1.0),
        "drafters.ngram.per_node_s must be",
    ),
    ("options-list", _set("drafters.ngram.options", []), "drafters.ngram.options must be a JSON object"),
    ("drafter-name-newline", _set("drafters", {"a\nb": 3}), "drafters.a b must be a JSON object"),
    ("meta-list", _set("meta", []), "meta must be a JSON object"),
]


def _cost_json() -> dict:
    d = toy_cost_model().to_json()
    d["drafters"]["ngram"]["shapes"] = {"ngram-d4": 2e-4}
    d["drafters"]["ngram"]["options"] = {}
    return d


@pytest.mark.parametrize(
    "text, needle",
    [("[" * 100_000 + "]" * 100_000, "RecursionError"), ('{"format": ' + "1" * 5000 + "}", "is not JSON")],
    ids=["nested", "long-integer"],
)
def test_cost_model_that_json_cannot_read(text, needle, tmp_path):
    path = tmp_path / "cm.json"
    path.write_text(text)
    with pytest.raises(CostModelError) as err:
        load_cost_model(path)
    _one_line(err, str(path), "is not JSON", needle)


@pytest.mark.parametrize("corrupt, needle", [c[1:] for c in COSTS], ids=[c[0] for c in COSTS])
def test_cost_model_refuses(corrupt, needle, tmp_path):
    d = _cost_json()
    corrupt(d)
    path = tmp_path / "cm.json"
    path.write_text(json.dumps(d))  # NaN and Infinity written as JSON's extensions, which json reads back
    with pytest.raises(CostModelError) as err:
        load_cost_model(path)
    _one_line(err, str(path), needle)


def test_cost_model_round_trips_and_the_shipped_one_loads(tmp_path):
    path = tmp_path / "cm.json"
    path.write_text(json.dumps(_cost_json()))
    cm = load_cost_model(path)
    assert cm.drafters["ngram"]["shapes"] == {"ngram-d4": 2e-4} and cm.context_ref == 16
    assert load_cost_model(cm.save(tmp_path / "again.json")) == cm
    assert load_cost_model().chain.nodes[0] == 1


@pytest.mark.parametrize("case", ["seconds-nan", "drafter-no-shapes"])
def test_cli_refuses_a_damaged_cost_model(case, tmp_path, capsys):
    corrupt, needle = next(c[1:] for c in COSTS if c[0] == case)
    d = load_cost_model().to_json()  # the shipped model, so that it prices the default menu
    if case == "seconds-nan":
        d["verify"]["tree"]["seconds"][1] = math.nan
    else:
        corrupt(d)
    path = tmp_path / "cm.json"
    path.write_text(json.dumps(d))
    _cli_refuses(["oracle-gap", "--cost-model", str(path)], capsys, str(path), needle.split(" must")[0])


# ---- traces ---------------------------------------------------------------------------------------------------


def _header(**changes: Any) -> Callable[[dict, dict], None]:
    """A corruption of the header: each dotted key (``__`` for ``.``) set to its value (``DELETE``: removed)."""

    def apply(h: dict, a: dict) -> None:
        for key, value in changes.items():
            _set(key.replace("__", "."), value)(h)

    return apply


def _array(name: str, fn: Callable[[np.ndarray], np.ndarray]) -> Callable[[dict, dict], None]:
    def apply(h: dict, a: dict) -> None:
        a[name] = fn(a[name])

    return apply


def _feat_nan(f: np.ndarray) -> np.ndarray:
    f = f.copy()
    f[3, 2] = np.nan
    return f


def _at(value: Any, index: int = 5) -> Callable[[np.ndarray], np.ndarray]:
    def fn(x: np.ndarray) -> np.ndarray:
        x = x.astype(np.int64 if isinstance(value, int) else x.dtype)
        x[index] = value
        return x

    return fn


def _deep_header(h: dict, a: dict) -> None:
    a["header"] = np.array("[" * 100_000 + "]" * 100_000)


TRACES = [
    ("model-string", _header(model="toy"), "header model must be a JSON object"),
    ("model-no-vocab", _header(model__vocab_size=DELETE), "header model.vocab_size is missing"),
    ("vocab-string", _header(model__vocab_size="64"), "header model.vocab_size must be an integer"),
    ("eos-out-of-vocab", _header(model__eos_ids=[64]), "header model.eos_ids must be token ids in 0..63"),
    ("eos-int", _header(model__eos_ids=2), "header model.eos_ids must be a JSON list"),
    ("drafters-int", _header(drafters=3), "header drafters must be a JSON object"),
    ("drafter-shape", _header(drafters__ngram__shape=[16, 0, 0]), "header drafters.ngram.shape must be"),
    ("drafter-shape-short", _header(drafters__ngram__shape=[16]), "header drafters.ngram.shape must be"),
    (
        "drafter-name-newline",
        _header(drafters={"a\nb": {"exact": True, "shape": [1, 1, 0]}}),
        "drafter 'a\\nb'",
    ),
    ("drafter-exact", _header(drafters__ngram__exact="yes"), "header drafters.ngram.exact must be true"),
    ("no-features", _header(features=DELETE), "header features is missing"),
    ("no-prompts", _header(prompts=DELETE), "header prompts is missing"),
    ("no-max-new", _header(max_new_tokens=DELETE), "header max_new_tokens is missing"),
    ("max-new-string", _header(max_new_tokens="40"), "header max_new_tokens must be an integer"),
    ("max-new-negative", _header(max_new_tokens=-5), "header max_new_tokens must be an integer in 2.."),
    ("max-new-bool", _header(max_new_tokens=True), "header max_new_tokens must be an integer"),
    ("max-new-short", _header(max_new_tokens=3), "past max_new_tokens 3"),
    ("spec-string", _header(features__spec="default"), "header features.spec must be a JSON object"),
    ("spec-unknown-key", _header(features__spec={"proj_dims": 8}), "features.spec has unknown key(s)"),
    ("spec-proj-dim-huge", _header(features__spec={"proj_dim": 1e9}), "features.spec: proj_dim must be"),
    ("names-mismatch", _header(features__names=["entropy"]), "header features.names do not match"),
    ("prompt-ids-int", _header(prompts__ids=5), "header prompts.ids must be a JSON list"),
    ("prompt-ids-repeat", _header(prompts__ids=["p"] * 5), "header prompts.ids repeat a prompt id"),
    ("prompt-ids-short", _header(prompts__ids=["p0", "p1"]), "header prompts.ids name 2 prompts"),
    ("categories-ints", _header(prompts__categories=[1, 2, 3, 4, 5]), "prompts.categories must be"),
    ("header-nested", _deep_header, "not a readable trace"),
    ("feat-1d", _array("feat", lambda f: f[:, 0]), "feat must be a 2-D float array"),
    ("feat-strings", _array("feat", lambda f: f.astype(str)), "feat must be a 2-D float array"),
    ("feat-ints", _array("feat", lambda f: f.astype(np.int64)), "feat must be a 2-D float array"),
    (
        "feat-fewer-columns",
        _array("feat", lambda f: f[:, :-2]),
        "feat has 10 columns, the feature spec names 12",
    ),
    ("feat-nan", _array("feat", _feat_nan), "feat holds a value that is not finite"),
    ("feat-out-of-bounds", _array("feat", lambda f: f * 3), "feat holds a value out of its bounds"),
    ("feat-short", _array("feat", lambda f: f[:-1]), "feature counts differ"),
    ("traj-2d", _array("traj", lambda t: np.stack([t, t])), "traj must be a 1-D signed integer array"),
    (
        "traj-floats",
        _array("traj", lambda t: t.astype(np.float32)),
        "traj must be a 1-D signed integer array",
    ),
    ("traj-token-huge", _array("traj", _at(10**9)), "traj holds a token id outside the vocabulary [0, 64)"),
    ("prompt-token-negative", _array("prompt_tokens", _at(-1)), "prompt_tokens holds a token id outside"),
    (
        "prompt-empty",
        _array("prompt_off", lambda o: np.concatenate([o[:1], np.zeros(1, o.dtype), o[2:]])),
        "prompt_off holds an empty prompt",
    ),
    (
        "traj-off-floats",
        _array("traj_off", lambda o: o.astype(np.float64)),
        "traj_off must be a 1-D signed integer",
    ),
    (
        "prompt-off-2d",
        _array("prompt_off", lambda o: o[None]),
        "prompt_off must be a 1-D signed integer array",
    ),
    (
        "tree-off-floats",
        _array("tree/ngram/off", lambda o: o + 0.0),
        "tree/ngram/off must be a 1-D signed integer",
    ),
    ("tree-token-huge", _array("tree/ngram/tokens", _at(10**6, 0)), "invalid tree/ngram: a token id"),
    ("no-prompt", _array("traj_off", lambda o: o[:1]), "traj_off holds no prompt"),
    (
        "tree-off-unsigned-swapped",  # uint64 differences wrap around: "offsets only grow" must still hold
        _array("tree/ngram/off", lambda o: np.concatenate([o[:1], o[2:3], o[1:2], o[3:]]).astype(np.uint64)),
        "tree/ngram/off must be a 1-D signed integer",
    ),
]


@pytest.fixture(scope="module")
def trace_arrays(tmp_path_factory) -> dict[str, Any]:
    path = make_trace().save(tmp_path_factory.mktemp("trace") / "good.npz")
    load_trace(path)  # the valid file loads
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def _damaged(arrays: dict[str, Any], corrupt, path) -> Any:
    a = dict(arrays)
    h = json.loads(str(a["header"]))
    a["header"] = None
    corrupt(h, a)
    if a["header"] is None:
        a["header"] = np.array(json.dumps(h))
    np.savez(path, **a)
    return path


@pytest.mark.parametrize("corrupt, needle", [c[1:] for c in TRACES], ids=[c[0] for c in TRACES])
def test_trace_refuses(corrupt, needle, trace_arrays, tmp_path):
    path = _damaged(trace_arrays, corrupt, tmp_path / "bad.npz")
    with pytest.raises(TraceError) as err:
        load_trace(path)
    _one_line(err, str(path), needle)


@pytest.mark.parametrize("case", ["model-string", "feat-1d", "spec-unknown-key"])
def test_cli_refuses_a_damaged_trace(case, trace_arrays, tmp_path, capsys):
    corrupt, needle = next(c[1:] for c in TRACES if c[0] == case)
    path = _damaged(trace_arrays, corrupt, tmp_path / "bad.npz")
    _cli_refuses(["oracle-gap", "--trace", str(path)], capsys, str(path), needle)
