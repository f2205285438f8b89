"""Train/test splits of a workload by prompt, and the sub-trace of a split.

Policies are scored on prompts held out from their training: ``split_prompts`` keeps ``test_per_category`` prompts
of every category for testing (drawn with a seeded generator, so that ``draftgym train`` and ``draftgym evaluate``
agree), and ``subset_trace`` cuts a recorded trace down to the training prompts for the replay env.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from env.trace import Trace, TraceError, TreeArrays


@dataclass(frozen=True)
class Split:
    train: tuple[str, ...]
    test: tuple[str, ...]
    seed: int
    test_per_category: int

    def as_dict(self) -> dict[str, object]:
        return {
            "train": list(self.train),
            "test": list(self.test),
            "seed": self.seed,
            "test_per_category": self.test_per_category,
        }


def split_prompts(
    prompt_ids: Sequence[str], categories: Sequence[str], test_per_category: int, seed: int = 0
) -> Split:
    """``test_per_category`` prompts of each category (at most half of it) to test, the rest to train."""
    if test_per_category < 0:
        raise ValueError(f"test_per_category must be >= 0, got {test_per_category}")
    by_cat: dict[str, list[str]] = defaultdict(list)
    for pid, cat in zip(prompt_ids, categories):
        by_cat[str(cat)].append(str(pid))
    rng = np.random.default_rng(seed)
    test: set[str] = set()
    for cat in sorted(by_cat):
        ids = by_cat[cat]
        n = min(test_per_category, len(ids) // 2)
        test.update(ids[i] for i in rng.choice(len(ids), size=n, replace=False))
    train = tuple(str(p) for p in prompt_ids if str(p) not in test)
    return Split(
        train, tuple(str(p) for p in prompt_ids if str(p) in test), int(seed), int(test_per_category)
    )


def trace_split(trace: Trace, test_per_category: int, seed: int = 0) -> Split:
    return split_prompts(trace.prompt_ids, trace.header["prompts"]["categories"], test_per_category, seed)


def subset_trace(trace: Trace, keep: Sequence[str]) -> Trace:
    """The trace of the prompts in ``keep`` only (in the trace's order)."""
    ids = trace.prompt_ids
    wanted = {str(k) for k in keep}
    missing = wanted - set(ids)
    if missing:
        raise TraceError(f"prompts {sorted(missing)[:5]} are not in the trace")
    sel = [i for i, p in enumerate(ids) if p in wanted]
    if not sel:
        raise TraceError("the subset of the trace is empty")

    def cat(arr: np.ndarray, off: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        parts = [arr[off[i] : off[i + 1]] for i in sel]
        new_off = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64)
        return np.concatenate(parts), new_off

    prompt_tokens, prompt_off = cat(trace.prompt_tokens, trace.prompt_off)
    traj, traj_off = cat(trace.traj, trace.traj_off)
    pos = np.concatenate([np.arange(trace.traj_off[i], trace.traj_off[i + 1]) for i in sel])
    trees = {}
    for name, t in trace.trees.items():
        sizes = np.diff(t.off)[pos]
        starts = t.off[pos]
        node_idx = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, sizes)])
        off = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        trees[name] = TreeArrays(off, t.tokens[node_idx], t.parents[node_idx])
    header = dict(trace.header)
    prompts = dict(header["prompts"])
    prompts["ids"] = [ids[i] for i in sel]
    prompts["categories"] = [header["prompts"]["categories"][i] for i in sel]
    header["prompts"] = prompts
    return Trace(header, prompt_tokens, prompt_off, traj, traj_off, trace.feat[pos], trees)
