"""A recorded arrival trace (``serve-bench --arrivals``, ``experiments.serve_bench.read_arrivals``): one time per
line, non-decreasing (requests may arrive together), comments and blank lines skipped, the first ``n`` taken; only
the times of the requests served are bounded."""

from __future__ import annotations

import pytest

from experiments.errors import UserError
from experiments.serve_bench import MAX_ARRIVAL_S, read_arrivals


def test_requests_may_arrive_together_and_the_first_n_are_taken(tmp_path):
    f = tmp_path / "arrivals.txt"
    f.write_text("# seconds\n0\n0\n\n0.5\n0.5\n2\n7\n")
    assert read_arrivals(str(f), 4) == [0.0, 0.0, 0.5, 0.5]
    assert read_arrivals(str(f), 6) == [0.0, 0.0, 0.5, 0.5, 2.0, 7.0]
    with pytest.raises(UserError, match="has 6 arrival times for 7 requests"):
        read_arrivals(str(f), 7)


def test_only_the_served_requests_arrivals_are_bounded(tmp_path):
    f = tmp_path / "arrivals.txt"
    f.write_text(f"0\n1\n{MAX_ARRIVAL_S + 10}\n")
    assert read_arrivals(str(f), 2) == [0.0, 1.0]  # the third request is not served
    with pytest.raises(UserError, match="request 3 arrives at"):
        read_arrivals(str(f), 3)
    f.write_text("0\n2\n1\n")
    with pytest.raises(UserError, match="line 3: times must be finite, >= 0 and non-decreasing"):
        read_arrivals(str(f), 3)
