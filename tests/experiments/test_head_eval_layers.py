"""``python -m experiments.head_eval`` scores an eagle3 head on the residual streams it fuses (``cfg.fuse_layers``):
data that captured other layers is refused in one line naming both sets -- it was scored on whatever the data held
(wrong numbers when the count matched, a traceback when it did not) -- and data that captured more layers is scored
on the head's own."""

from __future__ import annotations

import json

import pytest

from tests.drafters.tiny import random_head, tiny_loaded


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from drafters.train_data import generate_data

    loaded = tiny_loaded()
    root = tmp_path_factory.mktemp("head_eval")
    head = random_head("eagle3", loaded, root / "eagle3-tiny")
    prompts = [(f"p{i:02d}", [3 + i, 7, 9, 11 + i, 3, 40 + i]) for i in range(10)]
    data = {}
    for layers in ((1, 2), (1, 2, 3), (1, 3), (1,)):
        name = "l" + "_".join(map(str, layers))
        generate_data(loaded.model, prompts, root / name, max_new_tokens=6, batch_size=5, capture_layers=layers,
                      window=32, pad_id=0, progress=False, model_id=loaded.model_id)  # fmt: skip
        data[layers] = root / name
    return loaded, head, data


def run(monkeypatch, loaded, head, folder, out=None):
    import env.model
    from experiments.head_eval import main

    monkeypatch.setattr(env.model, "load_model", lambda *a, **k: loaded)
    args = [
        "--data",
        str(folder),
        "--heads",
        "eagle3",
        "--weights",
        str(head),
        "--levels",
        "2",
        "--window",
        "32",
    ]
    return main(args + (["--json", str(out)] if out else []))


@pytest.mark.parametrize("layers", [(1, 3), (1,)])
def test_data_of_other_layers_is_refused_in_one_line(setup, layers, monkeypatch, capsys):
    loaded, head, data = setup
    from drafters.heads import load_head

    assert load_head(head, "eagle3", loaded.model, loaded.model_id)[0].fuse_layers == (1, 2)
    code = run(monkeypatch, loaded, head, data[layers])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    last = err.splitlines()[-1]  # after the progress line "held-out sequences: ..."
    assert last.startswith("python -m experiments.head_eval: error: ") and err.count(" error: ") == 1, err
    assert "[1, 2]" in last and str(list(layers)) in last, err


def test_data_with_more_layers_is_scored_on_the_fused_ones(setup, monkeypatch, capsys, tmp_path):
    loaded, head, data = setup
    rows = []
    for layers in ((1, 2), (1, 2, 3)):
        out = tmp_path / f"{len(layers)}.json"
        assert run(monkeypatch, loaded, head, data[layers], out) == 0, capsys.readouterr().err
        rows.append(json.loads(out.read_text())[0])
    assert rows[0]["positions"] > 0
    assert rows[0] == rows[1]


@pytest.mark.parametrize("training", [["heldout_ids"], "x", 3])
def test_a_head_description_whose_training_is_not_an_object_records_no_held_out_prompts(tmp_path, training):
    """``"training": [...]`` in a head's JSON was read with ``.get``: an AttributeError traceback."""
    from experiments.head_eval import _heldout_ids

    head = tmp_path / "h.safetensors"
    head.with_suffix(".json").write_text(json.dumps({"training": training}))
    assert _heldout_ids(head) is None
    head.with_suffix(".json").write_text(json.dumps({"training": {"heldout_ids": ["a", "b"]}}))
    assert _heldout_ids(head) == {"a", "b"}
