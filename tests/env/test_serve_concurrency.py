"""The live server's admission on the tiny target, on a clock that ticks at every read: a closed loop holds at
most its concurrency in flight (and the engine's rows bound the batch below ``max_batch``); a closed-loop request
arrives when it enters, an open-loop one at its time, in arrival order."""

from __future__ import annotations

import pytest

from env.batch import BatchEngine
from env.engine import NO_DRAFT, parse_arm
from env.serving import Request, ServeLog, serve
from tests.drafters.tiny import tiny_loaded

LOOP = [7, 21, 4, 60, 33, 12, 9, 51]


@pytest.fixture(scope="module")
def loaded():
    return tiny_loaded()


class TickClock:
    """A clock that moves one second every time it is read: every event of a run gets its own time."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def _most_in_flight(out) -> int:
    return max(sum(o.first_token_s <= s.first_token_s < o.finish_s for o in out) for s in out)


@pytest.mark.parametrize("concurrency", [1, 2])
def test_the_closed_loop_never_holds_more_than_its_concurrency(loaded, concurrency):
    """Rows to spare (4) and 5 requests: exactly ``concurrency`` in flight at a time, never one more."""
    reqs = [Request(str(i), LOOP * 2 + [i + 3], parse_arm("ngram-d2"), 6 + i) for i in range(5)]
    out = serve(
        BatchEngine(loaded, max_rows=4), reqs, concurrency=concurrency, max_batch=4, clock=TickClock()
    )
    assert _most_in_flight(out) == concurrency


def test_the_engine_rows_bound_the_batch_below_max_batch(loaded):
    reqs = [Request(str(i), LOOP * 2 + [i + 3], NO_DRAFT, 6 + i) for i in range(4)]
    log = ServeLog()
    out = serve(BatchEngine(loaded, max_rows=2), reqs, concurrency=4, max_batch=4, clock=TickClock(), log=log)
    assert _most_in_flight(out) == 2 and log.row_steps <= 2 * log.steps
    # every row of every step counted once: the rows' own step counts add up to it, and the batch held 2 mostly
    assert log.row_steps == sum(sum(o.arm_steps.values()) for o in out) == sum(o.steps - 1 for o in out)
    assert log.mean_batch > 1.5


def test_a_closed_loop_request_arrives_when_it_enters_and_an_open_loop_one_at_its_time(loaded):
    """Closed loop: the arrival recorded is the time the request entered (its own arrival_s is ignored)."""
    reqs = [Request(str(i), LOOP * 2 + [i + 3], NO_DRAFT, 4, arrival_s=0.0) for i in range(3)]
    out = serve(BatchEngine(loaded, max_rows=1), reqs, concurrency=1, max_batch=1, clock=TickClock())
    assert [o.arrival_s for o in out] == sorted(o.arrival_s for o in out) and out[-1].arrival_s > 0
    assert all(o.arrival_s <= o.first_token_s for o in out)
    clock = TickClock()
    late = [Request("b", LOOP * 2, NO_DRAFT, 4, arrival_s=3.0), Request("a", LOOP * 2 + [5], NO_DRAFT, 4)]
    out = serve(BatchEngine(loaded, max_rows=1), late, max_batch=1, clock=clock, sleep=lambda s: None)
    assert [(o.rid, o.arrival_s) for o in out] == [("a", 0.0), ("b", 3.0)]
    a, b = out
    assert a.first_token_s < b.first_token_s  # open loop: served in arrival order, not in list order
