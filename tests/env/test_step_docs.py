"""What the step object's and the env's docstrings state, pinned to the behaviour:

- with draft features, an ``exact_replay`` drafter (n-gram) proposes once per root (the step verifies the observed
  proposal, pruned), while one that does not replay exactly (suffix) proposes again for the step;
- ``info`` is deterministic except ``cost_s`` with ``cost="measured"``, the step's wall time."""

from __future__ import annotations

from collections import Counter

import pytest

import env.step
from drafters.ngram import NGramDrafter
from drafters.suffix import SuffixDrafter
from env.arms import make_arms
from env.decoder import SpeculativeDecoder
from env.features import FeatureSpec
from env.spec_env import SpecDecodeEnv
from env.workloads import Prompt
from tests.env.conftest import tiny_words, toy_cost_model
from tests.env.test_terminal_obs import motif_prompts


@pytest.fixture(scope="module")
def tiny():
    return tiny_words()


def test_only_exact_drafters_reuse_the_observed_proposal(tiny, monkeypatch):
    calls: Counter = Counter()
    for cls in (NGramDrafter, SuffixDrafter):
        orig = cls.propose

        def counted(self, ctx, shape, _orig=orig, _name=cls.__name__):
            calls[_name, len(ctx.tokens)] += 1
            return _orig(self, ctx, shape)

        monkeypatch.setattr(cls, "propose", counted)

    class Alternate:
        def __init__(self):
            self.n = 0

        def act(self, obs):
            self.n += 1
            return 1 + self.n % 2  # ngram-d4, suffix-d4, ...

    arms = list(make_arms(["ngram-d4", "suffix-d4"]))
    dec = SpeculativeDecoder(tiny, arms, policy=Alternate(), features=FeatureSpec(draft_features=True))
    g = dec.generate(motif_prompts(1)[0], max_new_tokens=24)
    assert {"ngram-d4", "suffix-d4"} <= set(g.arms)
    roots = {n: [c for (name, _), c in calls.items() if name == n] for n in ("NGramDrafter", "SuffixDrafter")}
    assert set(roots["NGramDrafter"]) == {1}  # once per root: observed, then pruned for the step
    assert 2 in roots["SuffixDrafter"]  # observed, then proposed again where the step used it
    doc = env.step.__doc__
    assert "each drafter proposes once per root" not in doc and "proposes again" in doc


def test_info_is_deterministic_except_the_measured_cost(tiny):
    prompts = [Prompt("p0", "toy", " ".join(map(str, motif_prompts(1)[0])))]
    infos = {}
    for cost in ("model", "measured"):
        e = SpecDecodeEnv("live", model=tiny, workload=prompts, arms=["ngram-d4"], max_new_tokens=20, cost=cost,
                          cost_model=toy_cost_model("tiny-llama", "float32"))  # fmt: skip
        runs = []
        for _ in range(2):
            e.reset(seed=0)
            _, _, _, _, info = e.step(1)
            runs.append(info)
            assert cost == "model" or info["cost_s"] == e.last_wall_s  # measured: the step's wall time
        infos[cost] = runs
    assert infos["model"][0] == infos["model"][1]
    a, b = infos["measured"]
    assert {k: v for k, v in a.items() if k != "cost_s"} == {k: v for k, v in b.items() if k != "cost_s"}
    assert 'except with ``cost="measured"``' in SpecDecodeEnv.__doc__
