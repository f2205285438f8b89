"""The EAGLE head: training-time test sees what tree drafting sees; greedy decoding stays exact."""

from __future__ import annotations

import pytest
import torch

from drafters import TreeShape
from drafters.eagle import EagleDrafter
from drafters.trees import GrowingTree
from tests.drafters.tiny import check_batched_drafting, decode, decode_counts, random_head, tiny_loaded


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    loaded = tiny_loaded()
    path = random_head("eagle", loaded, tmp_path_factory.mktemp("heads") / "eagle-tiny")
    return loaded, path


@pytest.mark.parametrize("block", [64, 5, 1])
def test_unrolled_training_matches_tree_drafting(tiny, block):
    """Level s at pair j of ``EagleHead.unrolled`` == the depth-(s-1) node of a chain rooted at pair j-s+1 whose
    tokens are the true ones, drafted through the drafter's own cache and tree mask -- with the attention in one
    query block, in blocks that do not divide the sequence, and per pair."""
    from env.batch import BatchTarget

    loaded, path = tiny
    target = BatchTarget(loaded, max_rows=1)
    d = EagleDrafter(weights=str(path))
    d._load(target)
    gen = torch.Generator().manual_seed(1)
    t_len = 12
    tokens = torch.randint(0, 90, (t_len + 1,), generator=gen)
    feats = torch.randn(t_len, loaded.model.config.hidden_size, generator=gen)
    emb_next = d.embed(tokens[1:]).float()
    with torch.no_grad():
        outs = d.head.unrolled(feats[None], emb_next[None], levels=3, block=block)
    r = 7  # root token x_r; the root pair is r - 1
    d.kv = __import__("drafters.eagle", fromlist=["KVBuffer"]).KVBuffer(
        d.cfg.kv_heads, d.cfg.head_dim, torch.float32, torch.device("cpu")
    )
    d.first_pair, d.pending, d.root_at = 0, list(feats[:r]), -1
    toks = tokens.tolist()
    with torch.inference_mode():
        d._catch_up(toks[: r + 1])
        torch.testing.assert_close(d.root_feat, outs[0][0, r - 1], atol=1e-5, rtol=1e-4)
        g = GrowingTree.start(toks[r])
        g.add(0, toks[r + 1], -0.1)
        g.add(1, toks[r + 2], -0.1)
        from drafters.eagle import TreeSlots, _head_pass
        from drafters.lockstep import Growing

        gr = Growing(d, TreeShape(depth=2), None, slots=TreeSlots(d.kv.n), base=r - 1)
        gr.feats[0] = d.root_feat
        gr.request = ([1], g)
        f1 = _head_pass([gr])[0][0]
        gr.feats[1] = f1
        torch.testing.assert_close(f1, outs[1][0, r], atol=1e-5, rtol=1e-4)
        gr.request = ([2], g)
        f2 = _head_pass([gr])[0][0]
        torch.testing.assert_close(f2, outs[2][0, r + 1], atol=1e-5, rtol=1e-4)


def _unrolled_dense(head, feats, emb_next, levels):
    """The one-pass formulation (before query blocks): level s over the level-1 keys and, per earlier level, a
    whole shifted key sequence under an identity mask."""
    from drafters.eagle import _shift
    from drafters.heads import attend

    t = feats.shape[1]
    pos = idx = torch.arange(t)
    outs, keys, vals, prev = [], [], [], feats
    for s in range(1, levels + 1):
        if s > 1:
            prev = torch.cat([torch.zeros_like(outs[-1][:, :1]), outs[-1][:, :-1]], dim=1)
        x = head.pair(emb_next, prev)
        q, k, v = head.layer.project(x, pos)
        keys.append(k)
        vals.append(v)
        ks = [keys[0]] + [_shift(keys[i - 1], s - i) for i in range(2, s + 1)]
        vs = [vals[0]] + [_shift(vals[i - 1], s - i) for i in range(2, s + 1)]
        eye = idx[None, :] == idx[:, None]
        mask = torch.cat([idx[None, :] <= idx[:, None] - (s - 1)] + [eye] * (s - 1), dim=1)
        a = attend(q, torch.cat(ks, dim=2), torch.cat(vs, dim=2), mask[None, None])
        outs.append(head.norm(head.layer.finish(x, a)))
    return outs


def test_unrolled_blocks_give_the_same_gradients(tiny):
    """The query blocks of training-time test change the cost, not the loss: outputs (every pair, every level)
    and every parameter's gradient agree with the one-pass formulation, for one block, blocks of 3 (not dividing
    the 11 pairs) and blocks of 1, over a batch of 2 sequences at 4 levels."""
    loaded, path = tiny
    d = EagleDrafter(weights=str(path))
    from env.batch import BatchTarget

    d._load(BatchTarget(loaded, max_rows=1))
    d.head.requires_grad_(True)
    gen = torch.Generator().manual_seed(2)
    h = loaded.model.config.hidden_size
    feats, emb = torch.randn(2, 11, h, generator=gen), torch.randn(2, 11, h, generator=gen)
    weight = torch.linspace(-1, 1, h)
    got = []
    for block in (None, 64, 3, 1):
        d.head.zero_grad(set_to_none=True)
        if block is None:
            outs = _unrolled_dense(d.head, feats, emb, 4)
        else:
            outs = d.head.unrolled(feats, emb, levels=4, block=block)
        sum(((o[:, s:] * weight) ** 2).sum() for s, o in enumerate(outs)).backward()
        got.append(([o.detach() for o in outs], {n: p.grad.clone() for n, p in d.head.named_parameters()}))
    ref_outs, ref_grads = got[0]
    assert ref_grads
    for outs, grads in got[1:]:
        for s, (a, b) in enumerate(zip(ref_outs, outs)):
            torch.testing.assert_close(b[:, s:], a[:, s:], atol=1e-5, rtol=1e-4)  # (pairs j < s-1: no input)
        assert grads.keys() == ref_grads.keys()
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, atol=1e-5, rtol=1e-4, msg=name)
    with pytest.raises(ValueError, match="block"):
        d.head.unrolled(feats, emb, levels=2, block=0)


def test_greedy_exact_on_tiny_target(trained_tiny):
    """With a head that drafts (trained on the tiny target): drafts accepted and rejected, the text the same."""
    loaded, path = trained_tiny("eagle")
    prompt = [5, 17, 33, 17, 5, 60, 2, 8, 44, 9]
    ref, _ = decode(loaded, None, prompt, 32)
    for arm, opts in (
        ("eagle-d4", {}),
        ("eagle-d4-k3-b8", {}),
        ("eagle-d3-k2", {}),
        ("eagle-d3-k2-b5", {"tree": "kary"}),
    ):
        out, accepted, drafted = decode_counts(loaded, arm, prompt, 32, {"weights": str(path), **opts})
        assert out == ref, arm
        assert 0 < accepted < drafted, (arm, accepted, drafted)


def test_feedback_without_hidden_states_still_decodes(tiny):
    """A caller that keeps only the last feature (e.g. a trace recorder) still gets valid proposals."""
    from drafters import DraftContext, DraftTree, Feedback, TreeShape
    from env.batch import BatchTarget

    loaded, path = tiny
    target = BatchTarget(loaded, max_rows=1)
    d = EagleDrafter(weights=str(path))
    ctx = DraftContext(tokens=[3, 4, 5], prompt_len=2, target=target, last_hidden=torch.randn(32))
    d.reset(ctx)  # no prompt features: starts from the last one
    t = d.propose(ctx, TreeShape(depth=3, topk=2))
    assert t.num_nodes > 1
    ctx.tokens.extend([6, 7])
    d.observe(ctx, Feedback(committed=[6, 7], tree=DraftTree.root_only(5)))
    assert d.propose(ctx, TreeShape(depth=2)).num_nodes == 3


def test_batched_proposals_equal_one_at_a_time(trained_tiny):
    """Rows that chose eagle are drafted in lockstep (one head pass per depth over all their frontiers)."""
    loaded, path = trained_tiny("eagle")
    check_batched_drafting(loaded, EagleDrafter(weights=str(path)), "eagle", {"weights": str(path)})
