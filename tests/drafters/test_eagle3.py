"""EAGLE-3: the engine keeps the low/middle/high residual streams of every forward, the fused head drafts from
them exactly as it trains, and greedy decoding with it stays exact; the corpus records what the engine computed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from drafters import DraftContext, DrafterError
from drafters.eagle import Eagle3Drafter, KVBuffer
from drafters.heads import aux_layers
from tests.drafters.tiny import check_batched_drafting, decode, decode_counts, random_head, tiny_loaded


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    loaded = tiny_loaded()
    path = random_head("eagle3", loaded, tmp_path_factory.mktemp("heads") / "eagle3-tiny")
    return loaded, path


def test_aux_layers_are_low_middle_high():
    assert aux_layers(30) == (2, 15, 27)  # the shipped SmolLM2 head's
    assert aux_layers(32) == (2, 16, 29)
    assert aux_layers(3) == (1, 2)
    assert aux_layers(2) == (1, 2)
    assert aux_layers(1) == (1,)


def test_both_forwards_keep_the_same_streams_of_a_two_layer_target():
    """A 2-layer target keeps the stream after layer 2: before, the lean forward gave its residual stream, the
    transformers forward its final norm (3.6 apart), so an EAGLE-3 head drafted from different features on each."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from env.batch import BatchTarget
    from env.model import LoadedModel

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=96, attn_implementation="sdpa")  # fmt: skip
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    prompt = list(range(3, 20))
    aux = {}
    for forward in ("lean", "hf"):
        target = BatchTarget(LoadedModel(model=model, model_id="llama-2-layers", forward=forward), 1)
        assert target.aux_layers == (1, 2)
        pf = target.begin_prefill(prompt)
        target.prefill_chunk(pf)
        aux[forward] = pf.aux[0]
    torch.testing.assert_close(aux["lean"], aux["hf"], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("forward", ["lean", "hf"])
def test_engine_keeps_the_residual_streams(forward):
    """After a prefill and after a tree step, ``last_aux`` holds the residual streams after the aux layers, as
    transformers' ``output_hidden_states`` gives them, on both forwards."""
    from env.batch import BatchEngine
    from env.engine import parse_arm

    loaded = tiny_loaded()
    if forward == "hf":
        loaded = loaded.replace(forward="hf")
    eng = BatchEngine(loaded, max_rows=2)
    prompt = [5, 17, 33, 17, 5, 60, 2, 8]
    row, _ = eng.admit(prompt, {"ngram": __import__("drafters").make_drafter("ngram")})
    with torch.no_grad():
        ref = loaded.model(input_ids=torch.tensor([prompt]), output_hidden_states=True).hidden_states
    want = torch.cat([ref[n][0] for n in eng.target.aux_layers], dim=-1)
    torch.testing.assert_close(row.ctx.prompt_aux, want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(row.last_aux, want[-1], atol=1e-5, rtol=1e-4)
    eng.step([parse_arm("ngram-d3")])
    toks = row.tokens
    with torch.no_grad():
        ref = loaded.model(input_ids=torch.tensor([toks[:-1]]), output_hidden_states=True).hidden_states
    want = torch.cat([ref[n][0, -1] for n in eng.target.aux_layers], dim=-1)
    torch.testing.assert_close(row.ctx.last_aux, want, atol=1e-5, rtol=1e-4)


def test_fused_catch_up_matches_training(tiny):
    """The drafter's first feature is ``fused(aux)``, as level 1 of the training-time test computes it."""
    from env.batch import BatchTarget

    loaded, path = tiny
    target = BatchTarget(loaded, max_rows=1)
    d = Eagle3Drafter(weights=str(path))
    d._load(target)
    d.fused = True
    gen = torch.Generator().manual_seed(2)
    t_len, h = 9, loaded.model.config.hidden_size
    tokens = torch.randint(0, 90, (t_len + 1,), generator=gen)
    aux = torch.randn(t_len, len(target.aux_layers) * h, generator=gen) * 30  # residual streams are large
    with torch.no_grad():
        outs = d.head.unrolled(d.head.fused(aux)[None], d.embed(tokens[1:]).float()[None], levels=2)
    d.kv = KVBuffer(d.cfg.kv_heads, d.cfg.head_dim, torch.float32, torch.device("cpu"))
    r = 6
    d.first_pair, d.pending, d.root_at = 0, list(aux[:r]), -1
    with torch.inference_mode():
        d._catch_up(tokens.tolist()[: r + 1])
    torch.testing.assert_close(d.root_feat, outs[0][0, r - 1], atol=1e-5, rtol=1e-4)


def test_greedy_exact_on_tiny_target(trained_tiny):
    """With a head that drafts (trained on the tiny target): drafts accepted and rejected, the text the same."""
    loaded, path = trained_tiny("eagle3")
    prompt = [5, 17, 33, 17, 5, 60, 2, 8, 44, 9]
    ref, _ = decode(loaded, None, prompt, 32)
    for arm in ("eagle3-d4", "eagle3-d4-k3-b8", "eagle3-d3-k2"):
        out, accepted, drafted = decode_counts(loaded, arm, prompt, 32, {"weights": str(path)})
        assert out == ref, arm
        assert 0 < accepted < drafted, (arm, accepted, drafted)


def test_batched_proposals_equal_one_at_a_time(trained_tiny):
    loaded, path = trained_tiny("eagle3")
    check_batched_drafting(loaded, Eagle3Drafter(weights=str(path)), "eagle3", {"weights": str(path)})


def test_a_head_for_other_layers_is_refused(tiny):
    from env.batch import BatchTarget

    loaded, path = tiny
    target = BatchTarget(loaded, max_rows=1)
    d = Eagle3Drafter(weights=str(path))
    ctx = DraftContext(
        tokens=[3, 4, 5], prompt_len=2, target=target, last_aux=torch.randn(64), aux_layers=(1,)
    )
    with pytest.raises(DrafterError, match="fuses the target's layers"):
        d.reset(ctx)


def test_an_eagle_head_is_not_an_eagle3_head(tmp_path):
    loaded = tiny_loaded()
    path = random_head("eagle", loaded, tmp_path / "eagle-tiny")
    from env.batch import BatchTarget

    d = Eagle3Drafter(weights=str(path))
    ctx = DraftContext(
        tokens=[3, 4, 5], prompt_len=2, target=BatchTarget(loaded, 1), last_hidden=torch.randn(32)
    )
    with pytest.raises(DrafterError, match="not 'eagle3'"):
        d.reset(ctx)


def test_distilled_features_are_what_a_prefill_computes(tmp_path):
    """The corpus keeps, for every position of prompt + answer, the features the engine computed while decoding;
    they equal a teacher-forced forward over the finished sequence (fp32, to fp16 rounding)."""
    from drafters.train import windows
    from drafters.train_data import load_data
    from env.batch import BatchTarget
    from experiments.corpus import distill_answers

    loaded = tiny_loaded()
    g = torch.Generator().manual_seed(3)
    prompts = [(f"p{i}", torch.randint(3, 90, (n,), generator=g).tolist()) for i, n in enumerate((7, 12, 5))]
    info = distill_answers(
        loaded, prompts, tmp_path / "ans", max_new_tokens=9, batch=2, part_size=2, progress=False
    )
    assert info["capture_layers"] == [1, 2] and info["prompts"] == 3
    seqs = {s.prompt_id: s for s in load_data(tmp_path / "ans")}
    assert sorted(seqs) == ["p0", "p1", "p2"]
    target = BatchTarget(loaded, 1)
    for pid, ids in prompts:
        s = seqs[pid]
        assert s.tokens[: len(ids)].tolist() == ids and s.answer_start == len(ids)
        new = s.tokens[len(ids) :].tolist()
        assert new == decode(loaded, None, ids, 9)[0][: len(new)]
        pf = target.begin_prefill(s.tokens.tolist())
        target.prefill_chunk(pf)
        torch.testing.assert_close(s.feats[:-1].float(), pf.hidden[0][:-1], atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(s.exits[2][:-1].float(), pf.aux[0][:-1, 32:], atol=2e-2, rtol=1e-2)
        assert float(s.feats[-1].abs().sum()) == 0.0  # the last token has no feature yet
    # a rerun finds every prompt done (resume) and writes nothing
    before = sorted(p.name for p in (tmp_path / "ans").glob("part-*"))
    distill_answers(loaded, prompts, tmp_path / "ans", max_new_tokens=9, batch=2, progress=False)
    assert sorted(p.name for p in (tmp_path / "ans").glob("part-*")) == before
    # windows cover every position once
    pieces = windows(list(seqs.values()), 8, min_len=1)
    assert sum(int(p.tokens.shape[0]) for p in pieces) == sum(int(s.tokens.shape[0]) for s in seqs.values())
    assert all(p.tokens.shape[0] <= 8 for p in pieces)
    # --answer-repeat: the windows with answer tokens come 3 times, the others once; 0 is refused
    from drafters.train import repeat_answers

    more = repeat_answers(pieces, 3)
    answered = [p for p in pieces if p.answer_start < p.tokens.shape[0]]
    assert 0 < len(answered) < len(pieces) and len(more) == len(pieces) + 2 * len(answered)
    assert all(sum(q is p for q in more) == (3 if any(p is a for a in answered) else 1) for p in pieces)
    with pytest.raises(DrafterError, match="answer_repeat"):
        repeat_answers(pieces, 0)
    # an answer length that leaves no room for a prompt is refused before anything is written (it cut prompts
    # from their start); a damaged info.json is one line, the parts kept
    from experiments.errors import UserError

    for bad in (loaded.max_context - 2, 0):
        with pytest.raises(UserError, match=f"--max-new-tokens {bad} leaves no room"):
            distill_answers(loaded, prompts, tmp_path / "other", max_new_tokens=bad, progress=False)
    assert not (tmp_path / "other").exists()
    (tmp_path / "ans" / "info.json").write_text("garbage")
    with pytest.raises(DrafterError, match="info.json is not this data's info"):
        distill_answers(loaded, prompts, tmp_path / "ans", max_new_tokens=9, batch=2, progress=False)
    assert sorted(p.name for p in (tmp_path / "ans").glob("part-*")) == before


def test_training_a_tiny_eagle3_head(tmp_path):
    """train_head(kind=eagle3) on engine-recorded data: the fused head is saved with its layers and loads."""
    from drafters.train import TrainSettings, train_head
    from experiments.corpus import distill_answers

    loaded = tiny_loaded()
    g = torch.Generator().manual_seed(5)
    prompts = [(f"p{i:02d}", torch.randint(3, 90, (9,), generator=g).tolist()) for i in range(12)]
    distill_answers(loaded, prompts, tmp_path / "ans", max_new_tokens=12, batch=4, progress=False)
    st = TrainSettings(kind="eagle3", draft_vocab=64, levels=3, feat_noise=0.0, reg_weight=0.0, steps=3,
                       window=16, batch_size=4, save_every_s=1e9)  # fmt: skip
    out = tmp_path / "eagle3-tiny"
    meta = train_head(loaded.model, loaded.model_id, [tmp_path / "ans"], out, st, work_dir=tmp_path,
                      data_info={}, progress=False)  # fmt: skip
    assert meta["training"]["steps"] == 3 and "chain3_tau" in meta["metric"]
    prompt = [5, 17, 33, 17, 5, 60, 2, 8]
    assert (
        decode(loaded, "eagle3-d3-k2-b5", prompt, 16, {"weights": str(out)})[0]
        == decode(loaded, None, prompt, 16)[0]
    )


def test_a_reduced_draft_vocabulary_stays_exact_and_keeps_the_most_frequent(trained_tiny, tmp_path):
    """Option ``vocab``: the drafter projects onto its ``vocab`` most frequent draft tokens only -- the first of a
    head whose d2t was put in frequency order (``experiments.vocab_order``), the lowest ids of an older head --
    and greedy decoding stays exact; a bad value is a DrafterError."""
    import shutil

    from drafters.eagle import kept_vocab
    from env.batch import BatchTarget
    from experiments.vocab_order import frequency_order, rewrite_head

    d2t = torch.tensor([3, 9, 40, 41, 77])
    assert kept_vocab(d2t, {}, 2).tolist() == [3, 9]
    assert kept_vocab(torch.tensor([77, 3, 41, 9, 40]), {"d2t_order": {"by": "frequency"}}, 2).tolist() == [
        77,
        3,
    ]
    assert kept_vocab(d2t, {}, 0).tolist() == kept_vocab(d2t, {}, 9).tolist() == d2t.tolist()
    counts = {41: 5, 9: 5, 77: 7}
    assert frequency_order(d2t, counts, first=(40, 1000)).tolist() == [40, 77, 9, 41, 3]  # ties: lower id
    from safetensors.torch import load_file

    loaded, path = trained_tiny("eagle3")
    shutil.copy(path.with_suffix(".json"), tmp_path / path.with_suffix(".json").name)
    path = Path(shutil.copy(path, tmp_path / path.name))

    old = load_file(str(path))["d2t"]
    new = frequency_order(old, {int(t): i for i, t in enumerate(old.tolist())})  # reversed id order
    rewrite_head(path, new, {"by": "frequency", "test": True})
    with pytest.raises(ValueError, match="not a permutation"):
        rewrite_head(path, new[:-1], {"by": "frequency"})
    prompt = [5, 17, 33, 17, 5, 60, 2, 8, 44, 9]
    ref, _ = decode(loaded, None, prompt, 24)
    for vocab in (0, 8, 40):
        out, accepted, drafted = decode_counts(
            loaded, "eagle3-d3-k2-b5", prompt, 24, {"weights": str(path), "vocab": vocab}
        )
        assert out == ref, vocab
        assert accepted < drafted and (accepted > 0 or vocab > 0), (
            vocab,
            accepted,
            drafted,
        )  # 8, 40: the highest ids
    drafter = Eagle3Drafter(weights=str(path), vocab=8)
    drafter._load(BatchTarget(loaded, max_rows=1))
    assert drafter.d2t.tolist() == new[:8].tolist() and drafter.w_draft.shape[0] == 8
    assert drafter.fork().vocab == 8 and drafter.fork().w_draft is drafter.w_draft
    for bad in (-1, 2.5, True, "8"):
        with pytest.raises(DrafterError, match="vocab"):
            Eagle3Drafter(vocab=bad)


def test_ordering_a_file_that_is_not_a_head_is_one_line_and_exit_2(tmp_path, capsys):
    from experiments.vocab_order import main

    path = tmp_path / "junk.safetensors"
    path.write_bytes(b"\x00not safetensors")
    path.with_suffix(".json").write_text("{not json")
    assert main([str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "junk.json" in err[0]
    assert path.read_bytes() == b"\x00not safetensors"  # untouched
