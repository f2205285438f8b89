"""Early exit: the drafter's first-l-layer states, computed on the shared target cache, equal the target's own;
greedy decoding stays exact."""

from __future__ import annotations

import pytest
import torch

from drafters import DraftContext, TreeShape
from drafters.early_exit import EarlyExitDrafter
from tests.drafters.tiny import decode, random_head, tiny_loaded


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    loaded = tiny_loaded()
    path = random_head("early_exit", loaded, tmp_path_factory.mktemp("heads") / "exit-tiny", exit_layer=2)
    return loaded, path


def test_root_state_equals_the_target_layers_on_the_full_sequence(tiny):
    from env.target import Target

    loaded, path = tiny
    target = Target(loaded)
    tokens = [5, 17, 33, 17, 5, 60, 2, 8]
    state, _ = target.prefill(tokens[:-1])
    target.append_root(state, tokens[-1])
    d = EarlyExitDrafter(weights=str(path))
    ctx = DraftContext(tokens=state.tokens, prompt_len=7, target=target, extras={"target_cache": state.cache})
    d.reset(ctx)
    with torch.no_grad():
        hs = loaded.model(torch.tensor([tokens]), output_hidden_states=True).hidden_states[
            2
        ]  # after 2 layers
        expected = d.adapter.forward_train(hs)[0, -1]
    with torch.inference_mode():
        d._catch_up(state.tokens, state.cache, len(state.tokens) - 1)
    torch.testing.assert_close(d.root_out, expected, atol=1e-4, rtol=1e-4)
    assert state.cache.get_seq_length() == 7  # read only: nothing was written into the target's cache
    tree = d.propose(ctx, TreeShape(depth=3, topk=2, budget=5))
    assert tree.num_nodes == 6 and state.cache.get_seq_length() == 7


def test_greedy_exact_on_tiny_target(tiny):
    loaded, path = tiny
    prompt = [5, 17, 33, 17, 5, 60, 2, 8, 44, 9]
    ref, _ = decode(loaded, None, prompt, 32)
    for arm in ("early_exit-d4", "early_exit-d4-k3-b8"):
        out, _ = decode(loaded, arm, prompt, 32, {"weights": str(path)})
        assert out == ref, arm
