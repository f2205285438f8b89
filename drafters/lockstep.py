"""Drafting for many sequences at once with a model head (the rows of a batch that chose the same drafter): each
sequence's tree builder (``drafters.trees.tree_steps``) is a generator; all of them advance in lockstep, and each
round runs ONE head pass over every sequence's frontier nodes (``head_pass``: linear layers over all of them, each
sequence's attention over its own cache) and ONE projection to the draft vocabulary. The trees equal those built
one sequence at a time. EAGLE (``drafters.eagle``) and early exit (``drafters.early_exit``) draft this way."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from drafters.base import DraftTree, TreeShape
from drafters.trees import GrowingTree, TreeSteps


class Growing:
    """One sequence's tree in a lockstep proposal: its drafter, builder, current request (``(frontier, tree)``),
    the head outputs of its nodes so far (``feats``: node -> [H]) and whatever its head pass keeps (``state``)."""

    def __init__(self, d: Any, shape: TreeShape, steps: TreeSteps, **state: Any) -> None:
        self.d, self.shape, self.steps = d, shape, steps
        self.state = state
        self.feats: dict[int, torch.Tensor] = {}
        self.request: tuple[list[int], GrowingTree] | None = None
        self.result: DraftTree | None = None

    def advance(self, answer: tuple[list, list] | None) -> bool:
        """Send the builder its answer (None: start it); False once the tree is done (``result``)."""
        try:
            self.request = next(self.steps) if answer is None else self.steps.send(answer)
            return True
        except StopIteration as stop:
            self.request, self.result = None, stop.value
            return False


def propose_lockstep(
    grows: list[Growing | DraftTree], head_pass: Callable[[list[Growing]], list[torch.Tensor]]
) -> list[DraftTree]:
    """Finish every ``Growing`` of ``grows`` (finished trees pass through). ``head_pass(group)`` returns, per
    sequence of a group that shares one head (``d.w_draft``), the head outputs [F, H] of its frontier; the
    drafter's ``w_draft`` [Vd, H] (through its ``draft_pk``, kernels.packed) and ``d2t`` [Vd] turn them into each
    node's best children."""
    out: list[DraftTree | None] = [g if isinstance(g, DraftTree) else None for g in grows]
    live = {i: g for i, g in enumerate(grows) if isinstance(g, Growing)}
    for i, gr in list(live.items()):
        if not gr.advance(None):
            out[i] = gr.result
            del live[i]
    while live:
        groups: dict[int, list[int]] = {}
        for i, gr in live.items():
            groups.setdefault(id(gr.d.w_draft), []).append(i)
        for idx in groups.values():
            group = [live[i] for i in idx]
            feats = head_pass(group)
            d0 = group[0].d
            lp = torch.log_softmax(d0.draft_pk.product(torch.cat(feats), d0.w_draft).float(), dim=-1)
            # a shape may ask for more children than the draft vocabulary holds (Vd = lp.shape[-1]): a node then
            # gets all Vd of them, fewer than topk (the tree builders take what they get)
            width = min(max(max(g.shape.topk, 1) for g in group), lp.shape[-1])
            top_lp, top_i = lp.topk(width, dim=-1)
            lps, tis = top_lp.tolist(), d0.d2t[top_i].tolist()  # one conversion for the group
            at = 0
            for i, gr, f in zip(idx, group, feats):
                n, k = f.shape[0], min(max(gr.shape.topk, 1), width)
                for u, feat in zip(gr.request[0], f.unbind()):  # type: ignore[index]
                    gr.feats[u] = feat
                answer = ([r[:k] for r in lps[at : at + n]], [r[:k] for r in tis[at : at + n]])
                if not gr.advance(answer):
                    out[i] = gr.result
                    del live[i]
                at += n
    return out  # type: ignore[return-value]
