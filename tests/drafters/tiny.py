"""A tiny random Llama target (hidden 32, 3 layers, vocab 96) for fast drafter tests: exactness does not depend on
draft quality, and the heads' shapes and checks can be exercised without the embedded model."""

from __future__ import annotations

from pathlib import Path

import torch

from drafters.heads import HeadConfig, save_head, target_fingerprint


def tiny_loaded(seed: int = 0, hidden: int = 32, model_id: str = "tiny-llama"):
    from transformers import LlamaConfig, LlamaForCausalLM

    from env.model import LoadedModel

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=96,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    with torch.no_grad():  # sharper logits: greedy decoding falls into loops that drafters can predict
        model.model.embed_tokens.weight.mul_(8.0)
    model.generation_config.eos_token_id = 95
    model.generation_config.pad_token_id = 0
    return LoadedModel(
        model=model, tokenizer=None, model_id=model_id, dtype=torch.float32, device=torch.device("cpu")
    )


def random_head(kind: str, loaded, path: Path, seed: int = 0, exit_layer: int = 1) -> Path:
    """Save an untrained head for ``loaded`` (draft vocabulary: every id but the last few, to exercise d2t)."""
    from drafters.train import build_head

    torch.manual_seed(seed)
    vocab = loaded.model.config.vocab_size
    d2t = torch.arange(vocab - 6)
    from drafters.heads import aux_layers

    fuse = aux_layers(int(loaded.model.config.num_hidden_layers)) if kind == "eagle3" else ()
    cfg = HeadConfig.from_target(
        loaded.model, kind, len(d2t), exit_layer=exit_layer if kind == "early_exit" else 0, fuse_layers=fuse
    )
    head = build_head(kind, cfg, loaded.model)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    meta = {"target": target_fingerprint(loaded.model, loaded.model_id), "metric": {}}
    return save_head(path, head, d2t, cfg, meta)


def trained_head(kind: str, loaded, folder: Path, steps: int = 150) -> Path:
    """A head trained ``steps`` optimizer steps on the tiny target's own greedy answers (24 random prompts, 40 new
    tokens; ~6 s): it drafts what the target decodes, so that exactness tests see drafts accepted as well as
    rejected -- an untrained head's drafts never are, and a test on it checks the rejection path only."""
    from drafters.train import TrainSettings, train_head
    from experiments.corpus import distill_answers

    answers = folder / "answers"
    if not (answers / "info.json").is_file():
        g = torch.Generator().manual_seed(5)
        prompts = [(f"p{i:02d}", torch.randint(3, 90, (9,), generator=g).tolist()) for i in range(24)]
        distill_answers(loaded, prompts, answers, max_new_tokens=40, batch=8, progress=False)
    st = TrainSettings(kind=kind, draft_vocab=90, levels=3, feat_noise=0.0, reg_weight=0.1 if kind == "eagle" else 0.0,
                       steps=steps, window=48, batch_size=8, save_every_s=1e9, lr=1e-2)  # fmt: skip
    out = folder / f"{kind}-trained"
    (folder / f"{kind}-work").mkdir(parents=True, exist_ok=True)
    train_head(loaded.model, loaded.model_id, [answers], out, st, work_dir=folder / f"{kind}-work", data_info={},
               progress=False)  # fmt: skip
    return out.with_suffix(".safetensors")


def decode_counts(
    loaded, arm_name: str, prompt: list[int], n: int, drafter_options=None
) -> tuple[list[int], int, int]:
    """``decode``'s new tokens, with the draft tokens accepted and drafted over the whole sequence."""
    from drafters import make_drafter
    from env.batch import BatchEngine
    from env.engine import parse_arm
    from env.step import Stepper

    arm = parse_arm(arm_name)
    stepper = Stepper(BatchEngine(loaded, max_rows=1), [arm])
    seq = stepper.start(prompt, n, {arm.drafter: make_drafter(arm.drafter, **(drafter_options or {}))})
    while not seq.done:
        stepper.step([0])
    return seq.tokens, seq.accepted, seq.drafted


def decode(
    loaded, arm_name: str | None, prompt: list[int], n: int, drafter_options=None
) -> tuple[list[int], int]:
    """Greedy decoding with one arm through the engine (a batch of one); returns (new tokens, steps)."""
    from drafters import make_drafter
    from env.batch import BatchEngine
    from env.engine import NO_DRAFT, parse_arm
    from env.step import Stepper

    arm = NO_DRAFT if arm_name is None else parse_arm(arm_name)
    drafters = (
        {} if arm.drafter is None else {arm.drafter: make_drafter(arm.drafter, **(drafter_options or {}))}
    )
    stepper = Stepper(BatchEngine(loaded, max_rows=1), [arm])
    seq = stepper.start(prompt, n, drafters)
    while not seq.done:
        stepper.step([0])
    return seq.tokens, seq.steps


def check_batched_drafting(loaded, first, name: str, options: dict, seed: int = 4) -> None:
    """Rows that chose drafter ``name`` are drafted in lockstep (``first.propose_batch``; the other rows' drafters
    are forks of ``first``, sharing its loaded weights): the trees equal those each row's drafter proposes alone,
    and greedy serving with several such rows equals plain greedy decoding -- with drafts accepted and rejected
    (a head that drafts, ``trained_head``)."""
    from drafters import TreeShape
    from env.batch import BatchEngine
    from env.engine import parse_arm
    from env.serving import Request, serve

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (6, 19, 11)]
    engine = BatchEngine(loaded, max_rows=3)
    rows = [engine.admit(prompts[0], {name: first})[0]]  # loads the weights
    drafters = [first, first.fork(), first.fork()]
    rows += [engine.admit(p, {name: d})[0] for p, d in zip(prompts[1:], drafters[1:])]
    assert drafters[2].w_draft is first.w_draft  # forks share what was loaded
    mixed = [TreeShape(depth=3, topk=2, budget=5), TreeShape(depth=4), TreeShape(depth=2, topk=3, budget=6)]
    same = [TreeShape(depth=3, topk=2, budget=6)] * 3  # frontiers of one width: no padded queries
    for shapes in (mixed, same):
        batched = first.propose_batch([(d, r.ctx, s) for d, r, s in zip(drafters, rows, shapes)])
        alone = [d.propose(r.ctx, s) for d, r, s in zip(drafters, rows, shapes)]
        for a, b in zip(batched, alone):
            assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
            assert torch.allclose(a.scores, b.scores, atol=1e-5)
    arms = [f"{name}-d3-k2-b5", f"{name}-d4", "none", f"{name}-d2-k3-b6", f"{name}-d3"]
    reqs = [Request(str(i), p, parse_arm(a), 18) for i, (p, a) in enumerate(zip(prompts * 2, arms))]
    out = serve(BatchEngine(loaded, max_rows=3), reqs, concurrency=3, drafter_options={name: options})
    for r, o in zip(reqs, out):
        assert o.token_ids == decode(loaded, None, r.prompt_ids, 18)[0], r.arm.name
    drafting = [o for r, o in zip(reqs, out) if r.arm.drafter == name]
    assert sum(o.accepted for o in drafting) > 0 and sum(o.drafted - o.accepted for o in drafting) > 0
