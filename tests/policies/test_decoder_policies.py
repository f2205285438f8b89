"""Policies plugged into the live decoder (embedded model, fp32): the output stays the greedy text whatever the
policy picks, online learners get the env's reward and info every step, the observation has the env's size, and
``draftgym generate --policy`` / ``bench --policy`` run a saved file."""

from __future__ import annotations

import json

import pytest

from env.decoder import SpeculativeDecoder, chat_prompt
from env.engine import NO_DRAFT, parse_arm
from env.workloads import load_workload
from policies.bandits import UCB1
from policies.linucb import LinUCB

pytestmark = pytest.mark.model

ARMS = ["none", "ngram-d2", "ngram-d8", "ngram-d6-k3-b12"]


class Recorder(UCB1):
    """UCB1 that keeps what the decoder hands it."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.seen = []

    def update(self, obs, action, reward, info=None):
        self.seen.append((obs, action, reward, info))
        super().update(obs, action, reward, info)


@pytest.fixture(scope="module")
def prompt_ids(fp32_model):
    text = next(p for p in load_workload() if p.category == "summarization").text
    return chat_prompt(fp32_model.tokenizer, text)


def test_a_bandit_changes_the_speed_not_the_text(fp32_model, prompt_ids):
    expected = SpeculativeDecoder(fp32_model, [NO_DRAFT]).generate(prompt_ids, max_new_tokens=48).token_ids
    policy = Recorder(ARMS, scale=4.0)
    dec = SpeculativeDecoder(fp32_model, [parse_arm(a) for a in ARMS], policy=policy)
    g = dec.generate(prompt_ids, max_new_tokens=48)
    assert g.token_ids == expected
    assert len(policy.seen) == g.stats.steps - 1 and len(set(g.arms)) > 1  # every arm tried (round robin)
    for obs, action, reward, info in policy.seen:
        assert obs.shape == (len(dec.feature_names),) and 0 <= action < len(ARMS)
        assert set(info) >= {"tokens", "accepted", "drafted", "cost_s", "ar_cost_s", "arm"}
        assert info["arm"] == ARMS[action] and reward == pytest.approx(
            info["tokens"] * info["ar_cost_s"] / info["cost_s"]
        )
    assert sum(i["tokens"] for *_, i in policy.seen) == len(expected) - 1  # the first token is the prefill's


def test_a_contextual_bandit_reads_the_decoders_observation(fp32_model, prompt_ids, tmp_path):
    from policies.static import StaticPolicy

    names = SpeculativeDecoder(
        fp32_model, [parse_arm(a) for a in ARMS], policy=StaticPolicy(ARMS, arm="none")
    ).feature_names
    policy = LinUCB(ARMS, len(names), names, alpha=0.5, scale=4.0)
    dec = SpeculativeDecoder(fp32_model, [parse_arm(a) for a in ARMS], policy=policy)
    dec.generate(prompt_ids, max_new_tokens=32)
    assert policy.pulls.sum() > 0
    path = tmp_path / "linucb.zip"
    policy.save(path)

    from experiments.cli import main

    out = tmp_path / "gen.json"
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["generate", "Summarize: the cat sat on the mat. The cat sat.", "--policy", str(path),
                     "--max-new-tokens", "16", "--dtype", "fp32", "--json"])  # fmt: skip
    assert code == 0
    row = json.loads(buf.getvalue())
    assert row["stats"]["new_tokens"] >= 1 and set(row["arms"]) <= set(ARMS)
    out.write_text(buf.getvalue())


def test_generate_refuses_a_policy_for_other_features(fp32_model, tmp_path, capsys):
    path = tmp_path / "bad.zip"
    LinUCB(ARMS, 7, [f"f{i}" for i in range(7)]).save(path)
    from experiments.cli import main

    code = main(["generate", "hello", "--policy", str(path), "--dtype", "fp32"])
    err = capsys.readouterr().err
    assert code == 2 and "expects observations of size 7" in err and err.count("\n") == 1


@pytest.mark.parametrize("flags", [["--drafter", "ngram"], ["--depth", "3", "--topk", "2"]])
def test_generate_refuses_an_arm_beside_a_policy(tmp_path, capsys, flags):
    """The policy picks the arm: an arm given beside it was ignored silently; now it is refused up front."""
    from experiments.cli import main

    code = main(["generate", "hello", "--policy", str(tmp_path / "p.zip"), *flags])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "and --policy: the policy picks the arm every step" in err
    assert flags[0] in err


def test_an_online_policy_over_drafters_the_cost_model_never_calibrated(fp32_model, prompt_ids):
    """The shipped fp32 cost model calibrated only ngram: a bandit over recycling and eagle arms used to stop with
    CostModelError; the decoder then rewards every step with measured wall time."""
    from env.cost import load_cost_model

    arms = ["none", "recycling-d2", "ngram-d2", "eagle-d2"]
    assert not load_cost_model().covers([parse_arm(a) for a in arms])
    policy = Recorder(arms, scale=4.0)
    dec = SpeculativeDecoder(fp32_model, [parse_arm(a) for a in arms], policy=policy)
    g = dec.generate(prompt_ids, max_new_tokens=16)
    assert len(policy.seen) == g.stats.steps - 1 >= len(arms)
    assert all(
        i["cost_s"] == i["wall_s"] > 0 for *_, i in policy.seen
    )  # measured, the same unit for every arm


def test_bench_times_an_online_policy_from_its_loaded_state(fp32_model, tmp_path):
    """The untimed warm-up runs on a copy of an online policy: the first timed generation starts from the policy
    as loaded (it used to start from what the warm-up had taught it)."""
    from experiments.bench import run_bench

    class Counting(UCB1):
        starts: list[int]

        def reset(self):
            self.starts.append(int(self.stats.counts.sum()))
            super().reset()

    policy = Counting(ARMS, scale=4.0)
    policy.starts = []
    dec = SpeculativeDecoder(fp32_model, [parse_arm(a) for a in ARMS], policy=policy)
    prompts = load_workload()[:1]
    run_bench(fp32_model, prompts, ["policy:c"], max_new_tokens=6, out_dir=tmp_path, settings={},
              progress=False, decoders={"policy:c": dec})  # fmt: skip
    assert dec.policy.starts[-1] == 0  # the timed run began with no step learned


def test_a_policy_learns_live_from_the_cost_model_it_was_trained_with(fp32_model, tmp_path):
    """``evaluate --cost-model X`` trained and scored replay with X, but the live decoder fed the online policy the
    rewards of the shipped cost model: it now prices live steps with the cost model named in the policy's file."""
    from dataclasses import replace

    from experiments.policy_commands import policy_decoder
    from tests.policies.synthetic import synthetic_cost_model

    cm = replace(synthetic_cost_model(per_node=0.5), model_id=fp32_model.model_id, dtype="float32")
    path = cm.save(tmp_path / "cost.json")
    policy = UCB1(ARMS, scale=4.0)
    policy.meta = {"cost_model": str(path)}
    dec = policy_decoder(fp32_model, policy)
    assert dec.costs.cost_model is not None and dec.costs.cost_model.chain.seconds == cm.chain.seconds
    policy.meta = {"cost_model": None}  # none named: the shipped one, as before
    assert policy_decoder(fp32_model, policy).costs.cost_model.chain.seconds != cm.chain.seconds


@pytest.mark.parametrize("choice", [1.9, "1", None, 7])
def test_a_policys_choice_that_is_no_arm_index_is_refused_not_truncated(fp32_model, prompt_ids, choice):
    class Picks:
        def act(self, obs):
            return choice

    dec = SpeculativeDecoder(fp32_model, [parse_arm(a) for a in ARMS], policy=Picks())
    with pytest.raises(ValueError, match="the policy's choice: action .* arm index"):
        dec.generate(prompt_ids, max_new_tokens=4)


def test_a_shipped_policy_plugs_in_as_the_readme_says_and_a_mismatch_is_refused_at_once(
    fp32_model, prompt_ids
):
    """``SpeculativeDecoder(loaded, arms=list(env.unwrapped.arms), policy=load_policy(shipped))`` failed at its
    first step ("expects an observation of size 23, got 21"): the shipped policies were trained with draft
    features, which the decoder's default observation lacks. The decoder now takes the policy's own feature spec,
    and a policy of another observation size or arm menu is refused as the decoder is built."""
    from pathlib import Path

    import gymnasium

    import env  # noqa: F401 (registers the env ids)
    from env.features import FeatureSpec
    from policies import load_policy

    pol = load_policy(Path(__file__).resolve().parents[2] / "policies" / "data" / "predictor.zip")
    arms = list(gymnasium.make("draftgym/SpecDecode-v0").unwrapped.arms)
    assert pol.obs_size != len(SpeculativeDecoder(fp32_model, [NO_DRAFT]).feature_names)  # the case in point
    dec = SpeculativeDecoder(fp32_model, arms=arms, policy=pol)
    ar = SpeculativeDecoder(fp32_model, [NO_DRAFT]).generate(prompt_ids, max_new_tokens=12)
    assert dec.generate(prompt_ids, max_new_tokens=12).token_ids == ar.token_ids
    with pytest.raises(
        ValueError, match=f"expects observations of size {pol.obs_size}, but this decoder gives"
    ):
        SpeculativeDecoder(fp32_model, arms=arms, policy=pol, features=FeatureSpec())
    with pytest.raises(ValueError, match="trained for arms"):
        SpeculativeDecoder(fp32_model, arms=arms[:2], policy=pol)
    other_spelling = ["ar", "ngram-d4-k1"]  # the menu ["none", "ngram-d4"] as a user may write it
    SpeculativeDecoder(fp32_model, arms=other_spelling, policy=UCB1(other_spelling))
