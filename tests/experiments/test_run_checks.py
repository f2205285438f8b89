"""``draftgym run`` checks what its records depend on before it decodes or writes anything, and again when a finished
run is rerun: the head file each head drafter loads (the default one too), the text of a ``code:`` workload's
prompts, every prompt's length against the context, the run's name; a refused start leaves no provenance line, and
the line of a start names what the loaded model settled."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from env.target import PromptError
from experiments.config import ConfigError, load_config
from experiments.errors import UserError
from experiments.records import load_done
from experiments.runner import run

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny():
    from env.model import load_model

    return load_model("random:llama-tiny", dtype="fp32", device="cpu")


def _workload(path: Path, first: str = "What is 1 plus 1?", extra: str = "Name three colours.") -> Path:
    rows = [
        {"question_id": 1, "category": "qa", "turns": [first]},
        {"question_id": 2, "category": "qa", "turns": [extra]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _config(workload: str, methods: list[str], extra: str = "") -> str:
    return f"""name = "checks"
methods = {json.dumps(methods)}
[model]
name = "random:llama-tiny"
dtype = "fp32"
device = "cpu"
[workload]
path = "{workload}"
[decode]
max_new_tokens = 3
warmup = false
{extra}"""


def _kill(out: Path) -> None:
    """What a kill before the last record leaves."""
    lines = (out / "records.jsonl").read_text().splitlines(keepends=True)
    (out / "records.jsonl").write_text("".join(lines[:-1]))


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.is_file() else 0


def test_a_retrained_default_head_is_refused_on_resume_and_on_rerun(tmp_path, tiny, monkeypatch):
    from drafters.heads import cache_heads_dir, head_name
    from tests.drafters.tiny import random_head

    monkeypatch.setenv("DRAFTGYM_CACHE", str(tmp_path / "cache"))  # the head find_head picks without weights
    head = cache_heads_dir() / f"{head_name('eagle', tiny.model_id)}.safetensors"
    head.parent.mkdir(parents=True)
    random_head("eagle", tiny, head, seed=1)
    first, first_desc = head.read_bytes(), head.with_suffix(".json").read_bytes()
    cfg = load_config(None, text=_config(str(_workload(tmp_path / "w.jsonl")), ["ar", "eagle-d2"]))
    out = tmp_path / "run"
    run(cfg, out, progress=False, loaded=tiny)
    import hashlib

    settings = json.loads((out / "settings.json").read_text())
    assert settings["drafter_head.eagle"] == hashlib.sha256(first).hexdigest()
    prov = _lines(out / "provenance.jsonl")

    random_head("eagle", tiny, head, seed=2)  # retrained under the same name
    with pytest.raises(
        UserError, match="drafter_head.eagle: sha256 [0-9a-f]{12}… there, sha256 [0-9a-f]{12}… now"
    ):
        run(cfg, out, progress=False, loaded=None)  # finished: no model is loaded, the head is still checked
    _kill(out)
    with pytest.raises(UserError, match="drafter_head.eagle"):
        run(cfg, out, progress=False, loaded=tiny)
    assert len(load_done(out / "records.jsonl")) == 3 and _lines(out / "provenance.jsonl") == prov

    head.write_bytes(first)  # the head the records were made with (both its files): it resumes
    head.with_suffix(".json").write_bytes(first_desc)
    run(cfg, out, progress=False, loaded=tiny)
    assert len(load_done(out / "records.jsonl")) == 4 and _lines(out / "provenance.jsonl") == prov + 1


def test_heads_of_policy_arms_and_hybrid_parts_are_identified(tmp_path, monkeypatch):
    from drafters.heads import cache_heads_dir, head_name
    from experiments.runner import file_settings

    monkeypatch.setenv("DRAFTGYM_CACHE", str(tmp_path / "cache"))
    cache_heads_dir().mkdir(parents=True)
    for kind, data in (("eagle3", b"three"), ("early_exit", b"exit")):
        (cache_heads_dir() / f"{head_name(kind, 'random-llama-tiny')}.safetensors").write_bytes(data)
    (tmp_path / "given.safetensors").write_bytes(b"given")
    extra = f"""[drafters.hybrid]
parts = "suffix,eagle3"
[drafters.early_exit]
weights = "{tmp_path / "given.safetensors"}"
[policies.p]
kind = "static"
arms = ["none", "early_exit-d2", "eagle-d2"]
"""
    cfg = load_config(None, text=_config("builtin", ["ar", "hybrid-d3", "policy:p"], extra))
    got = {k: v for k, v in file_settings(cfg, "random-llama-tiny").items() if k.startswith("drafter_head")}
    import hashlib

    # eagle has no head for this model: left out (its drafter says so when it loads)
    assert got == {
        "drafter_head.early_exit": hashlib.sha256(b"given").hexdigest(),
        "drafter_head.hybrid.eagle3": hashlib.sha256(b"three").hexdigest(),
    }


def test_a_code_workloads_text_is_compared_on_resume_and_on_rerun(tmp_path, tiny, monkeypatch):
    import importlib

    from env.workloads import _documented_functions

    pkg = tmp_path / "pkgs" / "checkspkg"
    pkg.mkdir(parents=True)
    source = '''def alpha(x):
    """Return the sum of the numbers in the list x, skipping any value that is None."""
def beta(y):
    """Return the smallest odd number in the list y, or zero when there is none at all."""
'''
    (pkg / "__init__.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    importlib.invalidate_caches()
    _documented_functions.cache_clear()
    cfg = load_config(None, text=_config("code:checkspkg", ["ar"]))
    out = tmp_path / "run"
    run(cfg, out, progress=False, loaded=tiny)
    assert json.loads((out / "settings.json").read_text())["workload_prompts_sha256"]

    (pkg / "__init__.py").write_text(
        source.replace("skipping any value that is None", "skipping None values")
    )
    _documented_functions.cache_clear()  # the same ids, another text
    with pytest.raises(UserError, match="workload_prompts_sha256"):
        run(cfg, out, progress=False)  # finished
    _kill(out)
    with pytest.raises(UserError, match="workload_prompts_sha256"):
        run(cfg, out, progress=False, loaded=tiny)
    _documented_functions.cache_clear()


def test_prompts_digest_covers_ids_and_text_of_workloads_without_a_file(monkeypatch):
    import env.workloads
    from env.workloads import Prompt, prompts_digest

    a = [Prompt("1", "qa", "Say hello."), Prompt("2", "qa", "Say goodbye.")]
    b = [Prompt("1", "qa", "Say hello!"), Prompt("2", "qa", "Say goodbye.")]
    c = [Prompt("1", "qa", "Say goodbye."), Prompt("2", "qa", "Say hello.")]
    seen = []

    def digest(w, prompts):
        def whole(path=None, *, per_category=None, categories=None):
            seen.append((path, per_category))
            return prompts

        monkeypatch.setattr(env.workloads, "load_workload", whole)
        return prompts_digest(w)

    digests = {digest(w, a) for w in ("code:x", "builtin", None)}
    assert len(digests) == 1 and None not in digests
    assert all(pc >= 1 << 30 for _, pc in seen)  # the whole workload, whatever a run selects
    assert len({digest("code:x", p) for p in (a, b, c)}) == 3
    assert digest("some/file.jsonl", a) is None  # a file's bytes are hashed instead (workload_sha256)


def _finished(tmp_path: Path, tiny) -> tuple[Path, object, Path]:
    """A finished run of ar and ngram-d4 on two prompts: (its workload file, config, folder)."""
    w = _workload(tmp_path / "w.jsonl")
    cfg = load_config(None, text=_config(str(w), ["ar", "ngram-d4"]))
    out = tmp_path / "run"
    run(cfg, out, progress=False, loaded=tiny)
    return w, cfg, out


def test_a_finished_run_is_rechecked_and_an_older_folder_still_reruns(tmp_path, tiny):
    w, cfg, out = _finished(tmp_path, tiny)
    summary = (out / "summary.json").read_text()
    settings = json.loads((out / "settings.json").read_text())

    _workload(w, first="What is 2 plus 2?")  # the same ids, another text, after the run finished
    with pytest.raises(UserError, match="workload_sha256"):
        run(cfg, out, progress=False)
    assert (out / "summary.json").read_text() == summary  # not rebuilt from records of the old text
    _workload(w)

    # a folder from before the new keys: they are recorded, not compared
    older = {k: v for k, v in settings.items() if k not in ("workload_prompts_sha256",)}
    (out / "settings.json").write_text(json.dumps(older))
    run(cfg, out, progress=False)
    assert json.loads((out / "settings.json").read_text()) == settings
    (out / "settings.json").unlink()  # from before settings.json: taken as it is
    run(cfg, out, progress=False)
    assert not (out / "settings.json").exists()


def test_a_prompt_past_the_context_is_refused_before_anything_is_written(tmp_path, tiny):
    w = _workload(tmp_path / "w.jsonl", extra="word " * (tiny.max_context + 10))
    cfg = load_config(None, text=_config(str(w), ["hf_greedy", "ar"]))
    out = tmp_path / "run"
    with pytest.raises(
        PromptError, match=rf"prompt 2 has \d+ tokens; the model's context is {tiny.max_context}"
    ):
        run(cfg, out, progress=False, loaded=tiny)
    assert not out.exists() or list(out.iterdir()) == []


def test_hf_baselines_refuse_a_prompt_past_the_context(tiny):
    from experiments.hf_baselines import HFRunner

    with pytest.raises(PromptError, match="the context is|context is"):
        HFRunner(tiny, "hf_greedy").run([5] * tiny.max_context, 2)


def test_the_provenance_line_names_what_the_loaded_model_settled(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        _config(str(_workload(tmp_path / "w.jsonl")), ["ar"]).replace("[workload]", "[workload]\nlimit = 1")
    )
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "experiments", "run", str(cfg), "--out", str(out), "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    (line,) = (out / "provenance.jsonl").read_text().splitlines()
    assert json.loads(line)["machine"]["fp32_products_reordered"] is not None  # settled by the CPU model load


@pytest.mark.parametrize("name", ["../outside", "", ".", "..", "a/b", "a\\\\b", "/abs"])
def test_a_name_that_leaves_runs_is_refused(name):
    with pytest.raises(ConfigError, match=r"^<config>:1: name is .*one non-empty name") as err:
        load_config(None, text=f'name = "{name}"\n')
    assert "\n" not in str(err.value)


def test_a_bad_name_ends_in_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys):
    from experiments.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.toml").write_text('name = "../outside"\n')
    assert main(["run", "c.toml"]) == 2
    err = capsys.readouterr().err
    assert "name is '../outside'" in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.toml"]


@pytest.mark.parametrize(
    "path", sorted((ROOT / "experiments" / "configs").glob("*.toml")), ids=lambda p: p.name
)
def test_the_shipped_configs_names_are_accepted(path):
    assert load_config(path).name == path.stem


@pytest.mark.parametrize("batch", [[], ["--batch"]])
def test_calibrate_out_never_overwrites_a_file_that_is_not_a_cost_model(tmp_path, capsys, batch):
    """``calibrate --out`` replaced whatever it named (a policy zip, a trace, another command's JSON results, the
    other calibration's cost model) with a cost model's JSON."""
    from env.batch_cost import FORMAT as BATCH
    from env.cost import FORMAT as COST
    from experiments.cli import main

    kind = BATCH if batch else COST
    policy = tmp_path / "p.zip"
    policy.write_bytes(b"PK\x03\x04 a policy")
    bench = tmp_path / "bench.json"
    bench.write_text('{"settings": {}, "rows": []}')
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"format": COST if batch else BATCH}))
    for victim in (policy, bench, other):
        before = victim.read_bytes()
        assert main(["calibrate", *batch, "--model", "random:llama-tiny", "--out", str(victim)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"exists and is not a {kind} file" in err, err
        assert "not overwritten" in err and victim.read_bytes() == before


def test_a_duplicate_record_is_refused_before_the_summary_is_rewritten(tmp_path, tiny):
    """A record appended twice was counted twice in a rewritten summary.json, then the run was refused."""
    from experiments.errors import UserError

    _, cfg, out = _finished(tmp_path, tiny)
    summary = (out / "summary.json").read_bytes()
    first = (out / "records.jsonl").read_text().splitlines(keepends=True)[0]
    with open(out / "records.jsonl", "a") as f:
        f.write(first)
    with pytest.raises(UserError, match="inconsistent: duplicate"):
        run(cfg, out, progress=False, loaded=tiny)
    assert (out / "summary.json").read_bytes() == summary
