"""What the device loop (env.device_loop) and the lean forward it runs (env.lean.lean_of) refuse, on tiny random
models: a sliding window shorter than the context (the lean forward attends over every earlier position), and
prompt token ids that are not integers of the vocabulary, each as a one-line error before any row changes."""

from __future__ import annotations

import pytest
import torch

from env.device_loop import DeviceLoop
from env.lean import lean_of
from env.model import LoadedModel, ModelError
from env.target import PromptError
from tests.drafters.tiny import tiny_loaded
from tests.hf_reference import hf_greedy


def _mistral(window: int | None) -> LoadedModel:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=96, max_position_embeddings=256, sliding_window=window,
                        attn_implementation="sdpa")  # fmt: skip
    model = MistralForCausalLM(cfg).eval().requires_grad_(False)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(8.0)
    model.generation_config.eos_token_id = 95
    model.generation_config.pad_token_id = 0
    return LoadedModel(model=model, tokenizer=None, model_id=f"mistral-sw{window}", dtype=torch.float32,
                       device=torch.device("cpu"))  # fmt: skip


def test_a_short_sliding_window_is_refused_by_the_lean_forward_and_the_device_loop():
    """Before, the device loop decoded a window of 8 with full attention: tokens unlike Hugging Face's."""
    from experiments.methods import device_loop

    loaded = _mistral(8)
    with pytest.raises(ModelError, match="sliding window of 8 tokens, shorter than its context of 256"):
        lean_of(loaded)
    with pytest.raises(ModelError, match="sliding window of 8"):
        device_loop(loaded, "device:lookup-d3")


def test_a_window_as_long_as_the_context_decodes_exactly_on_the_device_loop():
    loaded = _mistral(256)
    prompt = torch.randint(1, 90, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    got = DeviceLoop(lean_of(loaded), 1, 3, 100, [95]).generate([prompt], 20).tokens[0]
    assert got == hf_greedy(loaded, prompt, 20)


@pytest.fixture(scope="module")
def loop():
    return DeviceLoop(lean_of(tiny_loaded()), 2, 2, 100, [95])


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (100, "prompt 1 holds token id 100, outside the vocabulary \\[0, 96\\)"),
        (-3, "prompt 1 holds token id -3, outside the vocabulary"),
        (7.9, "prompt 1 holds token id 7.9 \\(float\\); token ids are integers"),
        (True, "prompt 1 holds token id True \\(bool\\); token ids are integers"),
    ],
)
def test_prompt_ids_outside_the_vocabulary_or_not_integers_are_one_line_errors(loop, bad, message):
    """Before, an id out of range raised a bare IndexError (on CUDA a device assert) and a float or a bool was
    cast to an id; now each is refused before any row's state changes."""
    good = [5, 17, 33, 17, 5]
    want = loop.generate([good], 6).tokens
    with pytest.raises(PromptError, match=message):
        loop.generate([good, [5, bad, 7]], 6)
    assert loop.done.all()  # the previous generation's state, untouched
    assert loop.generate([good], 6).tokens == want
