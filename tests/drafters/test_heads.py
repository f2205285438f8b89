"""Head checkpoints: a head trained for another target, a corrupted file or a mismatched training state fails with
one clear DrafterError; the data pipeline and a short training run work end to end on a tiny target."""

from __future__ import annotations

import json
from dataclasses import replace

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


@pytest.mark.parametrize("version", [2, "1", True, None])
def test_a_head_of_another_format_version_is_refused(tmp_path, version):
    """A description of a later (or garbled) format version is refused in one line, not misread."""
    loaded = tiny_loaded()
    path = random_head("eagle", loaded, tmp_path / "h")
    desc = path.with_suffix(".json")
    desc.write_text(json.dumps({**json.loads(desc.read_text()), "version": version}))
    with pytest.raises(DrafterError, match="head format version .* is not one this draftgym reads") as err:
        load_head(path, "eagle", loaded.model, loaded.model_id)
    assert "\n" not in str(err.value)
    desc.write_text(json.dumps({k: v for k, v in json.loads(desc.read_text()).items() if k != "version"}))
    load_head(path, "eagle", loaded.model, loaded.model_id)  # a description without one: read as version 1


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
    meta = json.loads(path.with_suffix(".json").read_text())
    del meta["weights_sha256"]  # as a head saved before the digest was recorded: the shapes are checked
    path.with_suffix(".json").write_text(json.dumps(meta))
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
    # its parts were made with 6 new tokens: a rerun of other settings in the folder is refused, not mixed in
    with pytest.raises(DrafterError, match=r"other settings \(max_new_tokens differ\)"):
        generate_data(loaded.model, prompts, work, max_new_tokens=8, capture_layers=(1, 2), window=16, pad_id=0,
                      progress=False)  # fmt: skip
    with pytest.raises(DrafterError, match=r"other settings \(prompts differ\)"):
        generate_data(loaded.model, prompts[:9], work, max_new_tokens=6, capture_layers=(1, 2), window=16,
                      pad_id=0, progress=False)  # fmt: skip
    assert len(load_data(work, keep={"p1", "p2"})) == 2  # only the prompts asked for
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
    held_ids = meta["training"]["heldout_ids"]  # what head_eval scores the head on, however the folder grows
    assert held_ids == sorted(held_ids) and len(held_ids) == meta["training"]["heldout_sequences"] > 0
    EagleDrafter(weights=str(tmp_path / "head")).reset(_ctx(loaded))  # loads
    # new weights beside an older description (a kill between the two renames of a save): caught at load
    saved = (tmp_path / "head.safetensors").read_bytes()
    (tmp_path / "head.safetensors").write_bytes(saved[:-2] + bytes([saved[-2] ^ 1]) + saved[-1:])
    with pytest.raises(DrafterError, match="not the weights head.json describes"):
        EagleDrafter(weights=str(tmp_path / "head")).reset(_ctx(loaded))
    (tmp_path / "head.safetensors").write_bytes(saved)
    # data or a training state made for another target, or other shapes, fail clearly
    other = tiny_loaded(seed=0, hidden=48)
    with pytest.raises(DrafterError, match="features of size 32; this target's hidden size is 48"):
        train_head(other.model, other.model_id, dirs, tmp_path / "h2", st, **kw)
    with pytest.raises(DrafterError, match="was trained on other data"):  # the prefill folder left out
        train_head(loaded.model, loaded.model_id, dirs[:1], tmp_path / "h2", st, **kw)
    st_other = TrainSettings(kind="eagle", draft_vocab=4, levels=2, max_steps=3, batch_size=4, window=16)
    with pytest.raises(DrafterError, match="other head shapes"):
        train_head(loaded.model, loaded.model_id, dirs, tmp_path / "h2", st_other, **kw)
    # the same shapes but another training setting: resuming would mix two runs
    with pytest.raises(DrafterError, match=r"other settings \(compute"):
        train_head(
            loaded.model, loaded.model_id, dirs, tmp_path / "h2", replace(st, compute="bfloat16"), **kw
        )
    with pytest.raises(DrafterError, match=r"other settings \(answer_repeat: 1\)"):
        train_head(loaded.model, loaded.model_id, dirs, tmp_path / "h2", replace(st, answer_repeat=3), **kw)
    # a checkpoint written before a setting existed resumes as that setting's default
    state = torch.load(work / "train-state-eagle.pt", weights_only=True)
    del state["settings"]["answer_repeat"]
    torch.save(state, work / "train-state-eagle.pt")
    meta = train_head(loaded.model, loaded.model_id, dirs, tmp_path / "h3", replace(st, max_steps=3), **kw)
    assert meta["training"]["steps"] == 3
    (work / "train-state-eagle.pt").write_bytes(b"garbage")
    with pytest.raises(DrafterError, match="corrupted"):
        train_head(loaded.model, loaded.model_id, dirs, tmp_path / "h2", st, **kw)
    # bf16 products (autocast), fp32 weights: trains, says so, and scores on the whole vocabulary
    kw_bf = dict(work_dir=tmp_path / "bf", data_info=info, progress=False)
    (tmp_path / "bf").mkdir()
    st_bf = replace(st, compute="bfloat16")
    meta = train_head(loaded.model, loaded.model_id, dirs, tmp_path / "head-bf", st_bf, **kw_bf)
    assert meta["trained_compute"] == "bfloat16" and meta["metric"]["agreement"] == "full vocabulary"
    _, tensors, _ = load_head(tmp_path / "head-bf.safetensors", "eagle", loaded.model, loaded.model_id)
    assert all(t.dtype != torch.bfloat16 for t in tensors.values())
    with pytest.raises(DrafterError, match="compute must be"):
        train_head(loaded.model, loaded.model_id, dirs, tmp_path / "h3", replace(st, compute="fp8"),
                   work_dir=tmp_path / "bf2", data_info=info, progress=False)  # fmt: skip


class _Oracle(torch.nn.Module):
    """A head that drafts the target's own next feature at every level: it agrees wherever it can."""

    def unrolled(self, feats, emb_next, levels):
        nxt = torch.zeros_like(feats)
        nxt[:, :-1] = feats[:, 1:]
        return [nxt] * levels


def test_full_vocabulary_agreement_counts_a_token_outside_the_draft_vocabulary_as_a_miss(tmp_path):
    """``evaluate(exact=...)``: a perfect head whose draft vocabulary holds none of the target's greedy tokens
    agrees nowhere, though the argmax over that vocabulary alone agrees everywhere; with the whole vocabulary as
    the draft vocabulary, it agrees everywhere by both rules."""
    from drafters.train import TrainSettings, evaluate, windows
    from drafters.train_data import generate_data, load_data

    loaded = tiny_loaded(seed=0)
    model = loaded.model
    prompts = [(f"p{i}", [1 + i, 7, 9, 11 + i, 3]) for i in range(6)]
    generate_data(model, prompts, tmp_path, max_new_tokens=8, capture_layers=(1,), window=16, pad_id=0,
                  progress=False)  # fmt: skip
    seqs = windows(load_data(tmp_path), 16)
    w_full = model.lm_head.weight.detach().float()
    greedy = set()
    for q in seqs:
        greedy |= set((q.feats.float() @ w_full.T).argmax(-1).tolist())
    vocab = int(w_full.shape[0])
    outside = torch.tensor([t for t in range(vocab) if t not in greedy][:16])
    embed = model.get_input_embeddings()
    got = {}
    for name, d2t in [("outside", outside), ("all", torch.arange(vocab))]:
        st = TrainSettings(kind="eagle", draft_vocab=len(d2t), levels=2, batch_size=4, window=16)
        w = w_full[d2t]
        got[name] = [evaluate(_Oracle(), seqs, w, embed, st, exact=e) for e in ((w_full, d2t), None)]
    exact, draft = got["outside"]
    assert exact["positions"] > 0 and exact["agreement"] == "full vocabulary"
    assert exact["top1_depth1"] == exact["top1_depth2"] == 0.0 and exact["chain2_tau"] == 1.0
    assert draft["top1_depth1"] == draft["top1_depth2"] == 1.0 and draft["agreement"] == "draft vocabulary"
    for r in got["all"]:  # (a chain rooted near a sequence's end is cut short there)
        assert (
            r["top1_depth1"] == r["top1_depth2"] == 1.0
            and r["chain2_tau"] == got["all"][0]["chain2_tau"] > 2.5
        )


def test_full_argmax_of_no_rows_and_of_rows_in_chunks():
    from drafters.train import _full_argmax

    w = torch.randn(50, 8)
    assert _full_argmax(torch.zeros(0, 8), w).shape == (0,)
    x = torch.randn(7, 8)
    assert torch.equal(_full_argmax(x, w, chunk=3), (x @ w.T).argmax(-1))
