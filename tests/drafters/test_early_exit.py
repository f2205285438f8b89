"""Early exit: the drafter's first-l-layer states, computed on the shared target cache, equal the target's own;
greedy decoding stays exact."""

from __future__ import annotations

import pytest
import torch

from drafters import TreeShape
from drafters.early_exit import EarlyExitDrafter
from tests.drafters.tiny import check_batched_drafting, decode, decode_counts, random_head, tiny_loaded


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    loaded = tiny_loaded()
    path = random_head("early_exit", loaded, tmp_path_factory.mktemp("heads") / "exit-tiny", exit_layer=2)
    return loaded, path


def test_root_state_equals_the_target_layers_on_the_full_sequence(tiny):
    """Read through the engine's ragged cache (``DraftContext.target_kv``), as in a batch step."""
    from env.batch import BatchEngine

    loaded, path = tiny
    engine = BatchEngine(loaded, max_rows=2)
    engine.admit([9, 9, 9, 9], {})  # another row in slot 0: the drafter must read its own
    tokens = [5, 17, 33, 17, 5, 60, 2, 8]
    row, _ = engine.admit(tokens[:-1], {})
    row.tokens[-1] = tokens[-1]  # the root
    ctx = row.ctx
    cache = engine.target.cache
    before = [t[:, :, :7].clone() for t in cache.k]
    d = EarlyExitDrafter(weights=str(path))
    d.reset(ctx)
    with torch.no_grad():
        hs = loaded.model(torch.tensor([tokens]), output_hidden_states=True).hidden_states[
            2
        ]  # after 2 layers
        expected = d.adapter.forward_train(hs)[0, -1]
    with torch.inference_mode():
        d._catch_up(row.tokens, ctx.target_kv, len(row.tokens) - 1)
    torch.testing.assert_close(d.root_out, expected, atol=1e-4, rtol=1e-4)
    tree = d.propose(ctx, TreeShape(depth=3, topk=2, budget=5))
    assert tree.num_nodes == 6
    assert cache.lens == [4, 7]  # read only: nothing was written into the target's cache
    assert all(torch.equal(t[:, :, :7], b) for t, b in zip(cache.k, before))


def test_greedy_exact_on_tiny_target(tiny):
    loaded, path = tiny
    prompt = [5, 17, 33, 17, 5, 60, 2, 8, 44, 9]
    ref, _ = decode(loaded, None, prompt, 32)
    for arm in ("early_exit-d4", "early_exit-d4-k3-b8"):
        out, accepted, drafted = decode_counts(loaded, arm, prompt, 32, {"weights": str(path)})
        assert out == ref, arm
        assert 0 < accepted < drafted, (arm, accepted, drafted)  # the adapter starts as the next target layer


def test_batched_proposals_equal_one_at_a_time(tiny):
    """Rows that chose early exit are drafted in lockstep (the target's first layers and the adapter once per
    depth over every row's frontier, each row attending to its own cache rows)."""
    loaded, path = tiny
    check_batched_drafting(loaded, EarlyExitDrafter(weights=str(path)), "early_exit", {"weights": str(path)})
