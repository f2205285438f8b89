"""A model drafter whose draft vocabulary is narrower than the arm's ``topk`` (a head file with a small
``draft_vocab``, or eagle's option ``vocab``): each node gets every draft token as a child -- fewer than topk --
the trees stay trees, and greedy decoding stays exact."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from drafters import TreeShape, check_tree, make_drafter
from drafters.heads import HeadConfig, save_head, target_fingerprint
from tests.drafters.tiny import decode, random_head, tiny_loaded

PROMPT = [5, 17, 33, 17, 5, 60, 2, 8, 44, 9]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from drafters.train import build_head

    loaded = tiny_loaded()
    folder = tmp_path_factory.mktemp("heads")
    heads = {kind: random_head(kind, loaded, folder / kind) for kind in ("eagle", "eagle3")}
    cfg = HeadConfig.from_target(loaded.model, "early_exit", 2, exit_layer=1)
    torch.manual_seed(0)
    head = build_head("early_exit", cfg, loaded.model)
    meta = {"target": target_fingerprint(loaded.model, loaded.model_id), "metric": {}}
    heads["early_exit"] = save_head(folder / "exit-v2", head, torch.tensor([5, 9]), cfg, meta)
    return loaded, heads


def options(kind: str, heads: dict, tree: str) -> dict:
    out = {"weights": str(heads[kind]), "tree": tree}
    if kind != "early_exit":
        out["vocab"] = 2  # the head's 2 most frequent draft tokens
    return out


@pytest.mark.parametrize("tree", ["dynamic", "kary", "chain"])
@pytest.mark.parametrize("kind", ["eagle", "eagle3", "early_exit"])
def test_topk_wider_than_the_draft_vocabulary_proposes_a_valid_tree(tiny, kind, tree):
    from env.batch import BatchEngine

    loaded, heads = tiny
    d = make_drafter(kind, **options(kind, heads, tree))
    engine = BatchEngine(loaded, max_rows=1)
    row, _ = engine.admit(PROMPT, {kind: d})
    assert d.d2t.shape == (2,)
    out = d.propose(row.ctx, TreeShape(depth=3, topk=4, budget=12))
    tokens, parents = out.tokens.tolist(), out.parents.tolist()
    check_tree(tokens, parents, loaded.model.config.vocab_size)
    assert out.num_draft > 0
    children = Counter(parents[1:])
    assert max(children.values()) <= 2  # every draft token once per node, no more
    assert set(tokens[1:]) <= set(d.d2t.tolist())


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "early_exit"])
def test_topk_wider_than_the_draft_vocabulary_stays_exact(tiny, kind):
    loaded, heads = tiny
    ref, _ = decode(loaded, None, PROMPT, 16)
    for arm in (f"{kind}-d3-k4", f"{kind}-d4-k3-b8"):
        out, _ = decode(loaded, arm, PROMPT, 16, options(kind, heads, "dynamic"))
        assert out == ref, arm
