"""The corpus of the draft heads (``experiments.corpus``) keeps its CPU time on disk as each part is written: a
kill mid-run (here at the second part) loses only the time since the last part, and a resumed call adds to it.
A new part never replaces one there."""

from __future__ import annotations

import json

import pytest

from tests.drafters.tiny import tiny_loaded


@pytest.fixture
def killed_at_the_second_part(monkeypatch):
    from experiments import corpus

    write = corpus._write_part
    calls = []

    def part(*a):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        write(*a)

    monkeypatch.setattr(corpus, "_write_part", part)
    return lambda: monkeypatch.setattr(corpus, "_write_part", write)


@pytest.mark.parametrize("kind", ["text", "answers"])
def test_cpu_time_is_on_disk_as_each_part_is_written(kind, tmp_path, killed_at_the_second_part):
    from experiments import corpus

    loaded = tiny_loaded()
    items = [(f"x{i}", [1 + i, 7, 9, 11, 3, 5]) for i in range(3)]

    def run():
        if kind == "text":
            return corpus.text_features(loaded, items, tmp_path, part_size=1, progress=False)
        return corpus.distill_answers(loaded, items, tmp_path, max_new_tokens=2, batch=1, part_size=1,
                                      progress=False)  # fmt: skip

    with pytest.raises(KeyboardInterrupt):
        run()
    assert len(list(tmp_path.glob("part-*.safetensors"))) == 1
    info = json.loads((tmp_path / "info.json").read_text())
    assert info["cpu_s"] > 0
    killed_at_the_second_part()  # the kill is over: a rerun resumes
    again = run()
    assert again["cpu_s"] > info["cpu_s"] and len(list(tmp_path.glob("part-*.safetensors"))) == 3


def test_a_new_part_never_replaces_one_there(tmp_path):
    """Parts were numbered by counting those there: with one deleted (to be made again), the next part replaced the
    highest, and every later one replaced it again. Now a part takes the number after the highest."""
    import torch

    from experiments import corpus

    def seq(i):
        return {"id": f"p{i}", "tokens": [1, 2, 3], "final": torch.zeros(3, 4), "aux": torch.zeros(3, 8),
                "answer_start": 1, "answer_len": 2}  # fmt: skip

    for i in range(3):
        corpus._write_part(tmp_path, [seq(i)], (1, 2))
    (tmp_path / "part-00001.safetensors").unlink()
    for i in range(3, 5):
        corpus._write_part(tmp_path, [seq(i)], (1, 2))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [f"part-{n:05d}.safetensors" for n in (0, 2, 3, 4)]  # no temporary file left either
    assert corpus._done_ids(tmp_path) == {"p0", "p2", "p3", "p4"}
