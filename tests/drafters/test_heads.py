"""Head checkpoints: a head trained for another target, a corrupted file or a mismatched training state fails with
one clear DrafterError; the data pipeline and a short training run work end to end on a tiny target."""

from __future__ import annotations

import json

import pytest
import torch

from drafters import DraftContext, DrafterError
from drafters.eagle import EagleDrafter
from drafters.early_exit import EarlyExitDrafter
from drafters.heads import load_head
from tests.drafters.tiny import random_head, tiny_loaded


def _ctx(loaded):
    from env.batch import BatchTarget

    return DraftContext(
        tokens=[1, 2, 3], prompt_len=2, target=BatchTarget(loaded, max_rows=1), last_hidden=torch.zeros(32)
    )


def test_round_trip(tmp_path):
    loaded = tiny_loaded()
    path = random_head("eagle", loaded, tmp_path / "h")
    cfg, tensors, meta = load_head(path, "eagle", loaded.model, loaded.model_id)
    assert cfg.hidden == 32 and tensors["d2t"].shape == (90,)
    assert json.loads(path.with_suffix(".json").read_text())["format"] == "draftgym-head"


def test_head_for_another_target_is_refused(tmp_path):
    a, b = tiny_loaded(seed=0), tiny_loaded(seed=0, hidden=48)
    path = random_head("eagle", a, tmp_path / "h")
    with pytest.raises(DrafterError, match="another target .*hidden_size 32.*48"):
        EagleDrafter(weights=str(path)).reset(_ctx(b))
    other_weights = tiny_loaded(seed=3)  # same shapes and id, other weights
    with pytest.raises(DrafterError, match="other weights"):
        EagleDrafter(weights=str(path)).reset(_ctx(other_weights))
    renamed = tiny_loaded(seed=0, model_id="some/other-model")
    with pytest.raises(DrafterError, match="model_id"):
        EagleDrafter(weights=str(path)).reset(_ctx(renamed))


def test_corrupted_or_wrong_kind_or_missing(tmp_path):
    loaded = tiny_loaded()
    path = random_head("eagle", loaded, tmp_path / "h")
    with pytest.raises(DrafterError, match="not 'early_exit'"):
        EarlyExitDrafter(weights=str(path)).reset(_ctx(loaded))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DrafterError, match="corrupted"):
        EagleDrafter(weights=str(path)).reset(_ctx(loaded))
    path.with_suffix(".json").write_text("{not json")
    with pytest.raises(DrafterError, match="not a draftgym head"):
        EagleDrafter(weights=str(path)).reset(_ctx(loaded))
    with pytest.raises(DrafterError, match="no eagle head"):
        EagleDrafter(weights=str(tmp_path / "absent")).reset(_ctx(loaded))


def test_wrong_shapes_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    loaded = tiny_loaded()
    path = random_head("eagle", loaded, tmp_path / "h")
    tensors = load_file(str(path))
    tensors["layer.q.weight"] = tensors["layer.q.weight"][:, :16].contiguous()
    save_file(tensors, str(path))
    with pytest.raises(DrafterError, match="layer.q.weight has shape"):
        EagleDrafter(weights=str(path)).reset(_ctx(loaded))


def test_data_generation_training_and_resume_checks(tmp_path):
    from drafters.train import TrainSettings, train_head
    from drafters.train_data import generate_data, load_data, prefill_data

    loaded = tiny_loaded()
    prompts = [(f"p{i}", [1 + i, 7, 9, 11 + i, 3]) for i in range(10)]
    work = tmp_path / "data"
    info = generate_data(
        loaded.model,
        prompts,
        work,
        max_new_tokens=6,
        capture_layers=(1, 2),
        window=16,
        pad_id=0,
        progress=False,
    )
    assert len(list(work.glob("part-*.safetensors"))) == 2
    pre = prefill_data(
        loaded.model, prompts[:3], tmp_path / "pre", max_len=4, capture_layers=(1, 2), progress=False
    )
    assert pre["cpu_s"] > 0
    seqs = load_data(work, tmp_path / "pre")
    assert len(seqs) == 13 and sum(s.answer_start == s.tokens.shape[0] == 4 for s in seqs) == 3
    # features are the target's final-norm hidden states: teacher forcing reproduces them
    s0 = next(s for s in seqs if s.prompt_id == "p0" and s.answer_start < s.tokens.shape[0])
    with torch.no_grad():
        h = loaded.model.model(s0.tokens[None]).last_hidden_state[0]
    torch.testing.assert_close(s0.feats[:-1].float(), h[:-1], atol=2e-2, rtol=1e-2)
    assert 1 in s0.exits and 2 in s0.exits
    dirs = [work, tmp_path / "pre"]
    st = TrainSettings(
        kind="eagle", draft_vocab=64, levels=2, cpu_minutes=5, max_steps=2, batch_size=4, window=16
    )
    kw = dict(work_dir=work, data_info=info, progress=False)
    meta = train_head(loaded.model, loaded.model_id, dirs, tmp_path / "head", st, **kw)
    assert meta["training"]["steps"] == 2 and "top1_depth1" in meta["metric"]
    EagleDrafter(weights=str(tmp_path / "head")).reset(_ctx(loaded))  # loads
    # resuming with a training state made for another target or other shapes fails clearly
    other = tiny_loaded(seed=0, hidden=48)
    with pytest.raises(DrafterError, match="training checkpoint .* another target"):
        train_head(other.model, other.model_id, dirs, tmp_path / "h2", st, **kw)
    st_other = TrainSettings(kind="eagle", draft_vocab=4, levels=2, max_steps=3, batch_size=4, window=16)
    with pytest.raises(DrafterError, match="other head shapes"):
        train_head(loaded.model, loaded.model_id, dirs, tmp_path / "h2", st_other, **kw)
    (work / "train-state-eagle.pt").write_bytes(b"garbage")
    with pytest.raises(DrafterError, match="corrupted"):
        train_head(loaded.model, loaded.model_id, dirs, tmp_path / "h2", st, **kw)
