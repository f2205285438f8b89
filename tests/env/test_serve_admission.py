"""Open-loop admission in replay (``ServeSim._admit``) as the live server does it (``env.serving.serve``): a request
that arrives while others are prefilled enters before the next batch step, not after it."""

from __future__ import annotations

import numpy as np
import pytest

from env.engine import parse_arm
from env.serve_sim import ServeSim
from env.serving import Request, ServeError, check_load


def test_a_request_arriving_during_a_prefill_enters_before_the_first_step():
    sim = ServeSim(1, arms=["none"], loads=["bursty"], requests=2, max_new_tokens=16, seed=0)
    p = int(sim.pool[np.argmax(sim.prompt_len[sim.pool])])  # the longest prompt: the longest prefill
    pf = float(sim.cost.prefill_s(sim.prompt_len[p]))
    # B arrives halfway through A's prefill
    sim.set_requests(0, [p, p], [0.0, pf / 2], [16, 16], closed=False)
    assert int(sim.active[0].sum()) == 2 and int(sim.queue()[0]) == 0
    assert float(sim.clock[0]) == 2 * pf  # both prefills, back to back, before any step
    _, info = sim.step(np.array([0]))
    assert int(info["rows"][0]) == 2


def test_no_step_runs_with_a_free_slot_while_an_arrived_request_waits():
    for load in ("bursty", "poisson@2", "poisson@8"):
        sim = ServeSim(16, loads=[load], requests=32, max_batch=16, seed=0)
        sim.reset()
        steps = 0
        while not sim.done().all():
            running = ~sim.done()
            free = sim.active.sum(1) < sim.max_batch
            assert not (running & free & (sim.queue() > 0)).any(), load
            sim.step(np.zeros(16, np.int64))
            steps += int(running.sum())
        assert steps > 1000  # the streams ran (the check above saw every step)


@pytest.mark.parametrize("max_new", [0, -3, 2.5, True])
def test_a_request_of_no_new_tokens_is_refused(max_new):
    """The prefill always yields a token: a request for none (or a non-integer count) is refused, not served one."""
    reqs = [Request("a", [1, 2, 3], parse_arm("none"), 4), Request("b", [1, 2], parse_arm("none"), max_new)]
    with pytest.raises(ServeError, match="request b: max_new_tokens must be an integer >= 1"):
        check_load(reqs, concurrency=2, max_batch=2, kv_budget=4096)
    check_load(reqs[:1], concurrency=2, max_batch=2, kv_budget=4096)
