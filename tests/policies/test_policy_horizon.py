"""A trained policy records the ``max_new_tokens`` of its training env (``meta.max_new_tokens``: the horizon of
the ``position`` feature), and its decoder keeps that horizon whatever a run's length; a file without it (the
shipped policies, trained at the bundled trace's 128) sees each run's own ``max_new_tokens``, as before."""

from __future__ import annotations

import json

import numpy as np
import pytest

from experiments.cli import main
from experiments.policy_commands import policy_decoder
from policies import load_policy
from policies.base import PolicyError
from policies.static import StaticPolicy
from tests.env.conftest import tiny_words
from tests.env.test_terminal_obs import motif_prompts

ARMS = ["none", "ngram-d2", "ngram-d4"]


class Seen(StaticPolicy):
    """A static policy that keeps the observations it is shown."""

    def __init__(self, meta):
        super().__init__(ARMS, arm="ngram-d4")
        self.meta, self.seen = dict(meta), []

    def act(self, obs):
        self.seen.append(obs.copy())
        return super().act(obs)


@pytest.fixture(scope="module")
def tiny():
    return tiny_words()


def test_training_records_the_envs_max_new_tokens(tmp_path, capsys):
    from tests.policies.synthetic import synthetic_cost_model, synthetic_trace

    trace = synthetic_trace()
    trace.save(tmp_path / "trace.npz")
    synthetic_cost_model().save(tmp_path / "cost.json")
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(f'name = "h"\n[policies.static]\nkind = "static"\narms = {json.dumps(ARMS)}\n'
                   f'train = {{ trace = "{tmp_path / "trace.npz"}", cost_model = "{tmp_path / "cost.json"}", '
                   "test_per_category = 4 }\n")  # fmt: skip
    assert main(["train", str(cfg), "--out", str(tmp_path / "run"), "--json"]) == 0
    capsys.readouterr()
    meta = load_policy(tmp_path / "run" / "policies" / "static.zip").meta
    assert meta["max_new_tokens"] == trace.max_new_tokens != 128


def test_the_policy_decoder_keeps_the_training_horizon(tiny):
    prompt = motif_prompts(1)[0]
    trained = Seen({"max_new_tokens": 64})
    dec = policy_decoder(tiny, trained)
    assert dec.position_horizon == 64
    g = dec.generate(prompt, max_new_tokens=16)
    old = Seen({})  # no recorded horizon: the run's own max_new_tokens, as before
    assert policy_decoder(tiny, old).position_horizon is None
    policy_decoder(tiny, old).generate(prompt, max_new_tokens=16)
    assert len(trained.seen) == len(old.seen) == len(g.arms) > 1
    ratio = np.array([o[0] for o in old.seen[1:]]) / np.array([t[0] for t in trained.seen[1:]])
    assert np.allclose(ratio, 64 / 16)


@pytest.mark.parametrize("bad", [0, 2.5, True, "128"])
def test_a_recorded_horizon_that_is_no_positive_integer_is_one_line(tiny, bad):
    with pytest.raises(PolicyError, match="meta.max_new_tokens is not a positive integer"):
        policy_decoder(tiny, Seen({"max_new_tokens": bad}))


def test_the_shipped_policies_were_trained_at_the_bundled_traces_length():
    """Why a missing horizon may stand for the run's max_new_tokens: the shipped files were all trained on the
    bundled trace (meta.trace None), at its max_new_tokens 128, the decoder's default."""
    from env.trace import load_trace
    from experiments.policy_commands import shipped_policy_paths

    assert load_trace(None).max_new_tokens == 128
    for path in shipped_policy_paths():
        meta = load_policy(path).meta
        assert meta.get("trace") is None and meta.get("max_new_tokens") in (None, 128), path
