"""The live env's arguments are checked before its model loads, and a closed env says so: an arm the cost model
cannot price (its step was taken, then the reward failed: the episode went on from a state the agent never saw), a
workload that is empty, not a workload, or holds one prompt id twice; the arm menu's mapping entries; the history a
drafter reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from drafters import DrafterError, TreeShape, make_drafter
from drafters.base import DraftContext
from env.arms import make_arms
from env.cost import CostModelError
from env.spec_env import EnvError, SpecDecodeEnv
from env.workloads import Prompt, WorkloadError
from tests.env.conftest import tiny_words, toy_cost_model
from tests.env.test_terminal_obs import motif_prompts


def _no_model(*_a, **_k):
    raise AssertionError("the model was loaded before the arguments were checked")


@pytest.fixture
def no_model(monkeypatch):
    import env.model

    monkeypatch.setattr(env.model, "load_model", _no_model)


def test_an_arm_the_cost_model_cannot_price_is_refused_before_the_model_loads(no_model):
    with pytest.raises(CostModelError, match="no calibration for drafter 'suffix'"):
        SpecDecodeEnv("live", arms=["ngram-d2", "suffix-d3"], max_new_tokens=8)


@pytest.mark.parametrize("draft_features", [False, True])
def test_a_measured_env_takes_an_arm_the_cost_model_lacks(draft_features):
    """Measured costs price no draft from the cost model (only the autoregressive unit), draft features or not."""
    tiny = tiny_words()
    prompts = [Prompt("p0", "toy", " ".join(map(str, motif_prompts(1)[0])))]
    e = SpecDecodeEnv("live", model=tiny, workload=prompts, arms=["suffix-d3"], max_new_tokens=6, cost="measured",
                      cost_model=toy_cost_model("tiny-llama", "float32"),
                      features={"draft_features": draft_features})  # fmt: skip
    e.reset(seed=0)
    for a in (1, 0, 1):
        _, reward, *_ = e.step(a)
        assert np.isfinite(reward)


@pytest.mark.parametrize(
    ("workload", "error", "match"),
    [
        ([], WorkloadError, "has no prompts"),
        (5, EnvError, "workload must be .* got int"),
        (["hello"], WorkloadError, "entry 0 is a str, not a Prompt"),
        (
            [Prompt("a", "chat", "hi"), Prompt("a", "chat", "ho")],
            WorkloadError,
            "prompt_id 'a' is used twice",
        ),
    ],
)
def test_a_bad_workload_is_refused_before_the_model_loads(no_model, workload, error, match):
    with pytest.raises(error, match=match):
        SpecDecodeEnv("live", arms=["ngram-d2"], workload=workload, max_new_tokens=8)


def test_a_closed_live_env_says_so():
    tiny = tiny_words()
    prompts = [Prompt("p0", "toy", " ".join(map(str, motif_prompts(1)[0])))]
    e = SpecDecodeEnv("live", model=tiny, workload=prompts, arms=["ngram-d2"], max_new_tokens=6,
                      cost_model=toy_cost_model("tiny-llama", "float32"))  # fmt: skip
    e.reset(seed=0)
    e.close()
    e.close()
    for call in (lambda: e.step(0), lambda: e.reset(seed=0)):
        with pytest.raises(EnvError, match="this env is closed"):
            call()


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ({"drafter": "bogus", "depth": 0}, "unknown drafter 'bogus'"),
        ({"drafter": 123, "depth": 0}, "drafter must be a drafter's name, got 123"),
        ({"drafter": None, "depth": 5, "topk": "x"}, "topk must be an integer, got 'x'"),
        ({"drafter": "ngram", "depth": 3, "budget": 1.5}, "budget must be an integer"),
    ],
)
def test_an_arm_mapping_is_checked_whole(entry, match):
    """An entry of depth 0 or no drafter is the arm none: its drafter and other fields were never read."""
    with pytest.raises(DrafterError, match=match):
        make_arms([entry])


def test_depth_zero_entries_are_the_arm_none():
    assert [a.name for a in make_arms([{"drafter": "ngram", "depth": 0}, "ngram-d2"])] == ["none", "ngram-d2"]
    with pytest.raises(
        DrafterError, match=r"\['none'\] more than once \(an entry of depth 0 is the arm none\)"
    ):
        make_arms([{"drafter": "ngram", "depth": 0}, "none"])


@pytest.mark.parametrize(
    ("tokens", "prompt_len", "match"),
    [
        ([], 0, "is empty"),
        (torch.tensor([1, 2, 1, 2, 1]), 1, "must be a list of token ids, got Tensor"),
        (np.array([1, 2, 1, 2, 1]), 1, "must be a list of token ids, got ndarray"),
        ([1.5, 2.5, 1.5], 1, "must be integer token ids, got 1.5"),
        ([1, True], 1, "must be integer token ids, got True"),
        ([1, -3, 2], 1, "holds id -3, outside the vocabulary"),
        ([1, 2**64, 2], 1, f"holds id {2**64}, outside the vocabulary"),
        ([1, 2, 3], 4, "prompt_len must be an integer in 0..3, got 4"),
        ([1, 2, 3], 1.0, "prompt_len must be an integer in 0..3, got 1.0"),
    ],
)
def test_a_drafters_history_is_checked(tokens, prompt_len, match):
    with pytest.raises(DrafterError, match=match):
        DraftContext(tokens=tokens, prompt_len=prompt_len)


def test_a_history_within_the_vocabulary_drafts_as_before():
    class Target:
        vocab_size = 10

    with pytest.raises(DrafterError, match=r"holds id 30, outside the vocabulary \(0..9\)"):
        DraftContext(tokens=[1, 2, 30, 1, 2], prompt_len=2, target=Target())  # type: ignore[arg-type]
    toks = [np.int64(1), 2, 1, 2, 1]
    ctx = DraftContext(tokens=toks, prompt_len=2)
    assert ctx.tokens is toks and all(type(t) is int for t in toks)  # the engine appends to the same list
    tree = make_drafter("ngram").propose(ctx, TreeShape(depth=2))
    assert tree.tokens.tolist() == [1, 2, 1]
