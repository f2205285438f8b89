"""The Hugging Face baselines over a static cache: ``hf_static`` gives ``hf_greedy``'s tokens (fp32); ``hf_compile``
(``generate`` compiling its forward, which it does on CUDA) is refused up front where it would not compile."""

from __future__ import annotations

import pytest

from env.decoder import chat_prompt
from experiments.bench import run_method
from experiments.config import ConfigError, load_config


@pytest.mark.model
def test_hf_static_gives_hf_greedy_tokens(fp32_model):
    ids = chat_prompt(fp32_model.tokenizer, "Name three colours of the rainbow.")
    decoders: dict = {}
    want, _, _, _, _ = run_method("hf_greedy", fp32_model, decoders, ids, 24)
    got, wall, steps, tau, _ = run_method("hf_static", fp32_model, decoders, ids, 24)
    assert got == want and len(got) > 5 and steps == len(got) and tau == 1.0 and wall > 0
    again, *_ = run_method("hf_static", fp32_model, decoders, ids, 300)  # another cache size (a new bucket)
    assert again[:24] == want


def test_hf_compile_is_refused_off_cuda(capsys):
    import torch

    from experiments.cli import main

    if torch.cuda.is_available():
        pytest.skip("CUDA: hf_compile runs")
    assert main(["bench", "--methods", "ar,hf_compile", "--device", "cpu", "--limit", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        "\n" not in err
        and "hf_compile: Hugging Face compiles generate's forward on CUDA only, not on cpu" in err
    )
    with pytest.raises(
        ConfigError, match="is 'hf_compile': Hugging Face compiles generate's forward on CUDA only"
    ):
        load_config(None, text='methods = ["ar", "hf_compile"]\n[model]\ndevice = "cpu"')
    assert load_config(None, text='methods = ["ar", "hf_static"]').methods == ("ar", "hf_static")
