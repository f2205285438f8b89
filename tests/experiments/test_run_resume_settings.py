"""``draftgym run`` resumes only what it can continue: besides the config file's values, the model as loaded here
(``auto`` dtype, device and weights resolve per machine), the workload file's contents and each policy file's
contents must be those the records were made with (``settings.json``); else one line names what differs."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from experiments.config import load_config
from experiments.errors import UserError
from experiments.records import load_done
from experiments.runner import run

ROOT = Path(__file__).resolve().parents[2]
ARMS = ["none", "ngram-d2", "ngram-d4", "ngram-d8", "ngram-d16", "ngram-d4-k2", "ngram-d8-k4-b24"]


def _workload(path: Path, first: str) -> None:
    rows = [
        {"question_id": 1, "category": "qa", "turns": [first]},
        {"question_id": 2, "category": "qa", "turns": ["Name three colours."]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _kill(out: Path) -> None:
    """What a kill before the last record leaves."""
    lines = (out / "records.jsonl").read_text().splitlines(keepends=True)
    (out / "records.jsonl").write_text("".join(lines[:-1]))


@pytest.mark.model
def test_a_resume_checks_the_loaded_model_and_the_files_contents(tmp_path, fp32_model):
    _workload(tmp_path / "w.jsonl", "Say hello.")
    shutil.copy(ROOT / "policies" / "data" / "best-static.zip", tmp_path / "p.zip")
    text = f"""name = "resume"
methods = ["ar", "policy:s"]
[model]
dtype = "fp32"
device = "cpu"
[workload]
path = "{tmp_path / "w.jsonl"}"
[decode]
max_new_tokens = 2
warmup = false
[policies.s]
kind = "static"
arms = {json.dumps(ARMS)}
path = "{tmp_path / "p.zip"}"
"""
    cfg = load_config(None, text=text)
    out = tmp_path / "run"
    run(cfg, out, progress=False, loaded=fp32_model)
    assert len(load_done(out / "records.jsonl")) == 4
    settings = json.loads((out / "settings.json").read_text())
    assert settings["device"] == "cpu" and set(settings["policies"]) == {"policy:s"}

    _kill(out)
    original = (tmp_path / "p.zip").read_bytes()
    from policies import load_policy

    pol = load_policy(tmp_path / "p.zip")
    pol.meta = {**pol.meta, "name": "another"}
    pol.save(tmp_path / "p.zip")  # the same path, other contents
    with pytest.raises(UserError, match=r"policies\.policy:s: sha256 [0-9a-f]{12}… there"):
        run(cfg, out, progress=False, loaded=fp32_model)
    (tmp_path / "p.zip").write_bytes(original)

    _workload(tmp_path / "w.jsonl", "Say goodbye.")  # the same prompt ids, another text
    with pytest.raises(UserError, match="workload_sha256"):
        run(cfg, out, progress=False, loaded=fp32_model)
    _workload(tmp_path / "w.jsonl", "Say hello.")

    # started where "auto" resolved to a GPU: this CPU does not continue it
    (out / "settings.json").write_text(json.dumps({**settings, "device": "cuda:0"}))
    with pytest.raises(UserError, match="device: 'cuda:0' there, 'cpu' now"):
        run(cfg, out, progress=False, loaded=fp32_model)
    (out / "settings.json").write_text(json.dumps(settings))

    # started on another CPU: its timings are not mixed with this one's
    from env.machine import cpu_label

    assert settings["cpu"] == cpu_label()
    other = "Other CPU (family 1 model 2; no native bf16)"
    (out / "settings.json").write_text(json.dumps({**settings, "cpu": other}))
    with pytest.raises(UserError, match=rf"cpu: '{re.escape(other)}' there, '{re.escape(cpu_label())}' now"):
        run(cfg, out, progress=False, loaded=fp32_model)
    (out / "settings.json").write_text(json.dumps(settings))

    # started under the other C allocator setting (env.allocator): its step times are not this process's
    here = settings["allocator"]
    assert here in ("keep", "keep-32MiB", "partial", "unavailable", "preloaded", "system", "untouched")
    (out / "settings.json").write_text(json.dumps({**settings, "allocator": "other"}))
    with pytest.raises(UserError, match=rf"allocator: 'other' there, '{re.escape(here)}' now"):
        run(cfg, out, progress=False, loaded=fp32_model)
    (out / "settings.json").write_text(json.dumps({**settings, "allocator_env": {"MALLOC_ARENA_MAX": "1"}}))
    with pytest.raises(UserError, match=r"allocator_env\.MALLOC_ARENA_MAX: '1' there, \(none\) now"):
        run(cfg, out, progress=False, loaded=fp32_model)
    (out / "settings.json").write_text(json.dumps(settings))

    assert len(load_done(out / "records.jsonl")) == 3  # nothing was added by the refused resumes
    run(cfg, out, progress=False, loaded=fp32_model)  # the same settings: it resumes
    assert len(load_done(out / "records.jsonl")) == 4
