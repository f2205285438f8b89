"""Every kind of file draftgym reads, given empty, truncated, wrong-format and hostile content: each is refused
with its package's one-line error (or loaded as data), and a pickle planted in it never runs (the marker file it
would create stays absent). Policy files and stable-baselines3 zips: ``tests/policies/test_safe_files.py``."""

from __future__ import annotations

import hashlib
import json
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest

from tests.hostile import npz_payload, payload, replace_members, torch_payload

ROOT = Path(__file__).resolve().parents[1]


def _variants(tmp: Path, good: bytes, hostile: bytes) -> dict[str, Path]:
    out = {}
    for name, data in {
        "empty": b"",
        "truncated": good[: max(1, len(good) // 3)],
        "garbage": b"\x00\xffthis is no file format\x81",
        "json-instead": b'{"format": "something else"}',
        "hostile": hostile,
    }.items():
        out[name] = tmp / f"{name}.bin"
        out[name].write_bytes(data)
    return out


KINDS = ["empty", "truncated", "garbage", "json-instead", "hostile"]


def _refused(error: type[Exception], load, marker: Path) -> None:
    """``load()`` fails with ``error`` in one line, and the hostile payload did not run."""
    with pytest.raises(error) as err:
        load()
    assert "\n" not in str(err.value) and not marker.exists()


@pytest.mark.parametrize("kind", KINDS)
def test_trace(kind, tmp_path):
    from env.trace import TraceError, default_trace_path, load_trace

    marker = tmp_path / "RAN"
    files = _variants(tmp_path, default_trace_path().read_bytes(), npz_payload(marker))
    _refused(TraceError, lambda: load_trace(files[kind]), marker)


def test_trace_with_an_invalid_tree_is_refused(tmp_path):
    """A trace whose recorded tree points a node at a later parent (an out-of-bounds walk in replay)."""
    from env.trace import TraceError, default_trace_path, load_trace

    with np.load(default_trace_path(), allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    off = arrays["tree/ngram/off"]
    t = int(np.argmax(np.diff(off) >= 2))  # the first tree with a draft node
    parents = arrays["tree/ngram/parents"].copy()
    parents[off[t] + 1] = 5  # its node 1: a parent that is not before it
    arrays["tree/ngram/parents"] = parents
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(TraceError, match=f"invalid tree/ngram: node 1 of tree {t} has parent 5"):
        load_trace(tmp_path / "bad.npz")


@pytest.mark.parametrize("kind", KINDS)
def test_cost_model(kind, tmp_path):
    from env.cost import CostModelError, default_cost_model_path, load_cost_model

    marker = tmp_path / "RAN"
    files = _variants(tmp_path, default_cost_model_path().read_bytes(), payload(marker))
    _refused(CostModelError, lambda: load_cost_model(files[kind]), marker)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("member", [".safetensors", ".json"])
def test_head(member, kind, tmp_path):
    """A head's tensors or its JSON description replaced by damaged or hostile bytes (the other left valid)."""
    from drafters import DrafterError
    from drafters.heads import load_head
    from tests.drafters.tiny import random_head, tiny_loaded

    loaded = tiny_loaded()
    path = random_head("eagle", loaded, tmp_path / "h").with_suffix(member)
    marker = tmp_path / "RAN"
    hostile = torch_payload(marker) if member == ".safetensors" else payload(marker)
    files = _variants(tmp_path, path.read_bytes(), hostile)
    shutil.copy(files[kind], path)
    _refused(DrafterError, lambda: load_head(path, "eagle", loaded.model, loaded.model_id), marker)


@pytest.mark.parametrize("kind", KINDS)
def test_drafter_training_state(kind, tmp_path):
    """The resumable state of ``train-drafter`` (it was read with ``weights_only=False``)."""
    import torch

    from drafters import DrafterError
    from drafters.train import load_train_state

    good = tmp_path / "good.pt"
    torch.save({"head": {"w": torch.ones(2)}, "opt": {}, "step": 3, "cpu_s": 1.0, "epoch": 0}, good)
    assert load_train_state(good)["step"] == 3  # the real format loads
    marker = tmp_path / "RAN"
    files = _variants(tmp_path, good.read_bytes(), torch_payload(marker))
    _refused(DrafterError, lambda: load_train_state(files[kind]), marker)


@pytest.mark.parametrize("kind", KINDS)
def test_bandit_policy_state(kind, tmp_path):
    """A draftgym policy whose state member is damaged or a pickle (checksum made to match)."""
    from policies import PolicyError, load_policy

    src = ROOT / "policies" / "data" / "linucb.zip"
    with zipfile.ZipFile(src) as z:
        good = z.read("state.npz")
        header = json.loads(z.read("header.json"))
    marker = tmp_path / "RAN"
    data = _variants(tmp_path, good, npz_payload(marker))[kind].read_bytes()
    header["payload"]["state.npz"] = hashlib.sha256(data).hexdigest()
    path = replace_members(
        src, tmp_path / "p.zip", {"state.npz": data, "header.json": json.dumps(header).encode()}
    )
    _refused(PolicyError, lambda: load_policy(path), marker)


@pytest.mark.parametrize("kind", KINDS)
def test_config(kind, tmp_path):
    """TOML cannot carry code; damaged content is a ConfigError (an empty file is a valid, all-default config)."""
    from experiments.config import load_config
    from experiments.strict_toml import ConfigError

    good = (ROOT / "experiments" / "configs" / "bandit.toml").read_bytes()
    good = good[: good.index(b'= "') + 4] * 3  # truncated: cut inside a string
    path = _variants(tmp_path, good, payload(tmp_path / "RAN"))[kind]
    if kind == "empty":
        assert load_config(path).name
        return
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "\n" not in str(err.value) and not (tmp_path / "RAN").exists()


@pytest.mark.parametrize("kind", KINDS)
def test_workload(kind, tmp_path):
    from env.workloads import WorkloadError, builtin_path, load_workload

    path = _variants(tmp_path, builtin_path().read_bytes(), payload(tmp_path / "RAN"))[kind]
    with pytest.raises(WorkloadError) as err:
        load_workload(path)
    assert "\n" not in str(err.value)


def test_bench_records_with_a_torn_line_resume(tmp_path):
    """A killed bench leaves a torn last line in records.jsonl: it is dropped (and cut), the rest kept."""
    from experiments.records import Record, load_done

    rec = Record("ar", "p1", "qa", 3, 2, 0.1, 2, 1.0, [5, 6])
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps(rec.__dict__) + "\n" + '{"method": "ar", "prom')
    torn = path.read_bytes()
    # a reader beside a run that may still be appending (agreement, report) leaves the file as it is
    assert load_done(path, repair=False) == [rec] and path.read_bytes() == torn
    assert load_done(path) == [rec]
    assert path.read_text().endswith("\n")
    # a record holding a raw U+2028 (JSON allows it inside a string) is one line, not two torn halves
    other = Record("ar", "p\u2028two", "qa", 3, 2, 0.1, 2, 1.0, [5, 6])
    path.write_text(json.dumps(other.__dict__, ensure_ascii=False) + "\n", encoding="utf-8")
    assert load_done(path) == [other]


def test_a_run_folder_remembers_its_settings(tmp_path, capsys):
    """``settings.json``: written at the first run, a resume with the same settings passes, one with other settings
    (results on disk) is refused in one line naming what differs, a fresh folder takes any; the JSONL reader cuts a
    torn last line."""
    from env.files import jsonl_lines, settings_conflict
    from experiments.args import same_settings
    from experiments.errors import UserError

    a = {"model": "m", "dtype": "float32", "max_new_tokens": 8, "prompts": [1, 2]}
    assert settings_conflict(tmp_path, a, started=False) is None
    assert json.loads((tmp_path / "settings.json").read_text()) == a
    assert settings_conflict(tmp_path, a, started=True) is None
    b = {**a, "max_new_tokens": 16}
    why = settings_conflict(tmp_path, b, started=True)
    assert why is not None and "max_new_tokens: 8 there, 16 now" in why and "\n" not in why
    with pytest.raises(UserError, match="other settings.*--out"):
        same_settings(tmp_path, b, started=True, command="run")
    assert json.loads((tmp_path / "settings.json").read_text()) == a  # nothing changed
    assert settings_conflict(tmp_path, b, started=False) is None  # no results yet: the new settings are kept
    assert json.loads((tmp_path / "settings.json").read_text()) == b
    c = {**b, "seed": 0}  # a setting checked since the folder's file was written: recorded, then compared
    capsys.readouterr()
    assert settings_conflict(tmp_path, c, started=True) is None
    assert json.loads((tmp_path / "settings.json").read_text()) == c
    err = capsys.readouterr().err  # ... and said, once
    assert err.count("\n") == 1 and "settings.json did not record seed; its earlier results" in err, err
    assert settings_conflict(tmp_path, c, started=True) is None and capsys.readouterr().err == ""
    assert "seed: 0 there, 7 now" in settings_conflict(tmp_path, {**c, "seed": 7}, started=True)
    (tmp_path / "settings.json").write_text("[1, 2]")
    assert "not a settings object" in settings_conflict(tmp_path, b, started=True)
    log = tmp_path / "x.jsonl"
    log.write_text('{"a": 1}\n{"a": 2}\n{"a"')
    assert jsonl_lines(log) == ['{"a": 1}', '{"a": 2}'] and log.read_text() == '{"a": 1}\n{"a": 2}\n'
    assert jsonl_lines(tmp_path / "none.jsonl") == []


def test_bench_records_of_the_wrong_types_are_run_again(tmp_path):
    """A record a resume reads back must be one we could have written: a wrong-typed one is skipped (its prompt runs
    again), not carried into the summary's arithmetic."""
    from experiments.records import Record, load_done

    good = Record("ar", "p1", "qa", 3, 2, 0.1, 2, 1.0, [5, 6])
    bad = [{**good.__dict__, "new_tokens": "x"}, {**good.__dict__, "wall_s": float("nan")},
           {**good.__dict__, "token_ids": [5, -1]}, {**good.__dict__, "tau": True},
           {**good.__dict__, "new_tokens": 10**6}]  # (two ids: 10^6 tokens gave 10^12 tokens/s)  # fmt: skip
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [good.__dict__, *bad]))
    assert load_done(path) == [good]


def test_a_resume_may_add_a_policy_but_not_change_one(tmp_path):
    from env.files import settings_conflict

    a = {"model": "m", "policies": {"policy:u": "aa"}}
    assert settings_conflict(tmp_path, a, started=False) is None
    more = {"model": "m", "policies": {"policy:u": "aa", "policy:v": "bb"}}
    assert settings_conflict(tmp_path, more, started=True) is None  # one more method, as --methods may add
    # the entry that differs is named (the message once said "a JSON object there, a JSON object now"); a file's
    # digest by its first 12 digits
    why = settings_conflict(tmp_path, {"model": "m", "policies": {"policy:u": "cc"}}, started=True)
    assert "(policies.policy:u: 'aa' there, 'cc' now)" in why, why
    assert settings_conflict(tmp_path, {"model": "m", "policies": {}}, started=True) is None  # one left out
    why = settings_conflict(tmp_path, {"model": "m", "policies": {"policy:v": "0" * 64}}, started=True)
    assert "(policies.policy:v: 'bb' there, sha256 000000000000… now)" in why, why
    # a mapping that is not extendable: an entry added or left out differs too
    assert settings_conflict(tmp_path / "o", {"opts": {"a": 1}}, started=False) is None
    why = settings_conflict(tmp_path / "o", {"opts": {"b": 2}}, started=True)
    assert "(opts.a: 1 there, (none) now; opts.b: (none) there, 2 now)" in why, why


def test_a_damaged_or_hostile_drafter_state_is_one_line(tmp_path):
    """``experiments.drafter_state``: a run's saved drafter state (suffix cache, recycling table) comes back whole;
    torn, pickled, of another method or with arrays a drafter refuses, it is one line naming the file."""
    import pickle
    from types import SimpleNamespace

    from drafters import DraftContext, SuffixDrafter, TreeShape
    from experiments.drafter_state import restore_drafters, resume_drafters, save_drafters, state_file
    from experiments.errors import UserError
    from experiments.records import Record

    d = SuffixDrafter()
    d.reset(DraftContext(tokens=[1, 2], prompt_len=2))
    d.propose(DraftContext(tokens=[1, 2, 40, 41, 42], prompt_len=2), TreeShape(depth=2))
    d.reset(DraftContext(tokens=[9], prompt_len=1))  # the answer [40, 41, 42] is in the cache now
    rec = Record("suffix-d8", "p1", "qa", 2, 3, 0.1, 2, 1.5, [40, 41, 42])
    save_drafters(SimpleNamespace(drafters={"suffix": d}), tmp_path, "suffix-d8", rec, ["p1"])
    fresh = SimpleNamespace(drafters={"suffix": SuffixDrafter()})
    records, rec_path = [], tmp_path / "records.jsonl"
    pending = resume_drafters({"suffix-d8": fresh}, tmp_path, rec_path, records, None)
    restore_drafters({"suffix-d8": fresh}, pending, tmp_path, None)
    assert (
        records == [rec] and json.loads(rec_path.read_text()) == rec.__dict__
    )  # the record only in the state
    assert fresh.drafters["suffix"].carried()["answers"].tolist() == [40, 41, 42]
    path = state_file(tmp_path, "suffix-d8")
    good = path.read_bytes()
    arrays = dict(np.load(path))
    cases = [
        (good[: len(good) // 2], "is not a drafter state of this run"),
        (pickle.dumps({"x": 1}), "is not a drafter state of this run"),
    ]
    for raw, needle in cases:
        path.write_bytes(raw)
        with pytest.raises(UserError, match=needle) as err:
            resume_drafters({"suffix-d8": fresh}, tmp_path, rec_path, [], None)
        assert "\n" not in str(err.value) and str(path) in str(err.value)
    other = {
        **arrays,
        "run_record": np.frombuffer(json.dumps({**rec.__dict__, "method": "x"}).encode(), np.uint8),
    }
    np.savez(path, **other)
    with pytest.raises(UserError, match="its record is not one of method 'suffix-d8'"):
        resume_drafters({"suffix-d8": fresh}, tmp_path, rec_path, [], None)
    np.savez(path, **{**arrays, "suffix/answers": -arrays["suffix/answers"]})
    rec_path.unlink()
    with pytest.raises(UserError, match="suffix state: a negative token id; delete it"):
        resume_drafters({"suffix-d8": fresh}, tmp_path, rec_path, [], None)
    assert not rec_path.exists()  # checked before its record was appended
    np.savez(path, **arrays)
    with pytest.raises(
        UserError, match="suffix state: token id 42 is outside the target's vocabulary .0, 42.; del"
    ):
        resume_drafters({"suffix-d8": fresh}, tmp_path, rec_path, [], 42)  # ids 40..42: not this target's
    assert not rec_path.exists()
    np.savez(path, **arrays)
    other = Record("suffix-d8", "p0", "qa", 2, 3, 0.1, 2, 1.5, [1, 2, 3])
    with pytest.raises(UserError, match="learned from other prompts of suffix-d8 than"):
        resume_drafters(
            {"suffix-d8": fresh}, tmp_path, rec_path, [other, rec], None
        )  # records the state never saw
    path.unlink()
    with pytest.raises(UserError, match="suffix-d8 has 1 records in .* but no saved drafter state"):
        resume_drafters({"suffix-d8": fresh}, tmp_path, rec_path, [rec], None)


def test_a_folder_another_command_wrote_is_refused_with_or_without_results(tmp_path):
    """``run --out SWEEP_FOLDER`` replaced the sweep's settings with its own (no results of its own yet), and the
    sweep no longer resumed; a sweep folder from before the command was recorded is known by its settings."""
    from env.files import settings_conflict

    sweep = {"storage": "study.db", "study": "sw"}
    assert settings_conflict(tmp_path, sweep, started=False, command="sweep") is None
    assert json.loads((tmp_path / "settings.json").read_text())["command"] == "sweep"
    for started in (False, True):
        why = settings_conflict(tmp_path, {"model": "m"}, started=started, command="run")
        assert why is not None and "is draftgym sweep's folder" in why and "draftgym run" in why, why
    assert json.loads((tmp_path / "settings.json").read_text()) == {**sweep, "command": "sweep"}
    assert settings_conflict(tmp_path, sweep, started=True, command="sweep") is None  # its own resume
    (tmp_path / "settings.json").write_text(json.dumps(sweep))  # written before the command was recorded
    assert "draftgym sweep's" in settings_conflict(tmp_path, {"model": "m"}, started=False, command="run")
    assert settings_conflict(tmp_path, sweep, started=True, command="sweep") is None
