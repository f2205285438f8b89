"""``draftgym serve-bench --policy``: each request of a policy's cell is recorded with arm ``policy`` and the steps
it ran per arm the policy chose (serve.json's ``requests``), not the placeholder arm ``none`` (tiny target)."""

from __future__ import annotations

from types import SimpleNamespace

from experiments.serve_bench import request_rows, run_cell, summarize_cell
from tests.drafters.tiny import tiny_loaded

LOOP = [7, 21, 4, 60, 33, 12, 9, 51]


class AlwaysD4:
    arm_names = ["none", "ngram-d2", "ngram-d4"]

    def act(self, obs):
        return 2


def test_a_policys_requests_record_policy_and_their_steps_per_arm():
    method = "policy:always"
    args = SimpleNamespace(
        policy_objects={method: AlwaysD4()}, policy_max_batch={method: 2}, batch_cost_model=None,
        arrivals=None, arrival_times=None, rate=None, seed=0, max_new_tokens=12, max_batch=2,
        kv_budget=1 << 20, prefill_chunk=None, drafter_options={},
    )  # fmt: skip
    prompts = [LOOP * 3 + [i + 3] for i in range(3)]
    rids = [f"p{i}" for i in range(3)]
    served, log = run_cell(tiny_loaded(), method, 2, prompts, rids, args, {})
    cells = {(method, 2): {"served": served, "summary": summarize_cell(method, 2, served, log)}}
    rows = request_rows(cells, [2], [method])
    assert [r["prompt_id"] for r in rows] == rids
    for r in rows:
        assert r["arm"] == "policy" and r["arm_steps"] == {"ngram-d4": r["steps"] - 1}
    assert sum(r["arm_steps"]["ngram-d4"] for r in rows) == log["arm_rows"]["ngram-d4"]
    old = {(method, 2): {"served": [{k: v for k, v in s.items() if k != "arm_steps"} for s in served]}}
    assert all(r["arm_steps"] is None for r in request_rows(old, [2], [method]))  # cells of an older run
