"""The draft features (``FeatureSpec(draft_features=True)``: the drafters' largest proposal at the root): replay
computes them from the recorded trees exactly as the live env and the decoder do from a fresh proposal, and
without the flag the observation is unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from env.decoder import SpeculativeDecoder
from env.features import FeatureSpec, draft_features
from env.spec_env import SpecDecodeEnv
from env.trace import load_trace
from env.trace_record import record
from env.workloads import load_workload

ARMS = ["none", "ngram-d2", "ngram-d8", "ngram-d4-k2"]
NEW = 24
SPEC = FeatureSpec(draft_features=True)


def test_tree_shape_of_a_proposal():
    assert np.allclose(draft_features([-1]), [0, 0])  # no proposal
    assert np.allclose(draft_features([-1, 0, 1, 2]), [1 / 8, 3 / 16])  # a chain of 3
    assert np.allclose(
        draft_features([-1, 0, 0, 1, 3, 2]), [2 / 8, 3 / 16]
    )  # two branches, the longer 3 deep


def test_replay_names_and_width_without_a_model():
    base, draft = SpecDecodeEnv(arms=ARMS), SpecDecodeEnv(arms=ARMS, features=SPEC)
    extra = [n for n in draft.feature_names if n not in base.feature_names]
    assert extra == ["draft/ngram/width", "draft/ngram/depth"]
    assert draft.observation_space.shape[0] == base.observation_space.shape[0] + 2
    obs_a, _ = base.reset(seed=0)
    obs_b, _ = draft.reset(seed=0)
    keep = [draft.feature_names.index(n) for n in base.feature_names]
    assert np.array_equal(obs_b[keep], obs_a)
    with pytest.raises(Exception, match="differ from the trace"):
        SpecDecodeEnv(arms=ARMS, features=FeatureSpec(match_max=4))


@pytest.mark.model
def test_replay_live_and_decoder_agree(fp32_model, tmp_path):
    prompts = [next(p for p in load_workload() if p.category == "summarization")]
    record(fp32_model, prompts, ["ngram"], tmp_path / "t.npz", max_new_tokens=NEW, progress=False)
    trace = load_trace(tmp_path / "t.npz")
    live = SpecDecodeEnv(
        "live", model=fp32_model, workload=prompts, max_new_tokens=NEW, arms=ARMS, features=SPEC
    )
    replay = SpecDecodeEnv(trace=trace, arms=ARMS, model=fp32_model, features=SPEC)
    actions = np.random.default_rng(5).integers(len(ARMS), size=NEW)
    seen_live, seen_replay = [], []
    for e, seen in ((live, seen_live), (replay, seen_replay)):
        obs, _ = e.reset(seed=0, options={"prompt_id": prompts[0].prompt_id})
        seen.append(obs)
        for a in actions:
            obs, _, term, trunc, _ = e.step(int(a))
            seen.append(obs)
            if term or trunc:
                break
    assert len(seen_live) == len(seen_replay)
    w = live.feature_names.index("draft/ngram/width")
    assert any(o[w] > 0 for o in seen_live)  # the drafter found something somewhere
    for a, b in zip(seen_live, seen_replay):
        assert np.allclose(a, b, atol=2e-3)

    class Fixed:
        def __init__(self):
            self.seen = []

        def act(self, obs):
            self.seen.append(obs)
            return int(actions[len(self.seen) - 1])

    policy = Fixed()
    dec = SpeculativeDecoder(fp32_model, list(live.arms), policy=policy, features=SPEC)
    dec.generate(prompts[0].text, max_new_tokens=NEW)
    assert dec.feature_names == list(live.feature_names)
    for a, b in zip(policy.seen, seen_live):
        assert np.allclose(a, b, atol=1e-6)
