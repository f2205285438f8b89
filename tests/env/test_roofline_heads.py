"""A roofline model prices a model head's drafting on the accelerator (``env.roofline.RooflineCost.draft_s``): per
level of the chain, a share of a step's overhead plus reading the head's weights — one decoder layer of the target's
shape, its input projections and an LM head over the draft vocabulary (EAGLE-3's for an 8B Llama: 32,000) — so a
deeper chain costs more and a head is neither free nor a second target; a host-side drafter stays seconds per row."""

from __future__ import annotations

import json

import numpy as np
import pytest

from env.batch_cost import load_batch_cost, step_s
from env.roofline import MODELS, roofline


def test_a_head_level_reads_one_layer_its_projections_and_its_lm_head():
    r = roofline("h200", "llama-3.1-8b")
    s = MODELS["llama-3.1-8b"]
    layer = (s["params"] - s["embed_params"] - s["vocab"] * s["hidden"]) / s["layers"]  # ~218M
    assert 2.0e8 < layer < 2.3e8
    assert (
        r.head_params("eagle3") == r.head_params("eagle") == pytest.approx(layer + 2 * 4096**2 + 32000 * 4096)
    )
    assert r.head_params("hybrid") == r.head_params("eagle3")  # the hybrid drafts with the eagle3 head
    assert r.head_params("early_exit") == pytest.approx(
        5 * layer + 32000 * 4096
    )  # 4 of 32 layers + the adapter
    assert r.head_params("ngram") == r.head_params("suffix") == 0.0


def test_a_deeper_chain_of_a_head_costs_more_a_host_drafter_does_not():
    r = roofline("h200", "llama-3.1-8b")
    d = {k: np.array([float(r.draft_s("eagle3", rows, k)) for rows in (1, 4, 16)]) for k in (1, 2, 5)}
    assert (d[2] > d[1]).all() and np.allclose(d[5] - d[1], 4 * (d[2] - d[1]))  # linear in the depth
    fwd = float(r.forward_s(1, 1, 512))
    # one level at one row: a share of the step (overhead and ~0.87 GB of 16 GB read), not free, not a forward
    assert 0.05 * fwd < float(r.draft_s("eagle3", 1, 1)) < 0.3 * fwd
    assert float(r.draft_s("early_exit", 1, 1)) > float(r.draft_s("eagle3", 1, 1))
    host = [float(r.draft_s("ngram", rows, k)) for rows in (1, 16) for k in (1, 8)]
    assert host == pytest.approx([3e-5, 3e-5, 48e-5, 48e-5])
    assert float(r.draft_s("eagle3", 0, 3)) == 0.0 and float(r.draft_s(None, 4, 3)) == 0.0
    # vectorized as the serving simulator calls it: rows and depths per server
    rows, depth = np.array([0, 1, 16]), np.array([0, 3, 5])
    v = r.draft_s("eagle3", rows, depth)
    assert v.tolist() == pytest.approx(
        [0.0, float(r.draft_s("eagle3", 1, 3)), float(r.draft_s("eagle3", 16, 5))]
    )
    # a step with a head chain at one row: the forward of 1 x 6 nodes plus five head levels
    t = float(step_s(r, 1, 6, 512, {"eagle3": 1}, {"eagle3": 5}))
    assert t == pytest.approx(float(r.forward_s(1, 6, 512)) + float(r.draft_s("eagle3", 1, 5)))


def test_a_roofline_file_from_before_the_head_figures_loads_with_their_defaults(tmp_path):
    d = roofline("h200", "llama-3.1-8b").to_json()
    for k in ("draft_vocab", "head_overhead_frac"):
        d.pop(k)
    for k in ("vocab", "hidden"):
        d["shape"].pop(k)
    path = tmp_path / "old.json"
    path.write_text(json.dumps(d))
    old = load_batch_cost(path)
    assert old.draft_vocab == 32000 and old.head_overhead_frac == 0.25 and isinstance(old.draft_vocab, int)
    # no vocabulary: the LM head is not taken out of the layers' share; no hidden size: the query heads' width
    assert old.head_params("eagle3") > roofline("h200", "llama-3.1-8b").head_params("eagle3")
    assert np.isfinite(old.draft_s("eagle3", 4, 3)) and old.draft_s("eagle3", 4, 3) > 0


def test_the_head_figures_are_the_files_own():
    from env.roofline import RooflineCost

    d = roofline("h200", "llama-3.1-8b").to_json()
    d["draft_vocab"], d["head_overhead_frac"] = 128256, 0.0
    r, base = RooflineCost.from_json(d), roofline("h200", "llama-3.1-8b")
    assert r.head_params("eagle3") - base.head_params("eagle3") == pytest.approx((128256 - 32000) * 4096)
    p, bw = r.head_params("eagle3"), 4.8e12 * r.bw_efficiency  # no overhead: one level reads the weights
    fuse = 3 * 4096**2  # EAGLE-3's fusion of three streams: once a step
    assert float(r.draft_s("eagle3", 1, 1)) == pytest.approx(2 * (p + fuse) / bw)  # a head has no host side
    assert float(r.draft_s("eagle", 1, 1)) == pytest.approx(2 * p / bw)
    # the hybrid: the eagle3 head's levels plus its suffix part on the host, per row
    assert float(r.draft_s("hybrid", 4, 2)) == pytest.approx(float(r.draft_s("eagle3", 4, 2)) + 4 * 5e-5)


@pytest.mark.parametrize(
    "change, says",
    [({"vocab": 1e7}, "shape.vocab x the hidden size"),
     ({"hidden": None, "heads": 1024, "head_dim": 4096}, "the hidden size"),],
)  # fmt: skip
def test_head_figures_that_contradict_the_model_are_refused_in_one_line(change, says):
    from env.cost import CostModelError
    from env.roofline import RooflineCost

    d = roofline("h200", "llama-3.1-8b").to_json()
    for k, v in change.items():
        if v is None:
            d["shape"].pop(k)
        else:
            d["shape"][k] = v
    with pytest.raises(CostModelError, match=says) as err:
        RooflineCost.from_json(d, "rl.json")
    assert "\n" not in str(err.value)
