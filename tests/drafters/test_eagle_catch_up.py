"""The eagle drafters catch up on the pairs the last step committed for every row of a batch in one pass of the
head's products (``drafters.eagle._catch_up_many``), not one pass per row: the caches and root features are those
of catching up one row at a time -- for prompts of different lengths and for steps that committed different
numbers of tokens."""

from __future__ import annotations

import pytest
import torch

from drafters import TreeShape, make_drafter
from drafters.eagle import _catch_up_many
from drafters.head_cache import KVBuffer
from env.batch import BatchEngine
from env.engine import Arm
from tests.drafters.tiny import random_head, tiny_loaded


def _twin(d):
    """A fork of ``d`` in the same state: an empty-handed copy to catch up one row at a time."""
    t = d.fork()
    t.kv = KVBuffer(d.cfg.kv_heads, d.cfg.head_dim, d.dtype, d.device)
    t.kv.k, t.kv.v, t.kv.n = d.kv.k.clone(), d.kv.v.clone(), d.kv.n
    t.first_pair, t.pending, t.root_feat, t.root_at = d.first_pair, list(d.pending), d.root_feat, d.root_at
    return t


def _same(a, b) -> None:
    assert a.kv.n == b.kv.n and a.root_at == b.root_at and not a.pending and not b.pending
    n = a.kv.n
    torch.testing.assert_close(a.kv.k[:, :, :n], b.kv.k[:, :, :n], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.kv.v[:, :, :n], b.kv.v[:, :, :n], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.root_feat, b.root_feat, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
def test_catching_up_a_batch_in_one_pass_equals_one_row_at_a_time(kind, tmp_path):
    loaded = tiny_loaded()
    head = random_head(kind, loaded, tmp_path / kind)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (6, 19, 11)]
    engine = BatchEngine(loaded, max_rows=3)
    first = make_drafter(kind, weights=str(head))
    rows = [engine.admit(prompts[0], {kind: first})[0]]
    drafters = [first, first.fork(), first.fork()]
    rows += [engine.admit(p, {kind: d})[0] for p, d in zip(prompts[1:], drafters[1:])]
    shapes = [TreeShape(depth=4), TreeShape(depth=2), TreeShape(depth=3)]
    pending = set()
    for _ in range(4):  # the prompts first, then what each step committed (1 to depth + 1 pairs a row)
        pending.add(tuple(len(d.pending) for d in drafters))
        twins = [_twin(d) for d in drafters]
        with torch.inference_mode():
            _catch_up_many([(d, r.ctx.tokens) for d, r in zip(drafters, rows)])
            for t, r in zip(twins, rows):
                t._catch_up(r.ctx.tokens)
        for d, t in zip(drafters, twins):
            _same(d, t)
        engine.step([Arm(kind, s) for s in shapes])
    assert len({n for p in pending for n in p}) >= 3  # rows of different pending lengths caught up together
