"""The live env on the embedded model (fp32, greedy): both checkers pass without warnings, replay of a trace
recorded here reproduces the live env's accepted lengths exactly, the decoder computes the env's observations,
and recording resumes after a kill."""

from __future__ import annotations

import io
import warnings

import gymnasium as gym
import numpy as np
import pytest

import env as env_pkg
from env.decoder import SpeculativeDecoder
from env.spec_env import SpecDecodeEnv
from env.trace import TraceError, load_trace
from env.trace_record import record
from env.workloads import load_workload

pytestmark = pytest.mark.model

ARMS = ["ngram-d2", "ngram-d8", "ngram-d16", "ngram-d4-k2", "ngram-d8-k4-b24"]
NEW = 24


@pytest.fixture(scope="module")
def prompts():
    ps = load_workload()
    return [next(p for p in ps if p.category == c) for c in ("summarization", "rag")]


@pytest.fixture(scope="module")
def small_trace(fp32_model, prompts, tmp_path_factory):
    out = tmp_path_factory.mktemp("trace") / "t.npz"
    record(fp32_model, prompts, ["ngram"], out, max_new_tokens=NEW, progress=False)
    return load_trace(out)


def test_checkers_pass_without_warnings_live(fp32_model):
    from gymnasium.utils.env_checker import check_env
    from stable_baselines3.common.env_checker import check_env as sb3_check_env

    short = sorted(load_workload(), key=lambda p: len(p.text))[:2]  # short prompts: cheap resets
    e = gym.make(
        env_pkg.ENV_ID, backend="live", model=fp32_model, workload=short, max_new_tokens=3, arms=ARMS
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(e.unwrapped)
        sb3_check_env(e.unwrapped, warn=True)


def _episode(e, prompt_id, actions):
    obs, _ = e.reset(seed=0, options={"prompt_id": prompt_id})
    steps = [(obs, None)]
    for a in actions:
        obs, r, term, trunc, info = e.step(int(a))
        steps.append((obs, info))
        if term or trunc:
            break
    return steps


def test_replay_matches_live_exactly(fp32_model, prompts, small_trace):
    live = SpecDecodeEnv("live", model=fp32_model, workload=prompts, max_new_tokens=NEW, arms=ARMS)
    replay = SpecDecodeEnv(trace=small_trace, arms=ARMS, model=fp32_model)
    rng = np.random.default_rng(7)
    for p in prompts:
        actions = rng.integers(len(live.arms), size=NEW)
        a, b = _episode(live, p.prompt_id, actions), _episode(replay, p.prompt_id, actions)
        assert [s[1] and (s[1]["accepted"], s[1]["tokens"]) for s in a] == [
            s[1] and (s[1]["accepted"], s[1]["tokens"]) for s in b
        ]
        assert sum(s[1]["accepted"] for s in a[1:]) > 0  # drafts were accepted somewhere
        for (oa, ia), (ob, _) in zip(a, b):
            # the same, the terminal observation included, up to tree-vs-single-token rounding (~1e-6)
            assert np.allclose(oa, ob, rtol=0, atol=1e-4)
            if ia is not None:
                assert ia["cost_s"] > 0 and ia["ar_cost_s"] > 0


def test_terminal_observation_after_an_end_of_sequence_accepted_mid_path(fp32_model, prompts):
    """A drafted step accepts the end-of-sequence token inside its path and commits tokens past it: the observation
    after it is the one an autoregressive run (one token a step, nothing past the end) shows at the same position
    (test_terminal_obs.py: the cut at max_new_tokens, against replay)."""
    from drafters import make_drafter
    from env.batch import BatchEngine
    from env.decoder import chat_prompt
    from env.engine import NO_DRAFT, parse_arm
    from env.features import FeatureSpec
    from env.step import Stepper

    spec = FeatureSpec(draft_features=True)
    engine = BatchEngine(fp32_model, max_rows=1)
    menu = [NO_DRAFT, parse_arm("ngram-d16")]
    ids = chat_prompt(fp32_model.tokenizer, prompts[1].text)

    def run(arm: int, eos: frozenset[int]):
        st = Stepper(engine, menu, features=spec)
        engine.target.eos_ids = eos
        seq = st.start(ids, NEW, {"ngram": make_drafter("ngram")})
        commits = []
        while not seq.done:
            (out,) = st.step([arm])
            commits.append(len(out.result.committed))
        return st, seq, commits

    default = engine.target.eos_ids
    try:
        st, seq, commits = run(1, default)
        text, starts = seq.tokens, np.cumsum([1, *commits])[:-1]  # where each step's tokens begin
        st.retire(seq)
        # the end of sequence: a token first seen inside an accepted path, before its last token
        inside = [i for s, n in zip(starts, commits) for i in range(s, s + n - 1)]  # not a path's last token
        at = next(i for i in inside if text[i] not in text[:i])
        eos = frozenset({text[at]})
        st, seq, _ = run(1, eos)
        assert seq.terminated and seq.tokens == text[: at + 1]
        assert len(seq.row.tokens) > seq.row.prompt_len + len(seq.tokens)  # the step committed past the end
        got = st.observe(seq)
        st.retire(seq)
        st_ar, seq_ar, _ = run(0, eos)
        assert seq_ar.tokens == seq.tokens
        want = st_ar.observe(seq_ar)
        st_ar.retire(seq_ar)
    finally:
        engine.target.eos_ids = default
    n = 1 + 4 + spec.proj_dim + 2  # position, position features, draft/ngram/width and depth: not the history
    assert np.allclose(got[:n], want[:n], rtol=0, atol=1e-4), np.abs(got[:n] - want[:n]).max()


class _Replay:
    """A policy that plays a fixed arm sequence and keeps the observations it was shown."""

    def __init__(self, actions):
        self.actions, self.seen = list(actions), []

    def act(self, obs):
        self.seen.append(obs)
        return self.actions[len(self.seen) - 1]


def test_decoder_shows_the_policy_the_env_observation(fp32_model, prompts, small_trace):
    live = SpecDecodeEnv("live", model=fp32_model, workload=prompts, max_new_tokens=NEW, arms=ARMS)
    actions = np.random.default_rng(3).integers(len(live.arms), size=NEW)
    steps = _episode(live, prompts[0].prompt_id, actions)
    policy = _Replay(actions)
    dec = SpeculativeDecoder(fp32_model, list(live.arms), policy=policy)
    g = dec.generate(prompts[0].text, max_new_tokens=NEW)
    assert g.token_ids == small_trace.trajectory(0)
    assert dec.feature_names == list(live.feature_names)
    assert len(policy.seen) == len(steps) - 1
    for obs, (env_obs, _) in zip(policy.seen, steps):
        assert np.allclose(obs, env_obs, atol=1e-6)


def test_measured_cost_and_a_trace_for_another_model(fp32_model, prompts, toy_trace):
    e = SpecDecodeEnv("live", model=fp32_model, workload=prompts[:1], max_new_tokens=4, cost="measured")
    e.reset(seed=0)
    _, r, *_, info = e.step(3)
    assert info["cost_s"] == e.last_wall_s and r == pytest.approx(
        info["tokens"] * info["ar_cost_s"] / info["cost_s"]
    )
    with pytest.raises(TraceError, match="recorded for model toy"):
        SpecDecodeEnv(trace=toy_trace, model=fp32_model)


def test_record_resumes_after_a_kill(fp32_model, prompts, tmp_path, monkeypatch):
    import env.trace_record as trace_mod

    calls = []
    real = trace_mod.record_prompt

    def dies_on_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    out = tmp_path / "r.npz"
    monkeypatch.setattr(trace_mod, "record_prompt", dies_on_second)
    with pytest.raises(KeyboardInterrupt):
        record(fp32_model, prompts, ["ngram"], out, max_new_tokens=6, progress=False)
    assert trace_mod.part_progress(out) == 1 and not out.exists()
    with pytest.raises(TraceError, match="other settings.*max_new_tokens"):
        record(fp32_model, prompts, ["ngram"], out, max_new_tokens=7, progress=False)
    source = (
        tmp_path / "workload.jsonl"
    )  # the workload file's bytes are part of the settings: an edit is refused
    source.write_text("one version\n")
    with pytest.raises(KeyboardInterrupt):
        calls.clear()
        record(fp32_model, prompts, ["ngram"], tmp_path / "w.npz", max_new_tokens=6, progress=False,
               workload=str(source))  # fmt: skip
    source.write_text("another version\n")
    with pytest.raises(TraceError, match="other settings.*workload_sha256"):
        record(fp32_model, prompts, ["ngram"], tmp_path / "w.npz", max_new_tokens=6, progress=False,
               workload=str(source))  # fmt: skip
    monkeypatch.setattr(trace_mod, "record_prompt", real)
    calls.clear()
    monkeypatch.setattr(trace_mod, "record_prompt", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    trace = record(fp32_model, prompts, ["ngram"], out, max_new_tokens=6, progress=False)
    assert len(calls) == 1 and trace.num_prompts == 2 and out.exists()
    assert not out.with_name(out.name + ".parts").exists()
    back = load_trace(out)
    assert back.header["model"]["model_id"] == "smollm2-135m-instruct" and back.drafters["ngram"]["exact"]
    assert np.array_equal(back.traj, trace.traj) and back.feat.shape == (back.traj.shape[0], 12)


def test_a_resumed_recording_keeps_the_probes_state(fp32_model, tmp_path, monkeypatch):
    """Probes whose state outlives a prompt (the recycling table, the suffix answer cache) go on after a kill as
    they were: the resumed trace equals the uninterrupted one; without their saved state the prompts are recorded
    again from fresh probes, and a hostile state file is refused in one line."""
    import env.trace_record as trace_mod

    three = load_workload()[:3]
    probes, new = ["suffix", "recycling"], 8
    whole = record(fp32_model, three, probes, tmp_path / "whole.npz", max_new_tokens=new, progress=False)
    alone = record(fp32_model, three[2:], probes, tmp_path / "alone.npz", max_new_tokens=new, progress=False)

    def trees(t, name, i):
        tr = t.trees[name]
        lo, hi = int(t.traj_off[i]), int(t.traj_off[i + 1])
        a, b = int(tr.off[lo]), int(tr.off[hi])
        return tr.tokens[a:b].tolist(), tr.parents[a:b].tolist()

    # the state matters: the third prompt's recycling proposals differ from fresh probes'
    assert trees(whole, "recycling", 2) != trees(alone, "recycling", 0)

    real, calls = trace_mod.record_prompt, []

    def dies_on_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    out = tmp_path / "r.npz"
    monkeypatch.setattr(trace_mod, "record_prompt", dies_on_third)
    with pytest.raises(KeyboardInterrupt):
        record(fp32_model, three, probes, out, max_new_tokens=new, progress=False)
    parts = out.with_name(out.name + ".parts")
    assert trace_mod.part_progress(out) == 2 and (parts / trace_mod.PROBES_FILE).is_file()
    saved = (parts / trace_mod.PROBES_FILE).read_bytes()
    bad = dict(np.load(parts / trace_mod.PROBES_FILE))
    bad["recycling/ids"] = bad["recycling/ids"] + 10**6
    np.savez(parts / trace_mod.PROBES_FILE, **bad)
    with pytest.raises(TraceError, match="probes.npz: recycling state: a token id outside"):
        record(fp32_model, three, probes, out, max_new_tokens=new, progress=False)
    # state no run on this target could have saved: refused naming the file before a prompt is recorded, not at
    # the first proposal (an id past the vocabulary) or dropped for an empty table (a table of another size)
    vocab = int(fp32_model.config.vocab_size)
    good = dict(np.load(io.BytesIO(saved)))
    answers = good["suffix/answers"].copy()
    answers[0] = vocab
    small = {
        "recycling/ids": good["recycling/ids"][:100].clip(-1, 99),
        "recycling/logp": good["recycling/logp"][:100],
    }
    for bad, needle in (({"suffix/answers": answers}, f"suffix state: token id {vocab} is outside the target's vocabulary"),
                        (small, f"recycling state: a table of 100 token ids, not the target's vocabulary of {vocab}")):  # fmt: skip
        np.savez(parts / trace_mod.PROBES_FILE, **{**good, **bad})
        calls.clear()
        with pytest.raises(TraceError, match=f"probes.npz: {needle}") as err:
            record(fp32_model, three, probes, out, max_new_tokens=new, progress=False)
        assert calls == [] and "\n" not in str(err.value)
    (parts / trace_mod.PROBES_FILE).write_bytes(saved)

    calls.clear()
    monkeypatch.setattr(trace_mod, "record_prompt", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    resumed = record(fp32_model, three, probes, out, max_new_tokens=new, progress=False)
    assert len(calls) == 1  # only the third prompt was recorded again
    for name in probes:
        for arr in ("off", "tokens", "parents"):
            assert np.array_equal(getattr(resumed.trees[name], arr), getattr(whole.trees[name], arr)), (
                name,
                arr,
            )

    # a kill before the first state was saved: everything again, from fresh probes
    calls.clear()
    out2 = tmp_path / "r2.npz"
    monkeypatch.setattr(trace_mod, "record_prompt", dies_on_third)
    with pytest.raises(KeyboardInterrupt):
        record(fp32_model, three, probes, out2, max_new_tokens=new, progress=False)
    (out2.with_name(out2.name + ".parts") / trace_mod.PROBES_FILE).unlink()
    calls.clear()
    monkeypatch.setattr(trace_mod, "record_prompt", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    again = record(fp32_model, three, probes, out2, max_new_tokens=new, progress=False)
    assert len(calls) == 3 and np.array_equal(
        again.trees["recycling"].tokens, whole.trees["recycling"].tokens
    )


def test_live_sampling_is_reproducible_from_the_seed(fp32_model, prompts):
    e = SpecDecodeEnv(
        "live",
        model=fp32_model,
        workload=prompts,
        max_new_tokens=8,
        arms=ARMS,
        sampling={"temperature": 0.8, "top_p": 0.95},
    )
    actions = [2, 3, 1, 5, 4, 2, 3, 1]
    a = _episode(e, prompts[1].prompt_id, actions)
    b = _episode(e, prompts[1].prompt_id, actions)

    assert len(a) == len(b)
    assert all(np.array_equal(x[0], y[0]) and x[1] == y[1] for x, y in zip(a, b))


@pytest.mark.model
def test_a_seeded_reset_repeats_the_episode_with_a_drafter_that_learns_across_requests(fp32_model):
    """The suffix drafter's cross-request cache carried one episode's answers into the next: the same seed and
    actions gave other observations and rewards. A seeded reset starts such drafters afresh."""
    env = SpecDecodeEnv(
        "live",
        model=fp32_model,
        arms=["none", "suffix-d4"],
        max_new_tokens=8,
        workload="builtin",
        cost="measured",
    )  # (rewards are wall times: observations compared)

    def episode(seed):
        obs, _ = env.reset(seed=seed)
        out, done = [obs], False
        while not done:
            obs, _, term, trunc, _ = env.step(1)
            out.append(obs)
            done = term or trunc
        return out

    first = episode(3)
    episode(4), episode(5)
    again = episode(3)
    assert len(first) == len(again) and all(np.array_equal(a, b) for a, b in zip(first, again))
