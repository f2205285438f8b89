"""Which architectures the batch engine runs: small random models of each supported one decode, with drafts and
rows of different lengths in one batch, exactly what Hugging Face greedy ``generate`` gives; the others are
refused with one line."""

from __future__ import annotations

import pytest
import torch

from env.batch import BatchEngine
from env.engine import parse_arm
from env.model import LoadedModel, ModelError
from env.serving import Request, serve
from tests.hf_reference import hf_greedy

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=96, max_position_embeddings=256)  # fmt: skip


def _loaded(config_cls, model_cls, **extra) -> LoadedModel:
    torch.manual_seed(0)
    cfg = config_cls(**{**SMALL, **extra})
    cfg._attn_implementation = "sdpa"
    model = model_cls(cfg).eval().requires_grad_(False)
    with torch.no_grad():  # sharper logits: greedy falls into loops the n-gram drafter can follow
        model.get_input_embeddings().weight.mul_(8.0)
    model.generation_config.eos_token_id = 95
    model.generation_config.pad_token_id = 0
    return LoadedModel(model=model, tokenizer=None, model_id=cfg.model_type + "-tiny", dtype=torch.float32,
                       device=torch.device("cpu"))  # fmt: skip


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _loaded(Qwen2Config, Qwen2ForCausalLM, use_sliding_window=False)


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM

    return _loaded(MistralConfig, MistralForCausalLM, sliding_window=None)


@pytest.mark.parametrize("make", [_qwen2, _mistral], ids=["qwen2", "mistral"])
def test_supported_architectures_decode_exactly(make):
    loaded = make()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (5, 17, 9, 26)]
    arms = ["none", "ngram-d4", "ngram-d3-k2-b5", "recycling-d3-k2-b5"]
    reqs = [Request(str(i), p, parse_arm(a), 20) for i, (p, a) in enumerate(zip(prompts, arms))]
    out = serve(BatchEngine(loaded, max_rows=3), reqs, concurrency=3)
    for r, o in zip(reqs, out):
        assert o.token_ids == hf_greedy(loaded, r.prompt_ids, 20), r.arm.name


def test_a_short_sliding_window_is_refused():
    from transformers import MistralConfig, MistralForCausalLM

    loaded = _loaded(MistralConfig, MistralForCausalLM, sliding_window=16)
    with pytest.raises(ModelError, match="sliding window of 16"):
        BatchEngine(loaded, max_rows=1)


def test_gemma_is_refused_in_one_line():
    from transformers import GemmaConfig, GemmaForCausalLM

    loaded = _loaded(GemmaConfig, GemmaForCausalLM, head_dim=8)
    with pytest.raises(ModelError, match="'gemma' model"):
        BatchEngine(loaded, max_rows=1)


@pytest.mark.parametrize("forward", ["hf", "compiled"])
def test_the_other_forwards_decode_exactly(forward):
    """The transformers forward (the generic path) and the lean one through torch.compile give the same tokens as
    Hugging Face greedy (qwen2: q/k/v biases)."""
    loaded = _qwen2().replace(forward=forward)
    assert (BatchEngine(loaded, 1).target.net is None) == (forward == "hf")
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (7, 15)]
    reqs = [
        Request(str(i), p, parse_arm(a), 12) for i, (p, a) in enumerate(zip(prompts, ["ngram-d3", "none"]))
    ]
    out = serve(BatchEngine(loaded, max_rows=2), reqs, concurrency=2)
    for r, o in zip(reqs, out):
        assert o.token_ids == hf_greedy(loaded, r.prompt_ids, 12), r.arm.name


@pytest.mark.slow  # compiles three graphs (~40 s on 2 cores, seconds from the disk cache)
def test_the_compiled_int4_forward_speculates_its_own_output_and_a_grown_cache_compiles_nothing():
    """A quantized target compiled (fp32 activations: the exactness contract): speculation equals its own AR
    loop, which equals the eager int4 forward's; a prompt that grows the cache past its first chunk (256
    positions) reuses the compiled code instead of compiling one more graph."""
    from torch._dynamo.utils import counters

    base = _qwen2_long().replace(weights="int4")
    loaded = base.replace(forward="compiled")

    def run(model, prompt, arm):
        out = serve(BatchEngine(model, 1), [Request("0", prompt, parse_arm(arm), 12)], concurrency=1)
        return out[0].token_ids

    g = torch.Generator().manual_seed(5)
    short = torch.randint(3, 90, (9,), generator=g).tolist()
    ar = run(loaded, short, "none")
    assert ar == run(base, short, "none")
    assert run(loaded, short, "ngram-d3") == ar
    graphs = counters["stats"]["unique_graphs"]
    long = torch.randint(3, 90, (250,), generator=g).tolist()  # 250 + 12 positions: the cache grows
    ar = run(loaded, long, "none")
    assert counters["stats"]["unique_graphs"] == graphs  # no new graph for the grown cache
    assert ar == run(base, long, "none")
    assert BatchEngine(loaded, 1).target.net._compiled is not None  # it really ran compiled


def _qwen2_long():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _loaded(Qwen2Config, Qwen2ForCausalLM, use_sliding_window=False, max_position_embeddings=1024)
