"""Measured step costs include the drafting time of a proposal made for the observation (draft features) and
reused by the step: ``Stepper.proposals`` times it, and ``BatchEngine.propose`` charges those seconds to the tree
cut from it. A fake clock that advances only while the n-gram drafter proposes makes the costs exact (no
wall-clock assertion): one proposal per step costs 1 s, verification 0 s."""

from __future__ import annotations

import types

import pytest

import env.batch
import env.step
from drafters.ngram import NGramDrafter
from env.arms import make_arms
from env.batch import BatchEngine
from env.features import FeatureSpec
from env.spec_env import SpecDecodeEnv
from env.workloads import Prompt
from tests.env.conftest import tiny_words, toy_cost_model
from tests.env.test_terminal_obs import motif_prompts


@pytest.fixture
def clock(monkeypatch):
    now = [0.0]
    fake = types.SimpleNamespace(perf_counter=lambda: now[0])
    monkeypatch.setattr(env.batch, "time", fake)
    monkeypatch.setattr(env.step, "time", fake, raising=False)
    propose = NGramDrafter.propose

    def slow(self, ctx, shape):
        now[0] += 1.0  # one second of drafting
        return propose(self, ctx, shape)

    monkeypatch.setattr(NGramDrafter, "propose", slow)
    return now


@pytest.fixture(scope="module")
def tiny():
    return tiny_words()


@pytest.mark.parametrize("draft_features", [False, True])
def test_a_measured_step_costs_its_drafting_even_when_the_observation_made_the_proposal(
    tiny, clock, draft_features
):
    prompts = [Prompt("p0", "toy", " ".join(map(str, motif_prompts(1)[0])))]
    e = SpecDecodeEnv("live", model=tiny, workload=prompts, cost_model=toy_cost_model("tiny-llama", "float32"),
                      arms=["ngram-d4"], max_new_tokens=20, cost="measured",
                      features=FeatureSpec(draft_features=draft_features))  # fmt: skip
    e.reset(seed=0)
    for _ in range(3):
        _, reward, te, tu, info = e.step(1)
        assert info["cost_s"] == 1.0 and e.last_wall_s == 1.0  # before the fix, 0 s with the draft features
        assert reward == pytest.approx(info["tokens"] * info["ar_cost_s"] / 1.0)
        if te or tu:
            break


def test_the_engine_charges_a_given_tree_its_given_seconds(tiny):
    engine = BatchEngine(tiny, max_rows=2)
    for p in motif_prompts(2):
        engine.admit(p, {"ngram": NGramDrafter()})
    arms = list(make_arms(["ngram-d4"]))[1:] * 2
    made, _ = engine.propose(arms)
    trees, draft_s = engine.propose(arms, [made[0], None], [0.25, 9.0])
    assert trees[0] is made[0] and draft_s[0] == 0.25  # given: its seconds
    assert draft_s[1] != 9.0  # drafted here: timed here, a given second for a tree not given is ignored
    assert engine.propose(arms, [made[0], None])[1][0] == 0.0  # no seconds given: 0, as before


def test_the_observations_proposals_are_charged_whichever_arm_runs(tiny, clock):
    """With draft features the observation proposes with every drafter of the menu each step, and a deployed policy
    reading them pays that too: a step without a draft costs the proposal's second; without the features, none."""
    prompts = [Prompt("p0", "toy", " ".join(map(str, motif_prompts(1)[0])))]
    for features, want in ((FeatureSpec(draft_features=True), 1.0), (FeatureSpec(), 0.0)):
        e = SpecDecodeEnv("live", model=tiny, workload=prompts, cost_model=toy_cost_model("tiny-llama", "float32"),
                          arms=["ngram-d4"], max_new_tokens=20, cost="measured", features=features)  # fmt: skip
        e.reset(seed=0)
        _, _, _, _, info = e.step(0)  # no draft
        assert info["cost_s"] == want and e.last_wall_s == want


def test_replay_prices_the_observations_proposals_as_live_does(tiny, tmp_path):
    """Priced by a cost model, a step with draft features costs the verification, the menu drafters' largest
    proposals and, for an arm not cut from one of them, its own drafting: live and replay of the same trace agree
    step by step, and the features add exactly the proposals' price."""
    from env.step import largest_shape
    from env.trace import load_trace
    from env.trace_record import record

    cm = toy_cost_model("tiny-llama", "float32")
    prompts = [Prompt("p0", "toy", " ".join(map(str, motif_prompts(1)[0])))]
    record(tiny, prompts, ["ngram"], tmp_path / "t.npz", max_new_tokens=16, progress=False)
    trace = load_trace(tmp_path / "t.npz")
    arms = ["ngram-d2", "ngram-d4-k2"]
    actions = [0, 1, 2, 1, 0, 2, 2, 1, 0, 1, 2, 2, 1, 0, 2]
    observe = cm.draft_cost(env.step.Arm("ngram", largest_shape(NGramDrafter())))
    costs = {}
    for features in (FeatureSpec(draft_features=True), FeatureSpec()):
        live = SpecDecodeEnv("live", model=tiny, workload=prompts, cost_model=cm, arms=arms, max_new_tokens=16,
                             features=features)  # fmt: skip
        replay = SpecDecodeEnv(trace=trace, cost_model=cm, arms=arms, features=features)
        for name, e in (("live", live), ("replay", replay)):
            e.reset(seed=0, options={"prompt_id": "p0"})
            seen = costs.setdefault((name, features.draft_features), [])
            for a in actions:
                _, _, te, tu, info = e.step(a)
                seen.append(info["cost_s"])
                if te or tu:
                    break
    for with_features in (True, False):
        assert costs[("live", with_features)] == pytest.approx(costs[("replay", with_features)], rel=1e-5)
    n = len(costs[("live", False)])
    for a, on, off in zip(actions, costs[("live", True)], costs[("live", False)]):
        own = (
            0.0 if a == 0 else cm.draft_cost(live.arms[a])
        )  # ngram is exact: its arms are cut from the proposal
        assert on == pytest.approx(off - own + observe, rel=1e-6)
    assert n > 3
