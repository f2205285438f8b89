"""``draftgym record`` compares the text of a workload that is no file (the built-in set, a ``code:`` source) on a
resume and on a rerun: a package upgrade may change a prompt's text under the same id."""

from __future__ import annotations

import json

import pytest

from env.trace import TraceError
from env.trace_record import record
from env.workloads import Prompt
from tests.env.kills import dies_on_call

BEFORE = [
    Prompt("code-x-a", "code", "Write a function that adds two numbers."),
    Prompt("code-x-b", "code", "Hi."),
]
AFTER = [Prompt("code-x-a", "code", "Write a function that adds three numbers."), BEFORE[1]]


@pytest.fixture(scope="module")
def tiny():
    from env.model import load_model

    return load_model("random:llama-tiny", dtype="fp32", device="cpu")


def test_a_code_workloads_text_is_compared_on_resume_and_rerun(tiny, tmp_path, monkeypatch):
    import env.trace_record as trace_mod
    import env.workloads

    package = [BEFORE]  # the installed package's prompts: upgraded below
    monkeypatch.setattr(env.workloads, "load_workload", lambda *a, **k: package[0])

    real = trace_mod.record_prompt
    out = tmp_path / "t.npz"
    go = dict(max_new_tokens=3, progress=False, workload="code:x")
    monkeypatch.setattr(trace_mod, "record_prompt", dies_on_call(2, real))
    with pytest.raises(KeyboardInterrupt):
        record(tiny, BEFORE, ["ngram"], out, **go)
    monkeypatch.setattr(trace_mod, "record_prompt", real)
    package[0] = AFTER
    with pytest.raises(
        TraceError, match=r"partial recording with other settings \(workload_prompts_sha256 differ"
    ):
        record(tiny, AFTER, ["ngram"], out, **go)
    package[0] = BEFORE

    head = out.with_name(out.name + ".parts") / "header.json"
    older = json.loads(head.read_text())
    older.pop("workload_prompts_sha256")  # a recording started before the key: taken as it is
    head.write_text(json.dumps(older))
    trace = record(tiny, BEFORE, ["ngram"], out, **go)
    assert trace.header["workload_prompts_sha256"] and trace.num_prompts == 2
    package[0] = AFTER
    with pytest.raises(
        TraceError, match=r"already holds a trace of other settings \(workload_prompts_sha256"
    ):
        record(tiny, AFTER, ["ngram"], out, **go)
    package[0] = BEFORE
    assert record(tiny, BEFORE, ["ngram"], out, **go).num_prompts == 2  # the same text: returned as it is
