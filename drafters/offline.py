"""Greedy τ of a drafter without the target: under greedy verification the committed tokens are the target's
greedy continuation whatever the drafter proposes, so a drafter whose proposals depend only on the committed tokens
(n-gram, suffix -- with its cross-request cache fed in serving order) can be scored on recorded greedy outputs:
at every step its tree is matched against the true continuation, the accepted path plus the bonus token are
committed, and the drafter sees them. τ (committed tokens per step) equals what the engine measures on the same
sequences (tested against it). Model drafters (eagle, early exit) need the target's features: not here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from drafters.base import DraftContext, Drafter, DraftTree, Feedback, TreeShape


@dataclass(frozen=True)
class OfflineResult:
    committed: int  # answer tokens (the first one comes from the prefill)
    steps: int  # verification steps, the prefill's first token counting as one (as ``env.metrics`` counts)

    @property
    def tau(self) -> float:
        return self.committed / max(1, self.steps)


def accepted(tree: DraftTree, future: Sequence[int]) -> int:
    """Draft nodes of ``tree`` accepted against the true continuation ``future`` (greedy: the longest root path
    whose tokens equal ``future``'s first ones)."""
    toks, pars = tree.tokens.tolist(), tree.parents.tolist()
    kids: dict[int, dict[int, int]] = {}
    for i in range(1, len(toks)):
        kids.setdefault(pars[i], {}).setdefault(toks[i], i)
    node = n = 0
    while n < len(future):
        nxt = kids.get(node, {}).get(future[n])
        if nxt is None:
            break
        node, n = nxt, n + 1
    return n


def greedy_tau(
    drafter: Drafter, shape: TreeShape, sequences: Sequence[tuple[Sequence[int], int]]
) -> list[OfflineResult]:
    """Serve ``sequences`` ((prompt + greedy answer token ids, prompt length)) one after another with one drafter
    instance (reset per sequence, ``finish`` at its end, as the engine does); returns each one's result."""
    out = []
    for tokens, prompt_len in sequences:
        tokens = list(tokens)
        ctx = DraftContext(tokens=tokens[: prompt_len + 1], prompt_len=prompt_len)
        drafter.reset(ctx)
        pos, steps = prompt_len + 1, 0
        while pos < len(tokens):
            tree = drafter.propose(ctx, shape)
            n = min(accepted(tree, tokens[pos:]) + 1, len(tokens) - pos)
            ctx.tokens.extend(tokens[pos : pos + n])
            drafter.observe(ctx, Feedback(committed=tokens[pos : pos + n], tree=tree))
            pos += n
            steps += 1
        finish = getattr(drafter, "finish", None)
        if finish is not None:
            finish(ctx)
        out.append(OfflineResult(committed=len(tokens) - prompt_len, steps=steps + 1))
    return out
