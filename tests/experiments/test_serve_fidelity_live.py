"""``experiments.serve_fidelity.diagnose`` on a real (tiny) model: the replayed and the live stream of a static arm
take the same steps and commit the same tokens where the trace's replay is exact (n-gram), and the live side's
time splits into prefill, forward, drafting and the rest of the serving loop, over the span the goodput counts."""

from __future__ import annotations

import pytest

from env.workloads import Prompt
from tests.env.conftest import tiny_words
from tests.env.test_batch_cost import fitted

LOOPS = [[7, 21, 4, 60, 33], [12, 9, 51, 3], [40, 41, 42, 43, 44, 45], [8, 2, 8, 5]]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    from env.trace_record import record

    loaded = tiny_words()
    out = tmp_path_factory.mktemp("fid") / "trace.npz"
    prompts = [Prompt(f"p{i}", "toy", " ".join(map(str, LOOPS[i % 4] * (3 + i)))) for i in range(8)]
    return loaded, record(loaded, prompts, ["ngram"], out, max_new_tokens=24, progress=False)


@pytest.mark.parametrize("arm, load", [("ngram-d3", "2"), ("none", "1")])
def test_replay_and_live_take_the_same_steps_and_split_the_live_time(recorded, arm, load):
    from experiments.serve_fidelity import diagnose

    loaded, trace = recorded
    r = diagnose(fitted(), arm, load, loaded, requests=4, trace=trace, arms=["none", "ngram-d3"])
    a, b = r["replay"], r["live"]
    assert r["requests"] == 4 and a["tokens"] == b["tokens"] > 0
    assert a["steps"] == b["steps"] > 0  # n-gram replay is exact: the same acceptance step by step
    assert a["forward_s"] > 0 and a["step_s"] == pytest.approx(a["forward_s"] + a["draft_s"])
    assert (a["draft_s"] > 0) == (b["draft_s"] > 0) == (arm != "none")
    assert b["forward_s"] > 0 and b["forward_s"] + b["draft_s"] <= b["step_s"]
    # the span the goodput counts holds the prefills and the steps; the server's setup is not in it
    assert b["prefill_s"] + b["step_s"] <= b["wall_s"] and b["other_s"] >= 0 and b["setup_s"] >= 0
    assert (
        b["bookkeeping_s"] == pytest.approx(b["step_s"] - b["forward_s"] - b["draft_s"])
        and b["bookkeeping_s"] >= 0
    )
