"""Replay up to the end of the context, as live: a tree that no longer fits the room left (``max_context`` - past
length, ``env.batch.BatchEngine.propose``) is the root alone that step (nothing drafted or accepted, one token, priced
as a one-node chain). The trace records ``max_context``; the single env's replay and the serving simulator both read
it (fp32, the tiny target: 512 positions)."""

from __future__ import annotations

import numpy as np
import pytest

from drafters import make_drafter
from env.batch import BatchEngine
from env.cost import FittedCostModel
from env.engine import NO_DRAFT, parse_arm
from env.replay import build_tables, replay_accept
from env.serve_sim import ServeSim
from env.spec_env import SpecDecodeEnv
from env.step import Stepper
from env.trace import TraceError, load_trace
from env.workloads import Prompt
from tests.env.conftest import SERVE_COST, make_trace, tiny_words, toy_cost_model

LOOP = [7, 21, 4, 60, 33, 12, 9, 51]
NEAR = (LOOP * 70)[:490]  # 22 positions left: the loop makes the n-gram drafter propose deep trees there
SHORT = LOOP * 3
NEW = 60
ARMS = ["none", "ngram-d8", "ngram-d4-k4-b16"]


def cost_model() -> FittedCostModel:
    return toy_cost_model("tiny-llama", "float32")


@pytest.fixture(scope="module")
def tiny():
    return tiny_words()


@pytest.fixture(scope="module")
def near_trace(tiny, tmp_path_factory):
    from env.trace_record import record

    out = tmp_path_factory.mktemp("ctx") / "near.npz"
    prompts = [Prompt(f"p{i}", "toy", " ".join(map(str, p))) for i, p in enumerate([NEAR, SHORT])]
    record(tiny, prompts, ["ngram"], out, max_new_tokens=NEW, progress=False)
    return out


def play(env, arm: int, prompt_id: str):
    """Every step of one episode with ``arm``: its (accepted, tokens, drafted, terminated, truncated), rewards and
    observations."""
    obs, _ = env.reset(seed=0, options={"prompt_id": prompt_id})
    steps, seen, rewards = [], [obs], []
    while True:
        obs, r, te, tu, info = env.step(arm)
        steps.append((info["accepted"], info["tokens"], info["drafted"], te, tu))
        seen.append(obs)
        rewards.append(float(r))
        if te or tu:
            return steps, np.array(rewards), seen


def test_the_trace_records_the_context_it_was_decoded_in(near_trace):
    trace = load_trace(near_trace)
    assert trace.max_context == trace.header["max_context"] == 512
    assert len(trace.trajectory(0)) < NEW  # prompt p0 ended by the context, not by max_new_tokens
    assert len(trace.prompt(0)) + len(trace.trajectory(0)) - 1 == 512


@pytest.mark.parametrize("arm", ["ngram-d8", "ngram-d4-k4-b16"])
def test_replay_equals_live_to_the_context_end(tiny, near_trace, arm):
    trace = load_trace(near_trace)
    k = ARMS.index(arm)
    for pid in ("p0", "p1"):  # at the context's end, and with room to spare
        live = SpecDecodeEnv("live", model=tiny, workload=trace, max_new_tokens=NEW, arms=ARMS,
                             cost_model=cost_model())  # fmt: skip
        replay = SpecDecodeEnv(trace=trace, arms=ARMS, cost_model=cost_model())
        want, want_r, want_obs = play(live, k, pid)
        got, got_r, got_obs = play(replay, k, pid)
        if pid == "p0":  # live gave the arm the root alone near the end, then ran out of context (truncated)
            assert (0, 1, 0) in [s[:3] for s in want] and want[-1][-1]
        assert got == want
        assert np.allclose(got_r, want_r, rtol=1e-5)  # (a cut step: priced as one node, as live)
        assert len(got_obs) == len(want_obs)
        # (p1's last one included: cut at max_new_tokens, the live observation reads the last counted position)
        assert all(np.allclose(a, b, atol=1e-5) for a, b in zip(got_obs, want_obs))


def live_rows(tiny, prompt: list[int], arm: str) -> list[tuple[int, int, int]]:
    """(tokens, accepted, drafted) of each step of one row decoded alone with ``arm`` on the batch engine."""
    menu = [NO_DRAFT, parse_arm(arm)]
    st = Stepper(BatchEngine(tiny, max_rows=1), menu)
    seq = st.start(prompt, NEW, {"ngram": make_drafter("ngram")})
    rows = []
    while not seq.done:
        (out,) = st.step([1])
        rows.append((out.info["tokens"], out.info["accepted"], out.info["drafted"]))
    return rows


@pytest.mark.parametrize("arm", ["ngram-d8", "ngram-d4-k4-b16"])
def test_the_serving_replay_cuts_trees_as_the_live_engine(tiny, near_trace, arm):
    trace = load_trace(near_trace)
    want = live_rows(tiny, NEAR, arm)
    assert (1, 0, 0) in want  # the live engine gave this arm the root alone near the context's end
    sim = ServeSim(1, trace=trace, arms=ARMS, cost=SERVE_COST, max_batch=1, requests=1, loads=["1"])
    sim.set_requests(0, [0], [0.0], [1], closed=True)
    got, nodes = [], []
    while not sim.done()[0]:
        _, o = sim.step(np.array([ARMS.index(arm)]))
        got.append((int(o["tok"][0, 0]), int(o["acc"][0, 0]), int(o["dr"][0, 0])))
        nodes.append(int(o["nodes"][0]))
    assert got == want
    assert all(n == dr + 1 for n, (_, _, dr) in zip(nodes, got))  # a cut step is a one-node forward


# ---- the rule on a synthetic trace (no model) -----------------------------------------------------------------------


@pytest.mark.parametrize("max_context", [30, 40, 55])
def test_build_tables_cuts_exactly_the_trees_that_do_not_fit(max_context):
    trace = make_trace(seed=3, prompts=4, max_new=40)
    trace.header["max_context"] = max_context
    arms = [parse_arm(a) for a in ("none", "ngram-d2", "ngram-d8", "ngram-d4-k4-b16")]
    tb = build_tables(trace, arms, toy_cost_model())
    cm = toy_cost_model()
    cuts = 0
    for p in range(trace.num_prompts):
        a, b = int(trace.traj_off[p]), int(trace.traj_off[p + 1])
        plen = len(trace.prompt(p))
        for g in range(a, b):
            context = plen + g - a
            toks, pars = trace.trees["ngram"].at(g)
            for k, arm in enumerate(arms):
                acc, dr, chain, rej = replay_accept(toks, pars, trace.traj[g + 1 : b].tolist(), arm)
                if dr + 1 > max_context - context:  # live: the root alone
                    acc, dr, chain, rej = 0, 0, True, False
                    cuts += 1
                assert (tb.accept[k, g], tb.drafted[k, g], bool(tb.rejected[k, g])) == (acc, dr, rej)
                want = cm.step_cost(arm, dr + 1, context, chain)
                assert np.isclose(tb.cost[k, g], want, rtol=1e-6)
    assert cuts > 0


def test_a_trace_without_max_context_replays_unlimited():
    trace = make_trace(seed=3, prompts=4, max_new=40)
    assert "max_context" not in trace.header and trace.max_context is None
    arms = [parse_arm("ngram-d8")]
    free = build_tables(trace, arms, toy_cost_model())
    trace2 = make_trace(seed=3, prompts=4, max_new=40)
    trace2.header["max_context"] = 1 << 20
    roomy = build_tables(trace2, arms, toy_cost_model())
    assert np.array_equal(free.tokens, roomy.tokens) and np.array_equal(free.drafted, roomy.drafted)
    assert free.drafted.max() > 0


@pytest.mark.parametrize("bad", [0, -5, "512", 1.5, True, None])
def test_load_trace_checks_max_context(tmp_path, bad):
    trace = make_trace(seed=3, prompts=2, max_new=10)
    trace.header["max_context"] = bad
    path = trace.save(tmp_path / "bad.npz")
    with pytest.raises(TraceError, match="max_context"):
        load_trace(path)


def test_load_trace_refuses_a_trajectory_past_its_max_context(tmp_path):
    trace = make_trace(seed=3, prompts=2, max_new=10)
    reach = int((trace.prompt_len + np.diff(trace.traj_off) - 1).max())
    trace.header["max_context"] = reach
    assert load_trace(trace.save(tmp_path / "fits.npz")).max_context == reach
    trace.header["max_context"] = reach - 1
    with pytest.raises(TraceError, match="past the max_context"):
        load_trace(trace.save(tmp_path / "short.npz"))
    del trace.header["max_context"]  # recorded before the field: loads, unlimited
    assert load_trace(trace.save(tmp_path / "old.npz")).max_context is None


def test_record_refuses_a_drafter_whose_largest_tree_a_trace_cannot_hold(tiny, tmp_path):
    """A trace stores parents as int16: an n-gram drafter whose options allow 65,536 nodes was recorded to the end
    (parents wrapped) and refused only when loaded. Refused before any decoding now, naming the drafter."""
    from env.trace_record import record

    prompts = [Prompt("p0", "toy", " ".join(map(str, SHORT)))]
    opts = {"ngram": {"max_ngram": 1, "max_matches": 1024, "max_depth": 64}}
    with pytest.raises(TraceError, match="ngram's largest proposal .* is more than a trace's 32768") as err:
        record(tiny, prompts, ["ngram"], tmp_path / "big.npz", max_new_tokens=NEW, progress=False,
               drafter_options=opts)  # fmt: skip
    assert "\n" not in str(err.value) and not any(tmp_path.iterdir())
