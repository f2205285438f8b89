"""``train-drafter eagle3``: its default corpus folder is named from what the data's parts share (model, weights,
dtype, answer length), so a rerun with more prompts answers only the new ones; each run trains on its own prompts
only, so the prompts it holds out stay out even when an earlier run answered them.

No model runs here: the answers are made-up tensors written in the corpus's own part format, and training is
replaced by reading the data back as ``train_head`` does (``load_data`` with its ``keep_ids``)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from env.workloads import load_workload
from experiments import corpus
from experiments.cli import main


class _Tokenizer:
    chat_template = None
    pad_token_id = 0

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) % 97 for c in text[:12]]}


@pytest.fixture
def fake_corpus(tmp_path, monkeypatch):
    """Every call's answered prompts, the folder answered into, and the prompts training read back."""
    import drafters.train
    import env.model
    from drafters.train_data import load_data

    monkeypatch.setenv("DRAFTGYM_CACHE", str(tmp_path / "cache"))
    loaded = SimpleNamespace(
        model_id="tiny", dtype=torch.bfloat16, weights="dense", tokenizer=_Tokenizer(), model=None
    )
    monkeypatch.setattr(env.model, "load_model", lambda *a, **k: loaded)
    calls: list[dict] = []

    def distill(loaded, prompts, out_dir, *, max_new_tokens, batch, progress):
        out_dir.mkdir(parents=True, exist_ok=True)
        done = corpus._done_ids(out_dir)
        todo = [(pid, ids) for pid, ids in prompts if pid not in done]
        seqs = [
            {"id": pid, "tokens": ids + [1, 2], "final": torch.zeros(len(ids) + 2, 4),
             "aux": torch.zeros(len(ids) + 2, 12), "answer_start": len(ids), "answer_len": 2}
            for pid, ids in todo
        ]  # fmt: skip
        if seqs:
            corpus._write_part(out_dir, seqs, (1, 2, 3))
        calls.append({"folder": out_dir.parent, "answered": [pid for pid, _ in todo]})
        return {"cpu_s": 0.0}

    def train(model, model_id, dirs, out, settings, *, work_dir, data_info, progress, keep_ids):
        calls[-1]["trained"] = {s.prompt_id for s in load_data(*dirs, keep=keep_ids)}
        calls[-1]["train_dir"] = work_dir
        return {"metric": {}, "training": {}}

    monkeypatch.setattr(corpus, "distill_answers", distill)
    monkeypatch.setattr(drafters.train, "train_head", train)
    return calls


def _train(tmp_path: Path, general: int, exclude: int) -> int:
    return main(["train-drafter", "eagle3", "--code-prompts", "0", "--general-prompts", str(general),
                 "--exclude-per-category", str(exclude), "--text-tokens", "0", "--json",
                 "--out", str(tmp_path / "head" / "h")])  # fmt: skip


def test_more_prompts_reuse_the_default_corpus_and_held_out_prompts_stay_out(tmp_path, fake_corpus, capsys):
    assert _train(tmp_path, general=3, exclude=1) == 0
    first = fake_corpus[0]
    assert sum(pid.startswith("general-") for pid in first["answered"]) == 3

    assert _train(tmp_path, general=5, exclude=1) == 0  # two more prompts: the same folder, two more answers
    second = fake_corpus[1]
    assert second["folder"] == first["folder"]
    assert sorted(second["answered"]) == ["general-03-03", "general-04-04"]
    assert second["trained"] == set(first["answered"]) | set(second["answered"])
    assert second["train_dir"] != first["train_dir"]  # another selection: a training state of its own

    # more benchmark prompts held out: already answered there, and still never trained on
    assert _train(tmp_path, general=5, exclude=2) == 0
    third = fake_corpus[2]
    held = {p.prompt_id for p in load_workload(None, per_category=2)} - {
        p.prompt_id for p in load_workload(None, per_category=1)
    }
    answered = set(first["answered"]) | set(second["answered"])
    assert third["folder"] == first["folder"] and third["answered"] == []
    assert held & answered, "the newly held-out prompts were answered by the earlier runs"
    assert not (third["trained"] & held)
    assert third["trained"] == answered - held
    json.loads(capsys.readouterr().out.splitlines()[-1])  # --json: the head's metadata


def test_the_default_corpus_folder_is_named_by_what_its_parts_share(tmp_path):
    from experiments.train_drafter import corpus_folder

    a = SimpleNamespace(model_id="tiny", dtype=torch.bfloat16, weights="dense")
    assert corpus_folder(tmp_path, a, 128) == corpus_folder(tmp_path, a, 128)
    others = [
        corpus_folder(tmp_path, a, 64),
        corpus_folder(tmp_path, SimpleNamespace(model_id="tiny", dtype=torch.float32, weights="dense"), 128),
        corpus_folder(tmp_path, SimpleNamespace(model_id="tiny", dtype=torch.bfloat16, weights="int8"), 128),
        corpus_folder(
            tmp_path, SimpleNamespace(model_id="other", dtype=torch.bfloat16, weights="dense"), 128
        ),
    ]
    assert len({corpus_folder(tmp_path, a, 128), *others}) == 5
    wl = tmp_path / "w.jsonl"
    wl.write_text('{"question_id": 1, "category": "qa", "turns": ["a?"]}\n')
    one = corpus_folder(tmp_path, a, 128, str(wl))
    assert one not in {
        corpus_folder(tmp_path, a, 128),
        *others,
    }  # answers are kept by id: ids of another file
    wl.write_text('{"question_id": 1, "category": "qa", "turns": ["b?"]}\n')
    assert corpus_folder(tmp_path, a, 128, str(wl)) != one  # an edited file: its ids may name other prompts
