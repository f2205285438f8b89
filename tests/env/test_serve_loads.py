"""``draftgym/SpecServe-v0``'s loads: parsing and the request streams (the ramp's caps, open-loop arrivals), closed-loop
concurrency (per request, as live), open-loop admission of what has arrived (``test_serve_admission.py``: requests
arriving during prefills) and the queue the observation reports."""

from __future__ import annotations

import numpy as np
import pytest

from env.serve_env import DEFAULT_ARMS, Load, ServeEnvError, ServeSim, parse_load, ramp_caps, request_stream
from tests.env.conftest import SERVE_ROWS as M
from tests.env.conftest import serve_kw as kw


@pytest.fixture(scope="module")
def trace(serve_trace):
    return serve_trace


def test_parse_load_and_request_streams():
    assert parse_load(" 3 ", 4) == Load("3", True, 3.0)
    assert parse_load("poisson@1.5", 4) == Load("poisson@1.5", False, 1.5)
    assert parse_load("ramp", 4).closed and not parse_load("bursty", 4).closed
    for bad in ["0", "5", "poisson@0", "poisson@x", "mixed", ""]:
        with pytest.raises(ServeEnvError):
            parse_load(bad, 4)
    rng = np.random.default_rng(0)
    arr, cap = request_stream(parse_load("ramp", 8), 5, 8, 1.0, rng)
    assert cap.tolist() == ramp_caps(8) and (arr == 0).all() and max(ramp_caps(8)) == 8
    assert ramp_caps(4)[:3] == [1, 2, 2] and max(ramp_caps(4)) == 4
    for m, levels in [  # up and down, each level once, held for as many requests as the level
        (4, [1, 2, 4, 2, 1]),
        (16, [1, 2, 4, 8, 16, 8, 4, 2, 1]),
    ]:
        assert ramp_caps(m) == [c for level in levels for c in [level] * level]
    for name in ["bursty", "poisson@2"]:
        arr, cap = request_stream(parse_load(name, 8), 30, 8, 2.0, rng)
        assert len(arr) == 30 and arr[0] == 0 and (np.diff(arr) >= 0).all() and (cap == 8).all()
    arr, _ = request_stream(parse_load("bursty", 8), 200, 8, 2.0, rng)
    assert (np.diff(arr) == 0).sum() > 100  # bursts: many requests arrive together


def test_closed_loop_keeps_exactly_c_in_flight(trace):
    sim = ServeSim(4, **kw(trace, loads=["3"], requests=10, seed=2))
    sim.reset()
    rng = np.random.default_rng(0)
    while not sim.done().all():
        rows = sim.active.sum(1)
        assert (rows <= 3).all()
        assert np.array_equal(rows, np.minimum(3, sim.n_req - sim.finished))  # the next enters as one leaves
        assert (sim.queue() == 0).all()
        sim.step(rng.integers(0, len(DEFAULT_ARMS), size=(4, M)))
    assert (sim.finished == 10).all()


def test_the_ramp_reaches_its_peak(trace):
    sim = ServeSim(2, **kw(trace, loads=["ramp"], max_batch=8, seed=3))
    sim.reset()
    assert (sim.n_req == len(ramp_caps(8))).all() and (sim.active.sum(1) <= 2).all()  # it starts low
    peak = np.zeros(2, np.int64)
    while not sim.done().all():
        peak = np.maximum(peak, sim.active.sum(1))
        sim.step(np.full(2, 2))
    assert (peak == 8).all()


def test_closed_loop_caps_apply_per_request_as_live(trace):
    sim = ServeSim(1, **kw(trace, loads=["1"], requests=4))
    long = [i for i in range(trace.num_prompts) if trace.traj_off[i + 1] - trace.traj_off[i] == 40]
    assert len(long) >= 2
    p = [long[0], long[1], long[0], long[1]]
    sim.set_requests(0, p, [0.0] * 4, [1, 4, 2, 2], closed=True)
    # live: request 0 enters (0 < 1), request 1 too (1 < 4), request 2 waits (2 < 2 is false)
    assert sim.active.sum() == 2
    sim.step(np.zeros(1, np.int64))  # nothing finishes (40 tokens each): nothing more may enter
    assert sim.active.sum() == 2


@pytest.mark.parametrize("load", ["poisson@4", "bursty"])
def test_open_loop_admits_no_request_before_it_arrives(trace, load):
    sim = ServeSim(4, **kw(trace, loads=[load], requests=12, seed=4))
    admitted = []
    inner = sim._admit

    def spy(idx=None):
        ptr, clock, busy = sim.ptr.copy(), sim.clock.copy(), sim.active.any(1)
        inner(idx)
        for i in range(sim.num_envs):
            # an idle server jumps to its next arrival; then each request admitted had arrived by the time the
            # prefills of those admitted before it in this call had run (requests arriving during them enter too)
            by = clock[i] if busy[i] or ptr[i] == sim.ptr[i] else max(clock[i], sim.req_arr[i, ptr[i]])
            for j in range(ptr[i], sim.ptr[i]):
                admitted.append((sim.req_arr[i, j], by, sim.clock[i]))
                by += float(sim.cost.prefill_s(sim.prompt_len[sim.req_prompt[i, j]]))

    sim._admit = spy
    sim.reset()
    queued = 0
    while not sim.done().all():
        queued = max(queued, int(sim.queue().max()))
        sim.step(np.full(4, 3))
    assert len(admitted) == 4 * 12
    for arrival, by, after in admitted:
        assert arrival <= by * (1 + 1e-9) and by <= after * (1 + 1e-9)
    assert any(a > 0 for a, *_ in admitted)  # the arrivals were spread out
    assert queued > 0  # requests waited for a row: the queue the observation reports was not empty


def test_the_queue_counts_the_requests_arrived_and_waiting_for_a_row(trace):
    """Six requests at once and one much later at four slots: four rows, two waiting (the queue and its feature),
    the late one not counted until it arrives."""
    sim = ServeSim(1, **kw(trace))
    p = int(sim.pool[0])
    sim.set_requests(0, [p] * 7, [0.0] * 6 + [1e6], [M] * 7, closed=False)
    assert int(sim.active[0].sum()) == M and sim.queue().tolist() == [2]
    assert sim.observe()[0, 1] == pytest.approx(2 / M)
