"""A distillation work folder (``drafters.train_data``): its parts are tied to the target that made them (a model
with the same tokenizer, shapes and dtype is another target), and the CPU time spent is on disk as each part is
written, so that a kill mid-run loses only the part it interrupted."""

from __future__ import annotations

import json

import pytest

from drafters.base import DrafterError
from drafters.train_data import generate_data, prefill_data
from tests.drafters.tiny import tiny_loaded

PROMPTS = [(f"p{i}", [1 + i, 7, 9, 11 + i, 3]) for i in range(6)]
KW = dict(max_new_tokens=4, batch_size=2, capture_layers=(1,), window=16, pad_id=0, progress=False)


def test_a_work_folder_refuses_another_target(tmp_path):
    first = tiny_loaded(seed=0).model
    generate_data(first, PROMPTS, tmp_path, model_id="tiny-a", **KW)
    generate_data(first, PROMPTS, tmp_path, model_id="tiny-a", **KW)  # the same target resumes
    other = tiny_loaded(seed=1).model  # the same shapes and vocabulary, other weights
    with pytest.raises(DrafterError, match=r"other settings \(target differ\)"):
        generate_data(other, PROMPTS, tmp_path, model_id="tiny-a", **KW)
    with pytest.raises(DrafterError, match=r"other settings \(target differ\)"):
        generate_data(first, PROMPTS, tmp_path, model_id="tiny-b", **KW)
    pre = tmp_path / "pre"  # teacher-forced data too
    prefill_data(
        first, PROMPTS, pre, max_len=4, capture_layers=(1,), pad_id=0, progress=False, model_id="tiny-a"
    )
    with pytest.raises(DrafterError, match=r"other settings \(target differ\)"):
        prefill_data(
            other, PROMPTS, pre, max_len=4, capture_layers=(1,), pad_id=0, progress=False, model_id="tiny-a"
        )
    # a folder from before the fingerprint was kept cannot say which target made it: refused, not resumed
    kept = json.loads((tmp_path / "parts.json").read_text())
    del kept["target"]
    (tmp_path / "parts.json").write_text(json.dumps(kept))
    with pytest.raises(DrafterError, match="do not say which target made them") as err:
        generate_data(first, PROMPTS, tmp_path, model_id="tiny-a", **KW)
    assert "\n" not in str(err.value)
    # a damaged parts.json was reported as "other settings (parts.json differ)"
    for damaged in ("{not json", "[1, 2]", '{"a":' * 100_000):  # (the last: a RecursionError traceback)
        (tmp_path / "parts.json").write_text(damaged)
        with pytest.raises(DrafterError, match="parts.json is not a readable settings object") as err:
            generate_data(first, PROMPTS, tmp_path, model_id="tiny-a", **KW)
        assert "\n" not in str(err.value)


def test_cpu_time_is_on_disk_as_each_part_is_written(tmp_path):
    model = tiny_loaded(seed=0).model
    generate = model.generate
    calls = []

    def killed_on_the_second_batch(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return generate(*a, **k)

    model.generate = killed_on_the_second_batch
    with pytest.raises(KeyboardInterrupt):
        generate_data(model, PROMPTS, tmp_path, model_id="tiny", **KW)
    assert len(list(tmp_path.glob("part-*.safetensors"))) == 1
    info = json.loads((tmp_path / "info.json").read_text())
    assert info["cpu_s"] > 0 and info["prompts"] == len(PROMPTS)
    model.generate = generate
    again = generate_data(model, PROMPTS, tmp_path, model_id="tiny", **KW)  # resumed: the time adds up
    assert again["cpu_s"] > info["cpu_s"] and len(list(tmp_path.glob("part-*.safetensors"))) == 3


@pytest.mark.parametrize("counters", [{"step": -1}, {"epoch": 1e400}, {"cpu_s": "lots"}, {"step": True}])
def test_a_training_checkpoint_of_mangled_counters_is_one_line(counters, tmp_path):
    """A head checkpoint whose counters were mangled reached ``int()``/the budget arithmetic as a traceback (or a
    negative step count); it is refused when loaded, naming the file."""
    import torch

    from drafters.train import load_train_state

    path = tmp_path / "state.pt"
    torch.save({"head": {}, "opt": {}, "step": 3, "cpu_s": 1.5, "epoch": 0, **counters}, path)
    with pytest.raises(DrafterError, match="state.pt is corrupted .its counters"):
        load_train_state(path)


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [("settings", [1, 2], "its settings"), ("gen", "abc", "its generator state"),
     ("gen", "3 bytes", "its generator state")],
)  # fmt: skip
def test_a_training_checkpoint_of_mangled_fields_is_one_line(field, value, needle, tmp_path):
    """A resume set the batch generator from ``gen`` and read ``settings`` as a mapping: a mangled one was a
    TypeError or a generator-size RuntimeError; refused when loaded, naming the file."""
    import torch

    from drafters.train import load_train_state

    if value == "3 bytes":
        value = torch.zeros(3, dtype=torch.uint8)
    path = tmp_path / "state.pt"
    torch.save({"head": {}, "opt": {}, "step": 3, "cpu_s": 1.5, "epoch": 0, field: value}, path)
    with pytest.raises(DrafterError, match=f"state.pt is corrupted .{needle}"):
        load_train_state(path)
    good = {"head": {}, "opt": {}, "step": 3, "cpu_s": 1.5, "epoch": 0, "gen": torch.Generator().get_state()}
    torch.save(good, path)
    assert load_train_state(path)["step"] == 3


def _part(path, ids, width=8, n=12):
    import torch
    from safetensors.torch import save_file

    tensors = {}
    for b, _ in enumerate(ids):
        tensors[f"{b}/tokens"] = torch.arange(n) % 5
        tensors[f"{b}/final"] = torch.zeros(n, width)
    meta = [{"prompt_id": pid, "answer_start": 4} for pid in ids]
    save_file(tensors, str(path), metadata={"meta": json.dumps(meta)})


def test_an_id_answered_twice_into_one_folder_is_read_once(tmp_path):
    """Two runs answering into one folder at once wrote a prompt twice; the split then held out one copy and trained
    on the other. Read once per folder (from the first part); the same id in another folder (a prefill) stays."""
    from drafters.train_data import load_data

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _part(tmp_path / "a" / "part-00000.safetensors", ["p1", "p2"])
    _part(tmp_path / "a" / "part-00001.safetensors", ["p2", "p3"])
    _part(tmp_path / "b" / "part-00000.safetensors", ["p1"])
    ids = [s.prompt_id for s in load_data(tmp_path / "a", tmp_path / "b")]
    assert ids == ["p1", "p2", "p3", "p1"]


def test_features_of_mixed_widths_are_refused(tmp_path):
    import torch
    from safetensors.torch import save_file

    from drafters.train_data import load_data

    n = 12
    tensors = {"0/tokens": torch.arange(n), "0/final": torch.zeros(n, 8), "0/exit2": torch.zeros(n, 16)}
    save_file(tensors, str(tmp_path / "part-00000.safetensors"),
              metadata={"meta": json.dumps([{"prompt_id": "p", "answer_start": 4}])})  # fmt: skip
    with pytest.raises(DrafterError, match="different lengths or widths"):
        load_data(tmp_path)
