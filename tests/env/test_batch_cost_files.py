"""Damaged and hostile batch cost model files (``env.batch_cost.load_batch_cost``): a fitted or roofline file
damaged one field at a time, files of another kind, a missing file or a folder: each a one-line
``CostModelError`` naming the file, and no pickle is ever loaded."""

from __future__ import annotations

import json
import pickle

import pytest

from env.batch_cost import load_batch_cost
from env.cost import CostModelError
from env.roofline import roofline
from tests.env.batch_cost_cases import fitted
from tests.hostile import Creates


def _good() -> dict:
    return fitted().to_json()


def _set(path: tuple, value):
    def edit(d):
        node = d
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value

    return edit


def _drop(key: str):
    return lambda d: d.pop(key)


BAD_FITTED = {
    "nan-base": _set(("base_s",), [[float("nan"), 0.01, 0.02], [0.01, 0.02, 0.03], [0.02, 0.03, 0.04]]),
    "negative-base": _set(("base_s", 1), [-0.01, 0.02, 0.03]),
    "zero-base": _set(("base_s", 0), [0.0, 0.02, 0.03]),
    "inf-slope": _set(("slope_s_per_token", 2), [0.0, 0.0, float("inf")]),
    "nan-drafter": _set(("drafters_s_per_row",), {"ngram": float("nan")}),
    "zero-prefill": _set(("prefill", "seconds"), [0.0, 0.03, 0.1]),
    # numbers past any machine (trained on, every policy scored 0 tok/s), and numbers written as text
    "huge-base": _set(("base_s",), [[1e300] * 3] * 3),
    "huge-slope": _set(("slope_s_per_token",), [[1e300] * 3] * 3),
    "huge-prefill": _set(("prefill", "seconds"), [1e300, 1e300, 1e300]),
    "huge-drafter": _set(("drafters_s_per_row",), {"ngram": 1e300}),
    "text-base": _set(("base_s", 0), ["0.01", 0.02, 0.03]),
    "text-drafter-seconds": _set(("drafters_s_per_row",), {"ngram": "1e-4"}),
    "negative-prefill-tokens": _set(("prefill", "tokens", 0), -16),
    "fractional-prefill-tokens": _set(("prefill", "tokens", 0), 16.5),
    "unsorted-prefill": _set(("prefill", "tokens"), [64, 16, 256]),
    "empty-prefill": _set(("prefill",), {"tokens": [], "seconds": []}),
    "grid-too-small": _set(("base_s",), [[0.01, 0.02], [0.02, 0.03]]),
    "grid-transposed": _set(("slope_s_per_token",), [[0.0] * 3] * 2),
    "ragged-grid": _set(("base_s",), [[0.01, 0.02, 0.03], [0.01], [0.01, 0.02, 0.03]]),
    "flat-grid": _set(("base_s",), [0.01] * 9),
    "unsorted-rows": _set(("rows",), [1, 4, 2]),
    "repeated-nodes": _set(("nodes",), [1, 3, 3]),
    "zero-rows": _set(("rows",), [0, 2, 4]),
    "text-in-grid": _set(("base_s", 0), ["fast", 0.02, 0.03]),
    "text-drafter": _set(("drafters_s_per_row",), {"ngram": "quick"}),
    "list-drafters": _set(("drafters_s_per_row",), [1, 2, 3]),
    "prefill-not-a-table": _set(("prefill",), 7),
    "rows-not-a-list": _set(("rows",), 3),
    "padded-context-not-a-bool": _set(("padded_context",), "yes"),
    "empty-grid": lambda d: d.update(rows=[], nodes=[], base_s=[], slope_s_per_token=[]),
    "falling-last-row": _set(("base_s", -1), [1e-7] * 3),  # a bigger batch cheaper: extrapolates to nothing
    "falling-prefill": lambda d: d["prefill"].update(seconds=sorted(d["prefill"]["seconds"], reverse=True)),
    "policy-book-not-an-object": _set(("policy_book",), [1e-4, 2e-4]),
    "policy-book-extra-key": _set(("policy_book",), {"rows": [1], "seconds": [1e-4], "run": "x"}),
    "policy-book-ragged": _set(("policy_book",), {"rows": [1, 4], "seconds": [1e-4]}),
    "policy-book-empty": _set(("policy_book",), {"rows": [], "seconds": []}),
    "policy-book-unsorted-rows": _set(("policy_book",), {"rows": [4, 1], "seconds": [1e-4, 2e-4]}),
    "policy-book-bool-rows": _set(("policy_book",), {"rows": [True, 4], "seconds": [1e-4, 2e-4]}),
    "policy-book-falling": _set(("policy_book",), {"rows": [1, 4], "seconds": [2e-4, 1e-4]}),
    "policy-book-negative": _set(("policy_book",), {"rows": [1, 4], "seconds": [-1e-4, 1e-4]}),
    "policy-book-nan": _set(("policy_book",), {"rows": [1, 4], "seconds": [float("nan"), 1e-4]}),
    "policy-book-a-second-and-more": _set(("policy_book",), {"rows": [1, 4], "seconds": [1e-4, 5.0]}),
    "policy-book-text": _set(("policy_book",), {"rows": [1, 4], "seconds": [1e-4, "slow"]}),
    # the parts of the meta that are read back (a label, a check of the drafters' options), and the grid's axes
    "meta-not-an-object": _set(("meta",), [1]),
    "meta-machine-text": _set(("meta",), {"machine": "x"}),
    "meta-machine-cpu-number": _set(("meta",), {"machine": {"cpu_label": 7}}),
    "meta-drafter-options-text": _set(("meta",), {"drafter_options": "x"}),
    "meta-drafter-options-of-lists": _set(("meta",), {"drafter_options": {"ngram": [1]}}),
    "context-ref-zero": _set(("context_ref",), 0),
    "context-ref-negative": _set(("context_ref",), -128),
    "context-ref-bool": _set(("context_ref",), True),
    "context-ref-huge": _set(("context_ref",), 1e300),
    "rows-float": _set(("rows",), [1, 2.7, 4]),
    "rows-bool": _set(("rows",), [True, 2, 4]),
    "rows-huge-float": _set(("rows",), [1, 2, 1e30]),
    "nodes-too-many": _set(("nodes",), [1, 2, 10**9]),
    "dtype-unknown": _set(("dtype",), "float8"),
    "weights-object": _set(("weights",), {}),
    "version-2": _set(("version",), 2),
    "version-text": _set(("version",), "1"),
    **{
        f"missing-{k}": _drop(k)
        for k in (
            "rows",
            "nodes",
            "base_s",
            "slope_s_per_token",
            "prefill",
            "context_ref",
            "model_id",
            "dtype",
        )
    },  # fmt: skip
}


# what the message says, for the cases whose check names the field
SAYS = {
    "meta-not-an-object": "meta must be an object",
    "meta-machine-text": "meta.machine must be an object",
    "meta-machine-cpu-number": "meta.machine must be an object",
    "meta-drafter-options-text": "meta.drafter_options must map",
    "meta-drafter-options-of-lists": "meta.drafter_options must map",
    **{k: "context_ref must be a positive integer" for k in ("context-ref-zero", "context-ref-negative",
                                                             "context-ref-bool", "context-ref-huge")},
    **{k: "rows must be a list of integers" for k in ("rows-float", "rows-bool", "rows-huge-float")},
    "nodes-too-many": "nodes must be a list of integers",
    "dtype-unknown": "dtype must be one of",
    "weights-object": "weights must be one of",
    "version-2": "version 2 is not one this draftgym reads",
    "version-text": "version '1' is not one this draftgym reads",
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD_FITTED))
def test_a_malformed_fitted_file_is_refused_naming_it(case, tmp_path):
    d = _good()
    BAD_FITTED[case](d)
    path = tmp_path / f"{case}.json"
    path.write_text(json.dumps(d))  # NaN and Infinity are written as the JSON extensions Python reads
    with pytest.raises(CostModelError) as err:
        load_batch_cost(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)
    assert SAYS.get(case, "") in str(err.value), str(err.value)


def _rl() -> dict:
    return roofline("h200", "llama-3.1-8b").to_json()


BAD_ROOFLINE = {
    "missing-acc": lambda d: d.pop("acc"),
    "missing-shape": lambda d: d.pop("shape"),
    "missing-bytes": lambda d: d["acc"].pop("bytes_s"),
    "missing-layers": lambda d: d["shape"].pop("layers"),
    "nan-flops": _set(("acc", "flops"), float("nan")),
    "zero-bandwidth": _set(("acc", "bytes_s"), 0.0),
    "negative-overhead": _set(("acc", "overhead_s"), -1e-3),
    "inf-params": _set(("shape", "params"), float("inf")),
    "text-heads": _set(("shape", "heads"), "many"),
    "acc-not-a-table": _set(("acc",), [1, 2]),
    "nan-draft-cost": _set(("draft_per_row_s",), {"ngram": float("nan")}),
    "negative-draft-cost": _set(("draft_per_row_s",), {"ngram": -1.0}),
    "zero-params": _set(("shape", "params"), 0.0),
    "version-99": _set(("version",), 99),
}


@pytest.mark.parametrize("case", sorted(BAD_ROOFLINE))
def test_a_malformed_roofline_file_is_refused_naming_it(case, tmp_path):
    d = _rl()
    BAD_ROOFLINE[case](d)
    path = tmp_path / f"{case}.json"
    path.write_text(json.dumps(d))
    with pytest.raises(CostModelError) as err:
        load_batch_cost(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "kind", ["empty", "garbage", "truncated", "pickle", "a-list", "other-format", "no-format"]
)
def test_files_that_are_no_batch_cost_model_are_refused(kind, tmp_path):
    marker = tmp_path / "RAN"
    good = json.dumps(_good()).encode()
    data = {
        "empty": b"",
        "garbage": b"\x00\xffthis is no file format\x81",
        "truncated": good[: len(good) // 3],
        "pickle": pickle.dumps({"base_s": Creates(marker)}),
        "a-list": b"[1, 2, 3]",
        "other-format": json.dumps({**_good(), "format": "draftgym-cost-model"}).encode(),
        "no-format": json.dumps({k: v for k, v in _good().items() if k != "format"}).encode(),
    }[kind]
    path = tmp_path / "bc.json"
    path.write_bytes(data)
    with pytest.raises(CostModelError) as err:
        load_batch_cost(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)
    assert not marker.exists()


def test_a_missing_file_or_a_folder_is_refused(tmp_path):
    for path in (tmp_path / "nope.json", tmp_path):
        with pytest.raises(
            CostModelError, match="(does not exist|is a directory, not a file).*roofline:"
        ) as err:
            load_batch_cost(path)
        assert str(path) in str(err.value)


@pytest.mark.parametrize("field", ["context_ref", "rows"])
def test_infinity_in_an_integer_field_is_refused(field, tmp_path):
    d = _good()
    d[field] = float("inf") if field == "context_ref" else [1, 2, float("inf")]
    path = tmp_path / "bc.json"
    path.write_text(json.dumps(d))
    with pytest.raises(CostModelError, match=f"bc.json is malformed .*{field} must be .*integer"):
        load_batch_cost(path)


def test_prefill_tables_of_different_lengths_are_refused(tmp_path):
    d = _good()
    d["prefill"]["seconds"] = [0.01]
    path = tmp_path / "bc.json"
    path.write_text(json.dumps(d))
    with pytest.raises(CostModelError, match="prefill tokens must be increasing, one time for each"):
        load_batch_cost(path).prefill_s(40)


def test_a_negative_drafter_time_is_refused(tmp_path):
    d = _good()
    d["drafters_s_per_row"] = {"ngram": -1.0}
    path = tmp_path / "bc.json"
    path.write_text(json.dumps(d))
    with pytest.raises(CostModelError, match="costs must be finite and positive"):
        load_batch_cost(path)


def test_a_zero_efficiency_roofline_is_refused(tmp_path):
    d = _rl()
    d["bw_efficiency"] = 0.0
    path = tmp_path / "rl.json"
    path.write_text(json.dumps(d))
    with pytest.raises(
        CostModelError, match=r"rl.json: bw_efficiency must be a number in \[0.01, 1\], got 0.0"
    ):
        load_batch_cost(path)
