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
    cfg = HeadConfig.from_target(
        loaded.model, kind, len(d2t), exit_layer=exit_layer if kind != "eagle" else 0
    )
    head = build_head(kind, cfg, loaded.model)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    meta = {"target": target_fingerprint(loaded.model, loaded.model_id), "metric": {}}
    return save_head(path, head, d2t, cfg, meta)


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
