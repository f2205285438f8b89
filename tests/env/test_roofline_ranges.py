"""A roofline batch cost file (``env.roofline.RooflineCost.from_json``) holds each figure within its physical range
(``ROOFLINE_RANGES``): a finite, positive but extreme one (a bandwidth of 5e-324 bytes/s, a model of 1e308 layers)
priced steps of 0 or infinite seconds, and the serving env then divided by a unit rate that underflowed to 0. Each is
refused in one line naming the field; every model within the ranges prices finite, positive steps."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from env.batch_cost import load_batch_cost, step_s
from env.cost import CostModelError
from env.roofline import ACCELERATORS, MODELS, RooflineCost, roofline


def _rl() -> dict:
    return roofline("h200", "llama-3.1-8b").to_json()


EXTREME = {  # case: (changes, the field named)
    "bandwidth-5e-324": ({("acc", "bytes_s"): 5e-324}, "acc.bytes_s"),
    "flops-5e-324": ({("acc", "flops"): 5e-324}, "acc.flops"),
    "bandwidth-1e308": ({("acc", "bytes_s"): 1e308}, "acc.bytes_s"),
    "flops-1e308": ({("acc", "flops"): 1e308}, "acc.flops"),
    "overhead-1e308": ({("acc", "overhead_s"): 1e308}, "acc.overhead_s"),
    "params-1e308": ({("shape", "params"): 1e308}, "shape.params"),
    "params-half": ({("shape", "params"): 0.5, ("shape", "embed_params"): 0.0}, "shape.params"),
    "layers-1e308": ({("shape", "layers"): 1e308}, "shape.layers"),
    "layers-fraction": ({("shape", "layers"): 2.5}, "shape.layers"),
    "head-dim-1e308": ({("shape", "head_dim"): 1e308}, "shape.head_dim"),
    "bw-efficiency-tiny": ({("bw_efficiency",): 1e-300}, "bw_efficiency"),
    "flop-efficiency-tiny": ({("flop_efficiency",): 5e-324}, "flop_efficiency"),
    "draft-1e308": ({("draft_per_row_s",): {"ngram": 1e308}}, "draft_per_row_s.ngram"),
    "embed-nan": ({("shape", "embed_params"): float("nan")}, "shape.embed_params"),
    "draft-vocab-fraction": ({("draft_vocab",): 2047.5}, "draft_vocab"),
    "draft-vocab-zero": ({("draft_vocab",): 0}, "draft_vocab"),
    "head-overhead-negative": ({("head_overhead_frac",): -0.1}, "head_overhead_frac"),
    "head-overhead-nan": ({("head_overhead_frac",): float("nan")}, "head_overhead_frac"),
    "vocab-1e308": ({("shape", "vocab"): 1e308}, "shape.vocab"),
    "hidden-fraction": ({("shape", "hidden"): 4095.5}, "shape.hidden"),
    "draft-vocab-list": ({("draft_vocab",): [32000]}, "draft_vocab"),
    "draft-vocab-true": ({("draft_vocab",): True}, "draft_vocab"),
    "head-overhead-string": ({("head_overhead_frac",): "0.25"}, "head_overhead_frac"),
    "head-overhead-null": ({("head_overhead_frac",): None}, "head_overhead_frac"),
    "vocab-huge-int": ({("shape", "vocab"): 10**400}, "shape.vocab"),
    "bytes-string": ({("acc", "bytes_s"): "fast"}, "acc.bytes_s"),
    "draft-row-list": ({("draft_per_row_s",): {"ngram": [1]}}, "draft_per_row_s.ngram"),
}


@pytest.mark.parametrize("case", sorted(EXTREME))
def test_an_extreme_roofline_figure_is_refused_naming_it(case, tmp_path):
    d = _rl()
    changes, field = EXTREME[case]
    for path, value in changes.items():
        *up, last = path
        target = d
        for key in up:
            target = target[key]
        target[last] = value
    path = tmp_path / "rl.json"
    path.write_text(json.dumps(d))
    with pytest.raises(CostModelError, match=rf"rl.json: {field} must be") as err:
        load_batch_cost(path)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("acc", sorted(ACCELERATORS))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_preset_loads_from_its_file(acc, model, tmp_path):
    path = tmp_path / "rl.json"
    path.write_text(json.dumps(roofline(acc, model).to_json()))
    assert load_batch_cost(path).to_json() == roofline(acc, model).to_json()


def test_every_model_within_the_ranges_prices_finite_positive_steps():
    """The ranges' corners (slowest machine with the largest model, fastest with the smallest): every step,
    prefill and the serving env's unit rate finite and positive."""
    from env.roofline import ROOFLINE_RANGES

    names = ["acc.bytes_s", "acc.flops", "shape.params", "shape.layers", "shape.heads", "shape.kv_heads",
             "shape.head_dim", "bw_efficiency", "flop_efficiency"]  # fmt: skip
    rows, nodes, ctx = np.array([1, 256])[:, None, None], np.array([1, 64])[None, :, None], np.array([0, 1e6])
    for corner in itertools.product((0, 1), repeat=len(names)):
        d = _rl()
        d["shape"]["embed_params"], d["shape"]["vocab"] = 0.0, 1  # (an LM head within the smallest model)
        for name, end in zip(names, corner, strict=True):
            v = ROOFLINE_RANGES[name][end]
            if "." in name:
                d[name.split(".")[0]][name.split(".")[1]] = v
            else:
                d[name] = v
        c = RooflineCost.from_json(d)
        t = step_s(c, rows, nodes, ctx, {"ngram": rows})
        pre = c.prefill_s(np.array([1, 1 << 17]))
        unit_rate = 1.0 / (127 * float(c.forward_s(1, 1, 200)) + float(c.prefill_s(100)))
        assert np.isfinite(t).all() and (t > 0).all() and np.isfinite(pre).all() and (pre > 0).all(), corner
        assert np.isfinite(unit_rate) and unit_rate > 0, corner
        head = c.draft_s("early_exit", rows, 8)  # the largest head, the deepest chain
        assert np.isfinite(head).all() and (head > 0).all(), corner
