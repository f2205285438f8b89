"""The early-exit drafter catches up on the tokens the last step committed for every row of a batch in one pass of
the target's first layers and the adapter (``drafters.early_exit._catch_up_many``), not one pass per row: the
adapter caches, root outputs and the root's keys are those of catching up one row at a time -- for prompts of
different lengths and for steps that committed different numbers of tokens."""

from __future__ import annotations

import pytest
import torch

from drafters import DrafterError, TreeShape, make_drafter
from drafters.early_exit import _catch_up_many
from drafters.head_cache import KVBuffer
from env.batch import BatchEngine
from env.engine import Arm
from tests.drafters.tiny import random_head, tiny_loaded

CLOSE = dict(atol=1e-5, rtol=1e-5)


def _twin(d):
    """A fork of ``d`` in the same state: a copy to catch up one row at a time."""
    t = d.fork()
    t.target = d.target
    t.kv = KVBuffer(d.cfg.kv_heads, d.cfg.head_dim, d.adapter_dtype, d.device)
    t.kv.k, t.kv.v, t.kv.n = d.kv.k.clone(), d.kv.v.clone(), d.kv.n
    return t


def _same(a, b, extra_a, extra_b) -> None:
    assert a.kv.n == b.kv.n
    n = a.kv.n
    torch.testing.assert_close(a.kv.k[:, :, :n], b.kv.k[:, :, :n], **CLOSE)
    torch.testing.assert_close(a.kv.v[:, :, :n], b.kv.v[:, :, :n], **CLOSE)
    torch.testing.assert_close(a.root_out, b.root_out, **CLOSE)
    for x, y in zip(a._root_slot, b._root_slot):
        torch.testing.assert_close(x, y, **CLOSE)
    assert len(extra_a) == len(extra_b) == len(a.layers)
    for (ka, va), (kb, vb) in zip(extra_a, extra_b):
        torch.testing.assert_close(ka, kb, **CLOSE)
        torch.testing.assert_close(va, vb, **CLOSE)


@pytest.mark.parametrize("exit_layer", [1, 2])
def test_catching_up_a_batch_in_one_pass_equals_one_row_at_a_time(exit_layer, tmp_path):
    loaded = tiny_loaded()
    head = random_head("early_exit", loaded, tmp_path / "ee", exit_layer=exit_layer)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (6, 19, 11)]
    engine = BatchEngine(loaded, max_rows=3)
    first = make_drafter("early_exit", weights=str(head))
    rows = [engine.admit(prompts[0], {"early_exit": first})[0]]
    drafters = [first, first.fork(), first.fork()]
    rows += [engine.admit(p, {"early_exit": d})[0] for p, d in zip(prompts[1:], drafters[1:])]
    shapes = [TreeShape(depth=4), TreeShape(depth=2), TreeShape(depth=3)]
    pending = []
    for _ in range(4):  # the prompts first, then what each step committed (1 to depth + 1 tokens a row)
        pending.append(tuple(len(r.ctx.tokens) - d.kv.n for d, r in zip(drafters, rows)))
        twins = [_twin(d) for d in drafters]
        with torch.inference_mode():
            extras = _catch_up_many([(d, r.ctx) for d, r in zip(drafters, rows)])
            alone = [
                t._catch_up(r.ctx.tokens, r.ctx.target_kv, len(r.ctx.tokens) - 1) for t, r in zip(twins, rows)
            ]
        for d, t, ea, eb in zip(drafters, twins, extras, alone):
            _same(d, t, ea, eb)
        engine.step([Arm("early_exit", s) for s in shapes])
    # after the prompts, steps that committed different numbers of tokens were caught up together, some several
    after = {n for p in pending[1:] for n in p}
    assert any(len(set(p)) > 1 for p in pending[1:]) and max(after) > 2, pending
    with pytest.raises(DrafterError, match="fork"):  # one drafter object for two rows: refused, not mixed up
        drafters[0].propose_batch(
            [(drafters[0], rows[0].ctx, shapes[0]), (drafters[0], rows[1].ctx, shapes[1])]
        )
