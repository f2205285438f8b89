"""The terminal observation of a live episode whose last step committed past its end (tokens accepted after the
end of sequence or past ``max_new_tokens``, which the episode does not count) is at the last counted token, as
replay's: it is what stable-baselines3 bootstraps a truncated episode's value from. The tiny target in fp64, so
that tree-vs-single-token rounding is far below the tolerance (the tiny target repeats its last token: the end of
sequence mid-path is in ``test_live_env.py``, on the embedded model)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from env.cost import FittedCostModel
from env.features import FeatureSpec
from env.spec_env import SpecDecodeEnv
from env.trace import load_trace
from env.trace_record import record
from env.workloads import Prompt
from tests.drafters.tiny import tiny_loaded
from tests.env.conftest import WordTokenizer, toy_cost_model

NEW = 40
ARMS = ["ngram-d8", "ngram-d4-k2"]
ATOL = 1e-5  # fp64 target: live and replay agree to ~2e-7 (the observation is float32); the defect was ~5e-3


def cost_model() -> FittedCostModel:
    return toy_cost_model("tiny-llama", "float64")


def motif_prompts(n: int = 4) -> list[list[int]]:
    """A few random tokens, then a motif repeated: greedy decoding loops and the n-gram drafter predicts it."""
    rng = np.random.default_rng(1)
    out = []
    for _ in range(n):
        motif = rng.integers(3, 90, size=int(rng.integers(3, 7))).tolist()
        out.append(rng.integers(3, 90, size=5).tolist() + motif * 4)
    return out


@pytest.fixture(scope="module")
def tiny64():
    loaded = tiny_loaded()
    loaded.model.double()
    loaded = loaded.replace(dtype=torch.float64)
    loaded._tokenizer = WordTokenizer()
    return loaded


@pytest.fixture(scope="module")
def trace(tiny64, tmp_path_factory):
    out = tmp_path_factory.mktemp("terminal") / "t.npz"
    prompts = [Prompt(f"p{i}", "toy", " ".join(map(str, p))) for i, p in enumerate(motif_prompts())]
    record(tiny64, prompts, ["ngram"], out, max_new_tokens=NEW, progress=False)
    return load_trace(out)


def episode(env, prompt_id: str, actions) -> list[np.ndarray]:
    obs, _ = env.reset(seed=0, options={"prompt_id": prompt_id})
    seen = [obs]
    for a in actions:
        obs, _, te, tu, _ = env.step(int(a))
        seen.append(obs)
        if te or tu:
            return seen
    raise AssertionError("the episode did not end")


@pytest.mark.parametrize("draft_features", [False, True])
def test_live_terminal_observation_equals_replay_when_cut_at_max_new_tokens(tiny64, trace, draft_features):
    spec = FeatureSpec(draft_features=draft_features)
    live = SpecDecodeEnv("live", model=tiny64, workload=trace, max_new_tokens=NEW, arms=ARMS,
                         cost_model=cost_model(), dtype="float64", features=spec)  # fmt: skip
    replay = SpecDecodeEnv(trace=trace, arms=ARMS, cost_model=cost_model(), features=spec)
    cut = 0
    for p, pid in enumerate(trace.prompt_ids):
        actions = np.random.default_rng(p).integers(len(ARMS), size=NEW)
        got = episode(live, pid, actions)
        seq = live._seq
        assert seq.truncated and len(seq.tokens) == NEW
        cut += len(seq.row.tokens) > seq.row.prompt_len + NEW  # the last step committed past max_new_tokens
        want = episode(replay, pid, actions)
        assert len(got) == len(want)
        for k, (a, b) in enumerate(zip(got, want)):
            assert np.allclose(a, b, rtol=0, atol=ATOL), (pid, k, np.abs(a - b).max())
    assert cut > 0  # the case under test happened
