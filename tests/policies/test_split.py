"""Train/test splits by prompt and sub-traces."""

from __future__ import annotations

import numpy as np

from env.replay import arm_columns
from policies.split import split_prompts, subset_trace, trace_split


def test_split_is_by_prompt_per_category_and_seeded(synth_trace):
    s = trace_split(synth_trace, test_per_category=4, seed=0)
    assert not set(s.train) & set(s.test)
    assert set(s.train) | set(s.test) == set(synth_trace.prompt_ids)
    cats = dict(zip(synth_trace.prompt_ids, synth_trace.header["prompts"]["categories"]))
    assert sorted(cats[p] for p in s.test) == ["copy"] * 4 + ["free"] * 4
    assert trace_split(synth_trace, 4, seed=0) == s and trace_split(synth_trace, 4, seed=1) != s


def test_small_categories_keep_half_for_training():
    s = split_prompts(["a", "b", "c"], ["x", "x", "y"], test_per_category=5)
    assert len(s.test) == 1 and set(s.train) == {"a", "b", "c"} - set(s.test)


def test_subset_trace_replays_like_the_original(synth_trace):
    from env.engine import parse_arm

    keep = synth_trace.prompt_ids[3:9:2]
    sub = subset_trace(synth_trace, keep)
    assert sub.prompt_ids == keep
    arm = parse_arm("ngram-d8")
    full_acc, full_dr, _, _ = arm_columns(synth_trace, arm)
    acc, dr, _, _ = arm_columns(sub, arm)
    pos = np.concatenate([np.arange(synth_trace.traj_off[i], synth_trace.traj_off[i + 1]) for i in (3, 5, 7)])
    assert np.array_equal(acc, full_acc[pos]) and np.array_equal(dr, full_dr[pos])
    assert np.array_equal(sub.feat, synth_trace.feat[pos])
